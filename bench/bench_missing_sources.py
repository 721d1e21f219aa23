#!/usr/bin/env python3
"""Time `check` on one backend whose manifest declares many sources that do
not exist: 40,000 and 200,000 of them.  Each is an S001; the time should
grow as the count does (about 5x from 40,000 to 200,000), not as its
square (25x), which it did while each source searched every finding.

Each figure is the best of --repeat runs of a fresh process
(`python3 check_contract.py --root TREE`), start-up included.
`--baseline OTHER/check_contract.py` times another version on the same
trees, in the same rounds.

Usage:
    python3 bench/bench_missing_sources.py [--sizes 40000,200000] [--repeat 3]
                                           [--baseline OTHER/check_contract.py]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CHECKER = os.path.join(HERE, "..", "check_contract.py")


def make_tree(root, count):
    """One cpu backend declaring ops.h, ops.c and `count` sources that are missing."""
    top = os.path.join(root, "backends", "cpu", "demo")
    os.makedirs(top)
    manifest = {"name": "demo", "platform": "cpu", "abi_version": 1, "status": "experimental",
                "sources": ["ops.h", "ops.c"] + ["k%d.c" % n for n in range(count)]}
    with open(os.path.join(top, "demo.backend.json"), "w") as handle:
        json.dump(manifest, handle)
    with open(os.path.join(top, "ops.h"), "w") as handle:
        handle.write("#define DEMO_ABI_VERSION 1\nunsigned demo_abi_version(void);\n"
                     "const char* demo_error_string(int code);\n")
    with open(os.path.join(top, "ops.c"), "w") as handle:
        handle.write('#include "ops.h"\n')


def timed(checker, root):
    start = time.monotonic()
    done = subprocess.run([sys.executable, checker, "--root", root], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, universal_newlines=True)
    elapsed = time.monotonic() - start
    if done.returncode != 1 or "error(s)" not in done.stdout:
        raise SystemExit("unexpected result from %s: %s" % (checker, done.stderr[-300:]))
    return elapsed


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="40000,200000", help="missing sources per tree")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each, the best kept")
    parser.add_argument("--baseline", help="another check_contract.py to time beside this one")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    checkers = [("checker", CHECKER)] + ([("baseline", args.baseline)] if args.baseline else [])
    best = {}
    with tempfile.TemporaryDirectory(prefix="bench-missing-") as top:
        for size in sizes:
            make_tree(os.path.join(top, str(size)), size)
        for _ in range(args.repeat):
            for size in sizes:
                for name, checker in checkers:
                    key = (name, size)
                    best[key] = min(best.get(key, float("inf")), timed(checker, os.path.join(top, str(size))))
    for name, _ in checkers:
        times = ["%d missing: %.2f s" % (size, best[(name, size)]) for size in sizes]
        print("%-8s %s; %dx the sources take %.1fx the time"
              % (name, ", ".join(times), sizes[-1] // sizes[0], best[(name, sizes[-1])] / best[(name, sizes[0])]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
