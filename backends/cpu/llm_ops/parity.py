#!/usr/bin/env python3
"""Parity of the llm_ops CPU backend against the float64 reference.

Builds the backend with its build.sh into a temporary directory, loads the
library with ctypes, runs every op on a fixed set of shapes and magnitudes,
and prints per op the largest scaled error |out - ref| / max(1, |ref|) next
to the tolerance declared in llm_ops.backend.json.

Usage:
    python3 backends/cpu/llm_ops/parity.py [--march MARCH]

Exit codes:
    0  every op is within its tolerance
    1  an op exceeds its tolerance, returns an error code, or has no tolerance
    2  usage error, or the build failed

The backend's tests import this file for the ctypes bindings and the cases.
"""

import argparse
import ctypes
import os
import random
import sys
import tempfile

BACKEND_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(BACKEND_DIR)))
MANIFEST = os.path.join(BACKEND_DIR, "llm_ops.backend.json")
LIBRARY_NAME = "libllmops_cpu.so"

sys.path.insert(0, os.path.join(REPO_ROOT, "backends", "reference"))
import llm_ops_ref as ref  # noqa: E402
import backend_harness as harness  # noqa: E402
from backend_harness import BuildError  # noqa: E402

# (op, shape, magnitude): see llm_ops_ref.make_case. The tolerance of op is
# the manifest's "<op>_f32".
CASES = [
    ("rmsnorm", {"rows": 1, "cols": 1}, 1.0),
    ("rmsnorm", {"rows": 1, "cols": 7}, 1.0),
    ("rmsnorm", {"rows": 3, "cols": 33}, 1e3),
    ("rmsnorm", {"rows": 5, "cols": 127}, 1e-3),
    ("rmsnorm", {"rows": 2, "cols": 4096}, 1.0),
    ("silu_mul", {"rows": 1, "cols": 1}, 1.0),
    ("silu_mul", {"rows": 1, "cols": 3}, 1.0),
    ("silu_mul", {"rows": 7, "cols": 31}, 30.0),
    ("silu_mul", {"rows": 4, "cols": 1000}, 1e3),
    ("rope_neox", {"tokens": 1, "q_heads": 1, "k_heads": 1, "head_dim": 2,
                   "rotary_dim": 2, "max_position": 1}, 1.0),
    ("rope_neox", {"tokens": 3, "q_heads": 4, "k_heads": 2, "head_dim": 64,
                   "rotary_dim": 64, "max_position": 4096}, 1.0),
    ("rope_neox", {"tokens": 5, "q_heads": 3, "k_heads": 1, "head_dim": 80,
                   "rotary_dim": 20, "max_position": 100}, 1e3),
    ("rope_neox", {"tokens": 2, "q_heads": 2, "k_heads": 2, "head_dim": 6,
                   "rotary_dim": 6, "max_position": 9}, 1.0),
    ("softmax", {"rows": 1, "cols": 1}, 1.0),
    ("softmax", {"rows": 3, "cols": 33}, 1.0),
    ("softmax", {"rows": 2, "cols": 1000}, 1e2),
    ("softmax", {"rows": 4, "cols": 7, "offset": -1e4}, 1e4),
]

F32P = ctypes.POINTER(ctypes.c_float)
I64P = ctypes.POINTER(ctypes.c_int64)
SIGNATURES = {
    "llmops_abi_version": (ctypes.c_uint32, []),
    "llmops_error_string": (ctypes.c_char_p, [ctypes.c_int]),
    "llmops_rmsnorm_f32": (ctypes.c_int, [F32P, F32P, F32P, ctypes.c_int, ctypes.c_int,
                                          ctypes.c_float]),
    "llmops_silu_mul_f32": (ctypes.c_int, [F32P, F32P, ctypes.c_int, ctypes.c_int]),
    "llmops_rope_neox_f32": (ctypes.c_int, [F32P, F32P, I64P, F32P] + [ctypes.c_int] * 6),
    "llmops_softmax_f32": (ctypes.c_int, [F32P, F32P, ctypes.c_int, ctypes.c_int]),
}


def build(out_dir, march=None):
    """Run build.sh into out_dir; return the library path. Raises BuildError."""
    return harness.build(BACKEND_DIR, LIBRARY_NAME, out_dir, march)


def load_tolerances():
    return harness.load_tolerances(MANIFEST)


def floats(values):
    return (ctypes.c_float * len(values))(*values)


class Library:
    """ctypes bindings; each op takes flat lists and returns (rc, flat output)."""

    def __init__(self, path):
        self.dll = harness.load_library(path, SIGNATURES)

    def error_string(self, code):
        return self.dll.llmops_error_string(code).decode()

    def run(self, op, inputs):
        return getattr(self, op)(**inputs)

    def rmsnorm(self, x, weight, rows, cols, eps):
        out = floats([0.0] * (rows * cols))
        rc = self.dll.llmops_rmsnorm_f32(out, floats(x), floats(weight), rows, cols, eps)
        return rc, list(out)

    def silu_mul(self, gate_up, rows, cols):
        out = floats([0.0] * (rows * cols))
        rc = self.dll.llmops_silu_mul_f32(out, floats(gate_up), rows, cols)
        return rc, list(out)

    def rope_neox(self, q, k, positions, cos_sin_cache, tokens, q_heads, k_heads, head_dim,
                  rotary_dim, max_position):
        """In place on copies of q and k; the output is q followed by k."""
        q_io, k_io = floats(q), floats(k)
        rc = self.dll.llmops_rope_neox_f32(
            q_io, k_io, (ctypes.c_int64 * tokens)(*positions), floats(cos_sin_cache),
            tokens, q_heads, k_heads, head_dim, rotary_dim, max_position)
        return rc, list(q_io) + list(k_io)

    def softmax(self, x, rows, cols):
        out = floats([0.0] * (rows * cols))
        rc = self.dll.llmops_softmax_f32(out, floats(x), rows, cols)
        return rc, list(out)


def run_case(lib, op, shape, magnitude, rng):
    """Run one case; return (rc, max scaled error). The error is None when rc != 0."""
    inputs, expected = ref.make_case(op, shape, magnitude, rng)
    rc, out = lib.run(op, inputs)
    if rc != 0:
        return rc, None
    return rc, ref.max_scaled_error(out, expected)


def build_parser():
    parser = argparse.ArgumentParser(
        description="Run every llm_ops CPU op against the float64 reference.",
        epilog="example: python3 backends/cpu/llm_ops/parity.py --march native")
    parser.add_argument("--march", help="gcc -march value to build for (default: build.sh's)")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    tolerances = load_tolerances()
    with tempfile.TemporaryDirectory(prefix="llmops-cpu-parity-") as out_dir:
        try:
            lib = Library(build(out_dir, args.march))
        except BuildError as error:
            print("error: %s" % error, file=sys.stderr)
            return 2
        rng = random.Random(20261130)
        worst, failures = {}, []
        for op, shape, magnitude in CASES:
            rc, error = run_case(lib, op, shape, magnitude, rng)
            if rc != 0:
                failures.append("%s_f32 %s: returned %d (%s)"
                                % (op, shape, rc, lib.error_string(rc)))
                continue
            worst[op] = max(worst.get(op, 0.0), error)
    print("%-16s %-12s %-12s %s" % ("op", "max_error", "tolerance", "result"))
    for op in sorted(set(op for op, _, _ in CASES)):
        key = op + "_f32"
        tol = tolerances.get(key)
        if tol is None:
            failures.append("%s: no tolerance in %s" % (key, os.path.basename(MANIFEST)))
            continue
        if op not in worst:
            continue
        passed = worst[op] <= tol
        print("%-16s %-12.3e %-12.3e %s" % (key, worst[op], tol, "ok" if passed else "FAIL"))
        if not passed:
            failures.append("%s: max error %.3e exceeds tolerance %.3e" % (key, worst[op], tol))
    for failure in failures:
        print("FAIL: %s" % failure)
    print("%d op(s), %d failure(s)" % (len(worst), len(failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
