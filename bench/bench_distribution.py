#!/usr/bin/env python3
"""Benchmark of overlay_setup.py's distribution rule: what keeping an
installed distribution's files costs a native round trip.

A fake environment is generated under a temporary directory: a package
folder `site/bigpkg` of --files files, --mb MB in all, one of them the
artifact `_k.so`, and its `bigpkg-1.0.dist-info` whose RECORD lists them
all, as pip writes it; and a project with the source and a stand-in for
pip (`./pip install .`) that writes the artifact anew and renames it over
the old one, as pip does.  `add-native` + `revert` (two processes) is
timed three ways, interleaved in the same run:

  none   the same tree with the RECORD moved away: no distribution is
         found, so only the source and the artifact are kept (the tool
         without the distribution rule);
  link   the distribution rule as pip gets it: each file of the
         distribution kept by a hard link;
  copy   the rule for a build that may write in place (the stand-in run
         as `./installer`): each file copied.

Each figure is the median of --repeat round trips; after each, every file
of the tree must be back byte for byte.  Goal: link <= 3x none (its cost is per file, not per byte).

Usage:
  python3 bench/bench_distribution.py [--dir /tmp] [--repeat 3] [--files 3000] [--mb 600]

Exit codes: 0 goal met, 1 goal missed or a round trip not byte-exact (the
numbers are printed either way), 2 usage.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
TOOL = os.path.join(os.path.dirname(HERE), "overlay_setup.py")
LINK_GOAL = 3.0

FAKE_PIP = r'''#!/bin/sh
# writes the artifact anew beside it and renames it over the old one, as pip does
artifact="$SITE/bigpkg/_k.so"
cat "$artifact" k.c > "$artifact.new" && mv "$artifact.new" "$artifact"
'''


def make_tree(root: str, files: int, megabytes: int) -> str:
    """The environment and project under `root`; returns the artifact's path."""
    site = os.path.join(root, "site")
    package = os.path.join(site, "bigpkg")
    dist_info = os.path.join(site, "bigpkg-1.0.dist-info")
    for directory in (package, dist_info, os.path.join(root, "proj")):
        os.makedirs(directory)
    block = os.urandom(1 << 20)
    per_file = max(1, megabytes * (1 << 20) // files)
    record = []
    for number in range(files):
        name = "_k.so" if number == 0 else "mod%05d.bin" % number
        path = os.path.join(package, name)
        data = number.to_bytes(8, "little") + (block * (per_file // len(block) + 1))[8:per_file]
        with open(path, "wb") as handle:
            handle.write(data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append("bigpkg/%s,sha256=%s,%d" % (name, digest, len(data)))
    for name in ("METADATA", "INSTALLER", "WHEEL"):
        with open(os.path.join(dist_info, name), "w") as handle:
            handle.write("%s of bigpkg\n" % name)
        record.append("bigpkg-1.0.dist-info/%s,," % name)
    record.append("bigpkg-1.0.dist-info/RECORD,,")
    with open(os.path.join(dist_info, "RECORD"), "w") as handle:
        handle.write("\n".join(record) + "\n")
    proj = os.path.join(root, "proj")
    for name in ("pip", "installer"):
        with open(os.path.join(proj, name), "w") as handle:
            handle.write(FAKE_PIP)
        os.chmod(os.path.join(proj, name), 0o755)
    with open(os.path.join(proj, "k.c"), "w") as handle:
        handle.write("double k(void) { return 4.0; }\n")
    with open(os.path.join(root, "k_patched.c"), "w") as handle:
        handle.write("double k(void) { return 7.0; }\n")
    subprocess.run(["sync"], check=True)
    return os.path.join(package, "_k.so")


def fingerprint(root: str) -> Dict[str, str]:
    found = {}
    for directory, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(directory, name)
            with open(path, "rb") as handle:
                found[os.path.relpath(path, root)] = hashlib.sha256(handle.read()).hexdigest()
    return found


def round_trip(root: str, artifact: str, installer: str) -> float:
    state = ["--state", os.path.join(os.path.dirname(root), "state")]
    proj = os.path.join(root, "proj")
    add = [sys.executable, TOOL] + state + [
        "add-native", "--source", os.path.join(proj, "k.c"),
        "--patched", os.path.join(root, "k_patched.c"), "--artifact", artifact,
        "--build-cmd", "./%s install ." % installer, "--build-cwd", proj]
    environment = dict(os.environ, SITE=os.path.join(root, "site"))
    start = time.perf_counter()
    for command in (add, [sys.executable, TOOL] + state + ["revert"]):
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env=environment)
    return time.perf_counter() - start


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=None, help="where to generate (default: $TMPDIR)")
    parser.add_argument("--repeat", type=int, default=3, help="round trips per way (default 3)")
    parser.add_argument("--files", type=int, default=3000,
                        help="files in the distribution (default 3000)")
    parser.add_argument("--mb", type=int, default=600, help="its size in MB (default 600)")
    args = parser.parse_args(argv)
    if args.repeat < 1 or args.files < 1 or args.mb < 1:
        parser.error("--repeat, --files and --mb must be positive")
    base = tempfile.mkdtemp(prefix="bench-distribution-", dir=args.dir)
    try:
        root = os.path.join(base, "env")
        print("generating a distribution of %d files, %d MB ..." % (args.files, args.mb),
              flush=True)
        artifact = make_tree(root, args.files, args.mb)
        record = os.path.join(root, "site", "bigpkg-1.0.dist-info", "RECORD")
        before = fingerprint(root)
        times: Dict[str, List[float]] = {"none": [], "link": [], "copy": []}
        exact = True
        for _ in range(args.repeat):  # interleaved, so that all three see the same load
            for way, installer in (("none", "pip"), ("link", "pip"), ("copy", "installer")):
                if way == "none":
                    os.rename(record, record + ".away")
                times[way].append(round_trip(root, artifact, installer))
                if way == "none":
                    os.rename(record + ".away", record)
                if fingerprint(root) != before:
                    print("%s: the tree is not back byte for byte" % way)
                    exact = False
        median = {way: statistics.median(values) for way, values in times.items()}
        print()
        print("| way | add-native + revert (s) | / none |")
        print("|---|---:|---:|")
        for way in ("none", "link", "copy"):
            print("| %s | %.3f | %.2fx |" % (way, median[way], median[way] / median["none"]))
        ratio = median["link"] / median["none"]
        print()
        print("distribution rule: link / none = %.2fx (goal <= %.1fx): %s"
              % (ratio, LINK_GOAL, "met" if ratio <= LINK_GOAL else "MISSED"))
        return 0 if exact and ratio <= LINK_GOAL else 1
    finally:
        shutil.rmtree(base, True)


if __name__ == "__main__":
    sys.exit(main())
