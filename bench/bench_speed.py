#!/usr/bin/env python3
"""Both tools against their floors, in one run, as ratios.

  check      `check_contract.py --root TREE` against the minimal reader of
             bench_check_contract.py (parse every manifest, read every
             declared file) over generated trees of 30, 1,000 and 4,000
             backends (one in four a fat-library cuda backend, the others the
             test corpus's build scripts in turn, each under its own name);
  add-native `overlay_setup.py add-native --no-build` of one source and one
             artifact against its floor: a script that copies the same two
             files aside and fsyncs them, writes the patched source beside
             the original, fsyncs it and renames it over the original.

Every command is a fresh process (interpreter start-up included on both
sides). Each tool is timed twice: run as a script (`python3 check_contract.py`,
compiled on every run) and as a module (`python3 -m check_contract`, its
bytecode cached by Python under __pycache__ beside it after the first run).
The commands are interleaved, round after round, so each pair runs
under the same load; a figure is the median over the rounds, and a ratio is
the median of the ratios of the same round. The tool's `revert` and the
floor's way back run between the rounds, untimed. --baseline-dir DIR also
times the two tools of another checkout (an older commit) in the same
rounds. Goals: check <= 2x the reader at every size, add-native <= 1.5x its
floor.

Usage:
    python3 bench/bench_speed.py [--sizes 30,1000,4000] [--repeat 7]
                                 [--artifact-mb 16] [--baseline-dir DIR]
Exit codes: 0 measured (whatever the ratios), 1 a tool failed, 2 usage.
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_check_contract  # noqa: E402  (the generated trees and the reader)

FLOOR_SCRIPT = r'''
import os, shutil, sys
phase, install, aside, patched = sys.argv[1:5]
names = ("src/kernel.cu", "lib/libkernels.so")
def fsync_path(path):
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
if phase == "apply":
    os.mkdir(aside)
    for number, name in enumerate(names):
        shutil.copy2(os.path.join(install, name), os.path.join(aside, str(number)))
        fsync_path(os.path.join(aside, str(number)))
    fsync_path(aside)
    source = os.path.join(install, names[0])
    shutil.copyfile(patched, source + ".new")
    fsync_path(source + ".new")
    os.replace(source + ".new", source)
    fsync_path(os.path.dirname(source))
else:
    for number, name in enumerate(names):
        os.replace(os.path.join(aside, str(number)), os.path.join(install, name))
    os.rmdir(aside)
'''


def tool_command(directory, tool, as_module):
    """The argv and environment that run `tool` of `directory` as a script,
    or as a module with Python's bytecode cache allowed."""
    if not as_module:
        return [sys.executable, os.path.join(directory, tool + ".py")], dict(os.environ)
    env = dict(os.environ, PYTHONPATH=directory)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return [sys.executable, "-m", tool], env


def run(command, env=None):
    start = time.perf_counter()
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    if done.returncode:
        raise RuntimeError("%s failed (exit %d): %s" % (
            " ".join(command[:3]), done.returncode, done.stderr.decode(errors="replace")[-500:]))
    return time.perf_counter() - start


def rounds(commands, repeat, between=None):
    """Median seconds per command and the median per-round ratio of each
    command to the first (the floor), over `repeat` interleaved rounds."""
    times = {name: [] for name in commands}
    for number in range(repeat + 1):  # the first round warms the page cache
        for name, command in commands.items():
            elapsed = command()
            if number:
                times[name].append(elapsed)
            if between:
                between(name)
    floor = next(iter(commands))
    return {name: (statistics.median(values),
                   statistics.median(v / f for v, f in zip(values, times[floor])))
            for name, values in times.items()}


def check_rows(base, sizes, repeat, versions):
    shapes = bench_check_contract.corpus_shapes()
    for size in sizes:
        root = os.path.join(base, "tree-%d" % size)
        bench_check_contract.generate(root, size, shapes)
        commands = {"reader": lambda: run([sys.executable, "-c",
                                           bench_check_contract.MINIMAL_READER, root])}
        for label, directory, as_module in versions:
            argv, env = tool_command(directory, "check_contract", as_module)
            commands[label] = (lambda argv, env: lambda: run(argv + ["--root", root], env))(argv, env)
        yield size, rounds(commands, repeat)
        shutil.rmtree(root)


def overlay_rows(base, artifact_mb, repeat, versions):
    install = os.path.join(base, "install")
    for directory in ("src", "lib"):
        os.makedirs(os.path.join(install, directory))
    with open(os.path.join(install, "src/kernel.cu"), "w") as handle:
        handle.write("__global__ void k(float *x) { x[0] = 4.0f; }\n")
    with open(os.path.join(install, "lib/libkernels.so"), "wb") as handle:
        handle.write(os.urandom(artifact_mb << 20))
    patched = os.path.join(base, "kernel_patched.cu")
    with open(patched, "w") as handle:
        handle.write("__global__ void k(float *x) { x[0] = 7.0f; }\n")
    aside = os.path.join(base, "aside")

    def floor(phase):
        return run([sys.executable, "-c", FLOOR_SCRIPT, phase, install, aside, patched])

    def tool(version, *args):
        argv, env = tool_command(*version)
        env["XDG_STATE_HOME"] = os.path.join(base, "xdg-state")
        return run(argv + ["--state", os.path.join(base, "state")] + list(args), env)

    commands = {"floor": lambda: floor("apply")}
    labels = {}
    for label, directory, as_module in versions:
        labels[label] = (directory, "overlay_setup", as_module)
        commands[label] = (lambda version: lambda: tool(
            version, "add-native", "--source", os.path.join(install, "src/kernel.cu"),
            "--patched", patched, "--artifact", os.path.join(install, "lib/libkernels.so"),
            "--no-build"))(labels[label])

    def undo(name):
        if name == "floor":
            floor("back")
        else:
            tool(labels[name], "revert")
    return rounds(commands, repeat, undo)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="30,1000,4000")
    parser.add_argument("--repeat", type=int, default=7, help="timed rounds (default: 7)")
    parser.add_argument("--artifact-mb", type=int, default=16)
    parser.add_argument("--baseline-dir", metavar="DIR",
                        help="also time DIR/check_contract.py and DIR/overlay_setup.py")
    args = parser.parse_args(argv)
    try:
        sizes = [int(size) for size in args.sizes.split(",")]
    except ValueError:
        parser.error("--sizes must be comma-separated integers, e.g. 30,1000")
    if args.repeat < 1 or args.artifact_mb < 1 or min(sizes) < 1:
        parser.error("--repeat, --artifact-mb and --sizes must be positive")
    versions = [("this", os.path.dirname(HERE), False), ("this -m", os.path.dirname(HERE), True)]
    if args.baseline_dir:
        versions += [("baseline", os.path.abspath(args.baseline_dir), False),
                     ("baseline -m", os.path.abspath(args.baseline_dir), True)]
    base = tempfile.mkdtemp(prefix="bench-speed-")
    print("python %s, median of %d interleaved rounds; load average before: %s" % (
        sys.version.split()[0], args.repeat, " ".join("%.2f" % x for x in os.getloadavg())))
    try:
        print("%9s %9s %s" % ("backends", "reader", "  ".join(
            "%11s %7s" % (label, "ratio") for label, _, _ in versions)))
        for size, result in check_rows(base, sizes, args.repeat, versions):
            print("%9d %9.3f %s" % (size, result["reader"][0], "  ".join(
                "%11.3f %6.2fx" % result[label] for label, _, _ in versions)), flush=True)
        result = overlay_rows(base, args.artifact_mb, args.repeat, versions)
        print("add-native --no-build, one source and a %d MB artifact: floor %.3f s, %s" % (
            args.artifact_mb, result["floor"][0], ", ".join(
                "%s %.3f s %.2fx" % ((label,) + result[label]) for label, _, _ in versions)))
    except RuntimeError as exc:
        print("error: %s" % exc, file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print("load average after: %s" % " ".join("%.2f" % x for x in os.getloadavg()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
