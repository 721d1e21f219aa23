#!/usr/bin/env python3
"""Time check_contract.py against two baselines over the same generated tree.

For each size (default 30, 1000 and 4000 backends) the script generates a
git repository of backends that pass the check (one in four a fat-library
cuda backend, the rest the test corpus's build scripts, each under its own
name, so no two scripts are alike), then times, interleaved and in the same
run:

  checker  python3 check_contract.py --root TREE
  grep     grep -r ABI_VERSION TREE/backends
  reader   python3 -c MINIMAL_READER TREE   (reads every manifest and every
           declared file, and nothing else: the floor for a Python tool
           that has to read them)

Every command is a fresh process, so interpreter start-up is included for
both Python commands. The best (minimum) of --repeat interleaved runs is
reported, since other load on the machine only ever adds time; the ratios
are of those minima. The goals: checker/reader <= 2 at 30, 1,000 and 4,000
backends, and time linear in the number of backends (the last line compares
the growth of the checker's time between the smallest and the largest size
with the reader's). Where the machine's speed drifts from run to run, the
minima of two columns may come from different moments: "round median" is
the median, over the rounds, of the checker's time over the reader's in the
same round.

A second table splits the median times: the interpreter's start-up
(python3 -c pass), compiling check_contract.py (which running a script does
on every run, since a script's bytecode is never cached), and what is left
of each Python command: the reader's work after start-up and the checker's
after start-up and compiling.

Last, the build-script reader alone, in this process: a generated script
of about 46 KB and one of about 262 KB (variables set, each beside an `if`
the reader cannot decide, then the compiler line), best of --repeat reads
each; its time should grow as the text does, so the line gives the size
ratio beside the time ratio.

Usage:
    python3 bench/bench_check_contract.py [--sizes 30,1000,4000] [--repeat 11]
                                          [--keep DIR] [--baseline CHECKER]
Exit codes: 0 measured (whatever the ratios), 1 the checker failed on a
generated tree, 2 usage error.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CHECKER = os.path.join(os.path.dirname(HERE), "check_contract.py")

MINIMAL_READER = r"""
import json, os, sys
root = os.path.join(sys.argv[1], "backends")
total = 0
for platform in os.scandir(root):
    if not platform.is_dir():
        continue
    for backend in os.scandir(platform.path):
        with open(os.path.join(backend.path, backend.name + ".backend.json"), "rb") as f:
            manifest = json.loads(f.read())
        for source in manifest["sources"] + [manifest["build"]["script"]]:
            with open(os.path.join(backend.path, source), "rb") as f:
                total += len(f.read())
print(total)
"""

KERNEL = """// %(op)s for %(name)s
#include "ops.h"

__global__ void %(op)s_kernel(float* out, const float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        /* scale and shift */
        out[i] = x[i] * 0.5f + 1.0f;
    }
}

extern "C" int %(prefix)s_%(op)s(float* out, const float* x, int n, cudaStream_t stream) {
    if (out == nullptr || x == nullptr) return 1000;
    if (n <= 0) return 1001;
    %(op)s_kernel<<<(n + 255) / 256, 256, 0, stream>>>(out, x, n);
    return 0;
}
""" * 3

HEADER = """#ifndef %(PREFIX)s_OPS_H
#define %(PREFIX)s_OPS_H
#include <stdint.h>
#include <cuda_runtime.h>

/* Bumped whenever a signature changes. */
#define %(PREFIX)s_ABI_VERSION 3

#ifdef __cplusplus
extern "C" {
#endif
uint32_t    %(prefix)s_abi_version(void);
const char* %(prefix)s_error_string(int code);
int %(prefix)s_rmsnorm(float* out, const float* x, int n, cudaStream_t stream);
int %(prefix)s_softmax(float* out, const float* x, int n, cudaStream_t stream);
int %(prefix)s_rotary(float* out, const float* x, int n, cudaStream_t stream);
#ifdef __cplusplus
}
#endif
#endif
"""

BUILD = """#!/usr/bin/env bash
# Build lib%(prefix)s.so: ./build.sh <output-dir> [<compute-capability>]
set -euo pipefail
out_dir="$1"
here="$(cd "$(dirname "$0")" && pwd)"
mkdir -p "$out_dir"
if [ $# -ge 2 ]; then
  targets=(-gencode "arch=compute_$2,code=sm_$2")
else
  targets=(-gencode arch=compute_80,code=sm_80
           -gencode arch=compute_89,code=sm_89
           -gencode "arch=compute_90,code=[sm_90,compute_90]")
fi
"${NVCC:-nvcc}" -O3 -shared -Xcompiler -fPIC "${targets[@]}" \\
    "$here"/*.cu -o "$out_dir/lib%(prefix)s.so"
"""

COMPILE_CHECKER = "import sys; compile(open(sys.argv[1], 'rb').read(), sys.argv[1], 'exec')"

OPS = ("rmsnorm", "softmax", "rotary", "silu_mul")


def corpus_shapes():
    """The build scripts of the test corpus that the checker passes clean, as
    (platform, name, files): the shapes real repositories' scripts take."""
    sys.path.insert(0, os.path.dirname(CHECKER))
    import test_check_contract as corpus
    shapes = []
    for name, platform, script, extra, construct, truth in corpus.BUILD_SCRIPT_CORPUS:
        if construct is None:
            shapes.append((platform, name, corpus.corpus_backend(name, platform, script, extra, truth)))
    with tempfile.TemporaryDirectory(prefix="bench-shapes-") as root:
        for _, _, files in shapes:
            write_files(root, files, "", "")
        done = subprocess.run([sys.executable, CHECKER, "--root", root, "--format", "json"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    flagged = {issue["backend"] for issue in json.loads(done.stdout)["issues"]}
    return [shape for shape in shapes if "%s/%s" % shape[:2] not in flagged]


def write_files(root, files, name, new_name):
    """Write a corpus backend's files under root, every mention of its name
    renamed, so that no two backends' files are alike."""
    for path, content in files.items():
        if isinstance(content, dict):
            content = json.dumps(content, indent=2)
        if name:
            path, content = path.replace(name, new_name), content.replace(name, new_name)
        full = os.path.join(root, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w") as handle:
            handle.write(content)
        if path.endswith(".sh"):
            os.chmod(full, 0o755)


def generate(root, count, shapes):
    """A git repository of `count` valid backends: one in four is the
    fat-library cuda backend below (a header with the ABI macro, four .cu
    files), the others the test corpus's build scripts in turn, each backend
    under its own name, so that every script differs from every other."""
    for index in range(count):
        if index % 4:
            platform, shape, files = shapes[index % len(shapes)]
            write_files(root, files, shape, "%s_%05d" % (shape, index))
            continue
        name = "k%05d" % index
        prefix = name
        directory = os.path.join(root, "backends", "cuda", name)
        os.makedirs(directory)
        values = {"name": name, "prefix": prefix, "PREFIX": prefix.upper()}
        files = {"ops.h": HEADER % values, "build.sh": BUILD % values}
        for op in OPS:
            files[op + ".cu"] = KERNEL % dict(values, op=op)
        for file_name, content in files.items():
            with open(os.path.join(directory, file_name), "w") as handle:
                handle.write(content)
        os.chmod(os.path.join(directory, "build.sh"), 0o755)
        manifest = {"$schema": "../../backend.schema.json", "name": name, "platform": "cuda",
                    "abi_version": 3, "status": "experimental",
                    "sources": ["ops.h"] + [op + ".cu" for op in OPS],
                    "build": {"script": "build.sh", "output": "lib%s.so" % prefix,
                              "architectures": [80, 89, 90], "default_arch": 90,
                              "min_capability": 80},
                    "numerics": {"precision": "fp32", "accumulation": "fp32",
                                 "tolerance": {op: 1e-5 for op in OPS}}}
        with open(os.path.join(directory, name + ".backend.json"), "w") as handle:
            json.dump(manifest, handle, indent=2)
    for args in (["init", "-q"], ["add", "-A"],
                 ["-c", "user.name=bench", "-c", "user.email=bench@example.invalid",
                  "commit", "-q", "-m", "generated backends"]):
        subprocess.run(["git", "-C", root] + args, check=True, stdout=subprocess.DEVNULL)


def timed(command):
    start = time.perf_counter()
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    elapsed = time.perf_counter() - start
    return elapsed, done.returncode, done.stderr


def measure(root, repeat, baseline):
    commands = {
        "checker": [sys.executable, CHECKER, "--root", root],
        "grep": ["grep", "-r", "ABI_VERSION", os.path.join(root, "backends")],
        "reader": [sys.executable, "-c", MINIMAL_READER, root],
        # Fixed costs, for the breakdown: the interpreter alone, and the
        # interpreter compiling the checker's source (what running a script
        # does on every run: its bytecode is never cached).
        "start-up": [sys.executable, "-c", "pass"],
        "compile": [sys.executable, "-c", COMPILE_CHECKER, CHECKER],
    }
    if baseline:
        # Another version of the checker: its findings on these trees may
        # differ, so its exit status is not checked.
        commands["baseline"] = [sys.executable, baseline, "--root", root]
    for name, command in commands.items():  # warm the page cache
        elapsed, rc, err = timed(command)
        if name not in ("grep", "baseline") and rc != 0:
            raise RuntimeError("%s failed (exit %d): %s" % (name, rc, err.decode(errors="replace")))
    times = {name: [] for name in commands}
    for _ in range(repeat):
        for name, command in commands.items():
            times[name].append(timed(command)[0])
    result = {name: min(values) for name, values in times.items()}
    result["median"] = {name: statistics.median(values) for name, values in times.items()}
    # The checker and the reader of the same round ran under the same load.
    result["paired"] = statistics.median(
        checker / reader for checker, reader in zip(times["checker"], times["reader"]))
    if baseline:
        result["baseline paired"] = statistics.median(
            other / reader for other, reader in zip(times["baseline"], times["reader"]))
    return result


def breakdown(size, result):
    """One row of the breakdown, from the median times: what the interpreter
    costs, what compiling the checker costs, and what each of the two Python
    commands does after that."""
    median = result["median"]
    start_up = median["start-up"]
    compiling = median["compile"] - start_up
    reader = median["reader"] - start_up
    checker = median["checker"] - median["compile"]
    return "%9d %10.1f %10.1f %12.1f %13.1f %12.2fx" % (
        size, start_up * 1e3, compiling * 1e3, reader * 1e3, checker * 1e3, checker / reader)


SCRIPT_BLOCK = ("v%(i)d=value%(i)d\n"
                "if [ -d /opt/cuda-%(i)d ]; then w%(i)d=a; else w%(i)d=b; fi\n")
SCRIPT_END = 'mkdir -p "$1"\nnvcc -shared -arch=sm_80 -o "$1/libbig.so" k.cu\n'


def script_scaling(repeat):
    """The reader's best time on a small and a large generated script."""
    sys.path.insert(0, os.path.dirname(CHECKER))
    import check_contract
    times = []
    for kilobytes in (46, 262):
        text = "#!/usr/bin/env bash\n"
        blocks = []
        while len(text) + sum(map(len, blocks)) < kilobytes * 1000:
            blocks.append(SCRIPT_BLOCK % {"i": len(blocks)})
        text += "".join(blocks) + SCRIPT_END
        best = None
        for _ in range(repeat):
            start = time.perf_counter()
            reader = check_contract.ScriptReader(text)
            elapsed = time.perf_counter() - start
            best = elapsed if best is None else min(best, elapsed)
        if reader.unfollowed or len(reader.calls) != 1:
            raise RuntimeError("the reader did not follow the generated script: %s"
                               % reader.unfollowed[:1])
        times.append((len(text), best))
    (small, small_time), (large, large_time) = times
    print("script reader: %d bytes in %.3f s, %d bytes in %.3f s: %.1fx the text, %.1fx the time"
          % (small, small_time, large, large_time, large / small, large_time / small_time))


def trace_times(root, repeat, baseline):
    """`trace` over every backend of root, interleaved with the baseline's:
    the best of each, in seconds (None for a version not timed)."""
    versions = [CHECKER] + ([baseline] if baseline else [])
    times = {version: [] for version in versions}
    for _ in range(repeat):
        for version in versions:
            # trace exits 1 on the findings of the generated scripts: not checked.
            times[version].append(timed([sys.executable, version, "--root", root, "trace"])[0])
    return min(times[CHECKER]), min(times[baseline]) if baseline else None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="30,1000,4000",
                        help="comma-separated backend counts (default: 30,1000,4000)")
    parser.add_argument("--repeat", type=int, default=11,
                        help="timed runs per command (default: 11)")
    parser.add_argument("--keep", metavar="DIR", help="generate the trees in DIR and keep them")
    parser.add_argument("--baseline", metavar="CHECKER",
                        help="also time this other version of check_contract.py, interleaved")
    parser.add_argument("--trace", action="store_true",
                        help="also time `trace` (every build script run twice, under the shims) "
                             "over the smallest tree")
    args = parser.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        parser.error("--sizes must be comma-separated integers, e.g. 100,1000")
    if args.repeat < 1 or any(s < 1 for s in sizes):
        parser.error("--repeat and --sizes must be positive")
    base = args.keep or tempfile.mkdtemp(prefix="bench-check-contract-")
    rows = []
    shapes = corpus_shapes()
    try:
        print("python %s, best of %d interleaved runs, seconds" % (sys.version.split()[0], args.repeat))
        print("load average before: %s" % " ".join("%.2f" % x for x in os.getloadavg()))
        print("%9s %9s %9s %9s %15s %13s %14s" % (
            "backends", "checker", "reader", "grep", "checker/reader", "checker/grep", "round median"))
        for size in sizes:
            root = os.path.join(base, "tree-%d" % size)
            if os.path.exists(root):
                shutil.rmtree(root)
            generate(root, size, shapes)
            try:
                result = measure(root, args.repeat, args.baseline)
            except RuntimeError as exc:
                print("error: %s" % exc, file=sys.stderr)
                return 1
            rows.append((size, result))
            print("%9d %9.3f %9.3f %9.3f %14.2fx %12.2fx %13.2fx" % (
                size, result["checker"], result["reader"], result["grep"],
                result["checker"] / result["reader"], result["checker"] / result["grep"],
                result["paired"]), flush=True)
            if args.baseline:
                print("%9s %9.3f %9s %9s %14.2fx %12s %13.2fx  (--baseline)" % (
                    "", result["baseline"], "", "", result["baseline"] / result["reader"], "",
                    result["baseline paired"]), flush=True)
        if args.trace:
            size = min(sizes)
            this, other = trace_times(os.path.join(base, "tree-%d" % size), args.repeat,
                                      args.baseline)
            print("trace over %d backends, best of %d: %.2f s%s" % (
                size, args.repeat, this,
                "" if other is None else "; --baseline %.2f s, %.2fx as long" % (other, other / this)))
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    print("worst checker/reader ratio: %.2fx of the best times, %.2fx round median "
          "(goal <= 2.00x)" % (max(r["checker"] / r["reader"] for _, r in rows),
                               max(r["paired"] for _, r in rows)))
    if len(rows) > 1:
        (small, first), (large, last) = rows[0], rows[-1]
        print("from %d to %d backends (%.1fx as many): the checker took %.2fx as long, the reader "
              "%.2fx" % (small, large, large / small, last["checker"] / first["checker"],
                         last["reader"] / first["reader"]))
    print()
    print("where the time goes, ms (medians of the rounds):")
    print("%9s %10s %10s %12s %13s %13s" % (
        "backends", "start-up", "compile", "reader work", "checker work", "work ratio"))
    for size, result in rows:
        print(breakdown(size, result))
    print()
    try:
        script_scaling(args.repeat)
    except RuntimeError as exc:
        print("error: %s" % exc, file=sys.stderr)
        return 1
    print("load average after: %s" % " ".join("%.2f" % x for x in os.getloadavg()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
