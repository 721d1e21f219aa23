#!/usr/bin/env python3
"""Run the script reader of check_contract.py against real bash on many
generated build scripts: the longer run of DifferentialReaderTest.

Each script (ScriptGenerator in test_check_contract.py: seeded, so a seed
always makes the same scripts) is run by bash with stub compilers that log
their argv, and read by the reader; every certain answer of the reader (the
compiler calls with their outputs, targets and compiled files, the files
left in <output-dir>, a default run that surely fails) must be what bash did.
Prints the counts (scripts, agree, cannot tell, disagree) and the first
scripts where the two differ; exits 1 when any do.

Usage:
    python3 bench/differential_reader.py [--scripts 20000] [--seed 1] [--show 3]
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from test_check_contract import ScriptGenerator, differential  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scripts", type=int, default=20000, help="scripts to generate (default 20000)")
    parser.add_argument("--seed", type=int, default=1, help="the generator's seed (default 1)")
    parser.add_argument("--show", type=int, default=3, help="disagreements to print (default 3)")
    args = parser.parse_args(argv)
    generator = ScriptGenerator(args.seed)
    scripts = [generator.script() for _ in range(args.scripts)]
    start = time.monotonic()
    agree, cannot, differ = differential(scripts)
    print("%d scripts (seed %d): %d agree, %d cannot tell, %d disagree; %.1f s"
          % (len(scripts), args.seed, agree, cannot, len(differ), time.monotonic() - start))
    for script, ran, read in differ[:args.show]:
        print("---\n%s--- bash: %r\n--- reader: %r" % (script, ran, read))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
