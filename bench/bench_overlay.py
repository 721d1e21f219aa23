#!/usr/bin/env python3
"""Benchmark of overlay_setup.py's native round trip against its floor.

An install is generated under a temporary directory: a small source file, a
200 MB artifact and a cache directory of 2,500 files and 250 MB; then the same
with a cache 4x larger (10,000 files, 1 GB).  Three ways to take a patch in
and out again are timed side by side, interleaved, in the same run:

  tool   `overlay_setup.py add-native` with a build that appends a byte to
         the artifact (a build that changes none fails), then `revert`, as
         two processes;
  floor  a minimal script run as two processes doing only the unavoidable
         work: copy the source and the artifact aside and fsync them, rename
         the cache directory aside; then move all three back;
  naive  the same, but the cache is saved as a tar snapshot and extracted
         back (what a tool that does not rename caches does).

Each figure is the median of --repeat round trips.  Goals: tool <= 1.5x floor
at every size, and tool(4x cache) <= 1.25x tool(1x cache).

With --products N it times instead the tool's round trip in a build directory
of N object files and of 10N (each backed up before the build, the tree
scanned before and after it), side by side; goal: time linear in the number
of products, at most 10x the time for 10x the products.

Usage:
  python3 bench/bench_overlay.py [--dir /tmp] [--repeat 3] [--artifact-mb 200]
                                 [--cache-files 2500] [--cache-mb 250]
                                 [--baseline OTHER/overlay_setup.py]
  python3 bench/bench_overlay.py --products 500 [--dir /tmp] [--repeat 3]

Exit codes: 0 goals met, 1 a goal missed (the numbers are printed either
way), 2 usage.
"""

from __future__ import annotations

import argparse
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
ROUND_TRIP_GOAL = 1.5
CACHE_SCALING_GOAL = 1.25
PRODUCTS_SCALE = 10  # the larger build directory has this many times the products

FLOOR_SCRIPT = r'''
import os, shutil, sys, tarfile
phase, install, aside, cache_mode = sys.argv[1:5]
names = ("src/kernel.cu", "lib/libkernels.so")
def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
if phase == "aside":
    os.mkdir(aside)
    for number, name in enumerate(names):
        target = os.path.join(aside, str(number))
        shutil.copy2(os.path.join(install, name), target)
        fd = os.open(target, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    if cache_mode == "rename":
        os.rename(os.path.join(install, "cache"), os.path.join(aside, "cache"))
        fsync_dir(install)
    else:
        with tarfile.open(os.path.join(aside, "cache.tar"), "w") as tar:
            tar.add(os.path.join(install, "cache"), "cache")
        fd = os.open(os.path.join(aside, "cache.tar"), os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        shutil.rmtree(os.path.join(install, "cache"))
    fsync_dir(aside)
else:
    for number, name in enumerate(names):
        os.replace(os.path.join(aside, str(number)), os.path.join(install, name))
    if cache_mode == "rename":
        os.rename(os.path.join(aside, "cache"), os.path.join(install, "cache"))
    else:
        with tarfile.open(os.path.join(aside, "cache.tar"), "r") as tar:
            tar.extractall(install)
    fsync_dir(install)
    shutil.rmtree(aside)
'''


def make_install(root: str, artifact_mb: int, cache_files: int, cache_mb: int) -> None:
    block = os.urandom(1 << 20)
    for directory in ("src", "lib", "cache", "build"):
        os.makedirs(os.path.join(root, directory))
    with open(os.path.join(root, "src/kernel.cu"), "w") as handle:
        handle.write("__global__ void k(float *x) { x[0] = 4.0f; }\n")
    with open(os.path.join(root, "lib/libkernels.so"), "wb") as handle:
        for number in range(artifact_mb):
            handle.write(number.to_bytes(8, "little") + block[8:])
    per_file = cache_mb * (1 << 20) // cache_files
    for number in range(cache_files):
        sub = os.path.join(root, "cache", "%02x" % (number % 256))
        os.makedirs(sub, exist_ok=True)
        with open(os.path.join(sub, "entry%05d.bin" % number), "wb") as handle:
            handle.write(number.to_bytes(8, "little") + block[8:per_file])
    with open(os.path.join(root, "kernel_patched.cu"), "w") as handle:
        handle.write("__global__ void k(float *x) { x[0] = 7.0f; }\n")
    subprocess.run(["sync"], check=True)


def timed(commands: List[List[str]]) -> float:
    start = time.perf_counter()
    for command in commands:
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def tool_round_trip(root: str, tool: str = TOOL) -> float:
    state = ["--state", os.path.join(os.path.dirname(root), "state-" + os.path.basename(
        os.path.dirname(tool)))]
    add = [sys.executable, tool] + state + [
        "add-native", "--source", os.path.join(root, "src/kernel.cu"),
        "--patched", os.path.join(root, "kernel_patched.cu"),
        "--artifact", os.path.join(root, "lib/libkernels.so"),
        "--invalidate-cache", os.path.join(root, "cache"),
        # a build must change the artifact (one that does not fails with E404): append a byte
        "--build-cmd", "printf x >> ../lib/libkernels.so", "--build-cwd", os.path.join(root, "build")]
    return timed([add, [sys.executable, tool] + state + ["revert"]])


def floor_round_trip(root: str, cache_mode: str) -> float:
    aside = os.path.join(os.path.dirname(root), "aside")
    return timed([[sys.executable, "-c", FLOOR_SCRIPT, phase, root, aside, cache_mode]
                  for phase in ("aside", "back")])


def fingerprint(root: str) -> List[tuple]:
    found = []
    for directory, _dirs, files in os.walk(root):
        for name in files:
            st = os.lstat(os.path.join(directory, name))
            found.append((os.path.relpath(os.path.join(directory, name), root), st.st_size,
                          st.st_mode))
    return sorted(found)


def make_build_dir(root: str, products: int) -> None:
    """A build directory of `products` object files (100 to a folder) and a source."""
    for number in range(products):
        folder = os.path.join(root, "obj", "%03d" % (number // 100))
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "k%06d.o" % number), "wb") as handle:
            handle.write(number.to_bytes(8, "little"))
    with open(os.path.join(root, "kernel.cu"), "w") as handle:
        handle.write("__global__ void k(float *x) { x[0] = 4.0f; }\n")
    with open(os.path.join(os.path.dirname(root), "kernel_patched.cu"), "w") as handle:
        handle.write("__global__ void k(float *x) { x[0] = 7.0f; }\n")
    subprocess.run(["sync"], check=True)


def products_round_trip(root: str) -> float:
    """add-native with a build that does nothing (every product is backed up
    and the directory scanned before and after it), then revert."""
    state = ["--state", os.path.join(os.path.dirname(root), "state")]
    add = [sys.executable, TOOL] + state + [
        "add-native", "--source", os.path.join(root, "kernel.cu"),
        "--patched", os.path.join(os.path.dirname(root), "kernel_patched.cu"),
        "--build-cmd", "true", "--build-cwd", root]
    return timed([add, [sys.executable, TOOL] + state + ["revert"]])


def measure_products(base: str, products: int, repeat: int) -> int:
    roots = {}
    for count in (products, products * PRODUCTS_SCALE):
        roots[count] = os.path.join(base, "p%d" % count, "build")
        print("generating a build directory of %d object files ..." % count, flush=True)
        make_build_dir(roots[count], count)
    times: Dict[int, List[float]] = {count: [] for count in roots}
    for _ in range(repeat):  # interleaved, so that both see the same load
        for count, root in roots.items():
            times[count].append(products_round_trip(root))
    median = {count: statistics.median(values) for count, values in times.items()}
    print()
    print("| products | tool (s) |")
    print("|---:|---:|")
    for count in sorted(median):
        print("| %d | %.3f |" % (count, median[count]))
    ratio = median[products * PRODUCTS_SCALE] / median[products]
    print()
    print("product scaling: tool(%dx products) / tool(1x) = %.2fx (goal <= %dx, linear): %s"
          % (PRODUCTS_SCALE, ratio, PRODUCTS_SCALE,
             "met" if ratio <= PRODUCTS_SCALE else "MISSED"))
    return 0 if ratio <= PRODUCTS_SCALE else 1


def measure(root: str, repeat: int, baseline: str = None) -> Dict[str, float]:
    """Median seconds per method, runs interleaved so page-cache state is shared."""
    reference = fingerprint(root)
    times: Dict[str, List[float]] = {"tool": [], "floor": [], "naive": []}
    if baseline:
        times["baseline"] = []
    for _ in range(repeat):
        times["floor"].append(floor_round_trip(root, "rename"))
        times["tool"].append(tool_round_trip(root))
        if baseline:
            times["baseline"].append(tool_round_trip(root, baseline))
        times["naive"].append(floor_round_trip(root, "tar"))
        if fingerprint(root) != reference:
            raise SystemExit("bench_overlay: the install differs after a round trip; the "
                             "numbers would be meaningless")
    return {name: statistics.median(values) for name, values in times.items()}


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=tempfile.gettempdir(),
                        help="where the generated installs go (default: the temp dir)")
    parser.add_argument("--repeat", type=int, default=3, help="round trips per method")
    parser.add_argument("--artifact-mb", type=int, default=200)
    parser.add_argument("--cache-files", type=int, default=2500)
    parser.add_argument("--cache-mb", type=int, default=250)
    parser.add_argument("--products", type=int,
                        help="time instead a build directory of this many object files "
                        "against one of %d times as many" % PRODUCTS_SCALE)
    parser.add_argument("--baseline", metavar="TOOL",
                        help="also time this other version of overlay_setup.py, interleaved")
    args = parser.parse_args(argv)
    if args.repeat < 1 or args.artifact_mb < 1 or args.cache_files < 1 or args.cache_mb < 1 \
            or (args.products is not None and args.products < 1):
        parser.error("--repeat, --artifact-mb, --cache-files, --cache-mb and --products must be "
                     "positive")
    base = tempfile.mkdtemp(prefix="bench-overlay-", dir=args.dir)
    if args.products is not None:
        try:
            return measure_products(base, args.products, args.repeat)
        finally:
            shutil.rmtree(base, ignore_errors=True)
    results = {}
    print("load average before: %s" % " ".join("%.2f" % x for x in os.getloadavg()))
    try:
        for scale in (1, 4):
            root = os.path.join(base, "x%d" % scale, "install")
            os.makedirs(os.path.dirname(root))
            print("generating %d MB artifact and %d-file, %d MB cache ..."
                  % (args.artifact_mb, args.cache_files * scale, args.cache_mb * scale),
                  flush=True)
            make_install(root, args.artifact_mb, args.cache_files * scale, args.cache_mb * scale)
            results[scale] = measure(root, args.repeat, args.baseline)
            shutil.rmtree(os.path.dirname(root))
    finally:
        shutil.rmtree(base, ignore_errors=True)

    print()
    print("| cache | floor (s) | tool (s) | naive tar (s) | tool / floor | naive / floor |")
    print("|---|---|---|---|---|---|")
    for scale, row in sorted(results.items()):
        print("| %d files, %d MB | %.3f | %.3f | %.3f | %.2fx | %.2fx |" % (
            args.cache_files * scale, args.cache_mb * scale, row["floor"], row["tool"],
            row["naive"], row["tool"] / row["floor"], row["naive"] / row["floor"]))
    if args.baseline:
        for scale, row in sorted(results.items()):
            print("| %d files, %d MB | %.3f | %.3f (--baseline) | | %.2fx | |" % (
                args.cache_files * scale, args.cache_mb * scale, row["floor"], row["baseline"],
                row["baseline"] / row["floor"]))
        print("--baseline cache scaling: %.2fx" % (results[4]["baseline"] / results[1]["baseline"]))
    print("load average after: %s" % " ".join("%.2f" % x for x in os.getloadavg()))
    scaling = results[4]["tool"] / results[1]["tool"]
    worst = max(row["tool"] / row["floor"] for row in results.values())
    print()
    print("round trip: tool / floor = %.2fx at worst (goal <= %.2fx): %s"
          % (worst, ROUND_TRIP_GOAL, "met" if worst <= ROUND_TRIP_GOAL else "MISSED"))
    print("cache scaling: tool(4x) / tool(1x) = %.2fx (goal <= %.2fx): %s"
          % (scaling, CACHE_SCALING_GOAL, "met" if scaling <= CACHE_SCALING_GOAL else "MISSED"))
    return 0 if worst <= ROUND_TRIP_GOAL and scaling <= CACHE_SCALING_GOAL else 1


if __name__ == "__main__":
    sys.exit(main())
