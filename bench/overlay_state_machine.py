#!/usr/bin/env python3
"""Long runs of overlay_setup.py's state-machine test.

test_overlay_native.OverlayModelTest drives a real make project through
seeded random sequences of apply, update, revert, gc-stale after an owner
ends, kills at a random mutation, user edits and upgrades of the install,
with two overlays, and checks the tree after every step against its model.
The suite runs three short seeds; this runs many long ones and prints, for
each seed that breaks the model, the seed, the step and the steps so far,
so that the failure can be replayed with the same seed.

Usage:
  python3 bench/overlay_state_machine.py [--seeds 1-50] [--steps 40]

Exit codes: 0 every seed kept the model, 1 a seed broke it, 2 usage.
"""

import argparse
import os
import sys
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import test_overlay_native  # noqa: E402


def seed_range(text: str) -> range:
    first, _, last = text.partition("-")
    return range(int(first), int(last or first) + 1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="1-50", help="FIRST-LAST (default 1-50)")
    parser.add_argument("--steps", type=int, default=40, help="steps per seed (default 40)")
    args = parser.parse_args(argv)
    try:
        seeds = seed_range(args.seeds)
    except ValueError:
        parser.error("--seeds takes FIRST-LAST, e.g. 1-50")
    broken = []
    start = time.monotonic()
    for seed in seeds:
        case = test_overlay_native.OverlayModelTest("test_seeded_sequences_keep_the_model")
        case.run_sequence_only = (seed, args.steps)
        result = unittest.TestResult()
        case.run(result)
        problems = result.failures + result.errors
        if problems:
            broken.append(seed)
            print("seed %d broke the model:\n%s" % (seed, problems[0][1].strip().splitlines()[-1]))
    print("%d seed(s) of %d steps in %.0fs: %d kept the model, %d broke it%s"
          % (len(seeds), args.steps, time.monotonic() - start, len(seeds) - len(broken),
             len(broken), " (%s)" % ", ".join(map(str, broken)) if broken else ""))
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
