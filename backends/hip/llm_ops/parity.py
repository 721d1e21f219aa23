#!/usr/bin/env python3
"""GPU parity of the llm_ops HIP backend against the float64 reference.

Builds the backend with its build.sh into a temporary directory, runs every
op in fp32 and bf16 on AMD GPU 0 through the HIP runtime (ctypes on
libamdhip64: hipMalloc, hipMemcpy; kernels on the null stream, then a device
synchronisation), and prints per op the largest scaled error
|out - ref| / max(1, |ref|) next to the tolerance declared in
llm_ops.backend.json.

Without a usable AMD GPU (no HIP runtime, or hipGetDeviceCount finds no
device) it prints one line starting "SKIP:" with the reason and exits 0.

Usage:
    python3 backends/hip/llm_ops/parity.py [--arch GFX]

Exit codes:
    0  every op is within its tolerance, or skipped (no GPU)
    1  an op exceeds its tolerance, returns an error code, or has no tolerance;
       or a HIP runtime call failed
    2  usage error, or the build failed

The backend's tests import this file for the bindings and the cases.
"""

import argparse
import ctypes
import os
import random
import struct
import sys
import tempfile

BACKEND_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(BACKEND_DIR)))
MANIFEST = os.path.join(BACKEND_DIR, "llm_ops.backend.json")
LIBRARY_NAME = "libllmops_hip.so"
# The HIP runtime under the names ROCm and Debian install it by.
RUNTIME_NAMES = ("libamdhip64.so", "libamdhip64.so.6", "libamdhip64.so.5")

sys.path.insert(0, os.path.join(REPO_ROOT, "backends", "reference"))
import llm_ops_ref as ref  # noqa: E402
import backend_harness as harness  # noqa: E402
from backend_harness import BuildError  # noqa: E402

DTYPES = ("f32", "bf16")
ROUNDING = {"f32": ref.to_f32, "bf16": ref.round_bf16}
ELEMENT_SIZE = {"f32": 4, "bf16": 2}

# (op, shape, magnitude): see llm_ops_ref.make_case; each runs in every dtype,
# and its tolerance is the manifest's "<op>_<dtype>". Rows longer than a block
# (256 threads) and more rope pairs than threads exercise the strided loops;
# rows of 65 and 33 leave wavefronts of 64 and of 32 partly idle.
CASES = [
    ("rmsnorm", {"rows": 1, "cols": 1}, 1.0),
    ("rmsnorm", {"rows": 3, "cols": 65}, 1e3),
    ("rmsnorm", {"rows": 5, "cols": 127}, 1e-3),
    ("rmsnorm", {"rows": 2, "cols": 4099, "offset": -20.0}, 10.0),
    ("rmsnorm", {"rows": 300, "cols": 7}, 1.0),
    ("silu_mul", {"rows": 1, "cols": 1}, 1.0),
    ("silu_mul", {"rows": 7, "cols": 31}, 30.0),
    ("silu_mul", {"rows": 64, "cols": 1000}, 1e3),
    ("silu_mul", {"rows": 3, "cols": 257, "offset": -50.0}, 45.0),
    ("rope_neox", {"tokens": 1, "q_heads": 1, "k_heads": 1, "head_dim": 2,
                   "rotary_dim": 2, "max_position": 1}, 1.0),
    ("rope_neox", {"tokens": 3, "q_heads": 32, "k_heads": 8, "head_dim": 128,
                   "rotary_dim": 128, "max_position": 4096}, 1.0),
    ("rope_neox", {"tokens": 5, "q_heads": 3, "k_heads": 1, "head_dim": 80,
                   "rotary_dim": 20, "max_position": 100}, 1e3),
    ("softmax", {"rows": 1, "cols": 1}, 1.0),
    ("softmax", {"rows": 3, "cols": 33}, 1.0),
    ("softmax", {"rows": 2, "cols": 4099}, 1e2),
    ("softmax", {"rows": 4, "cols": 7, "offset": -1e4}, 1e4),
]

P, INT, FLOAT = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
SIGNATURES = {"llmops_abi_version": (ctypes.c_uint32, []),
              "llmops_error_string": (ctypes.c_char_p, [INT])}
for _dtype in DTYPES:
    SIGNATURES.update({
        "llmops_rmsnorm_" + _dtype: (INT, [P, P, P, INT, INT, FLOAT, P]),
        "llmops_silu_mul_" + _dtype: (INT, [P, P, INT, INT, P]),
        "llmops_rope_neox_" + _dtype: (INT, [P, P, P, P] + [INT] * 6 + [P]),
        "llmops_softmax_" + _dtype: (INT, [P, P, INT, INT, P]),
    })

HIP_MEMCPY_HOST_TO_DEVICE, HIP_MEMCPY_DEVICE_TO_HOST = 1, 2


class HipError(Exception):
    """A HIP runtime call failed."""


def build(out_dir, arch=None):
    """Run build.sh into out_dir; return the library path. Raises BuildError."""
    return harness.build(BACKEND_DIR, LIBRARY_NAME, out_dir, arch)


def load_tolerances():
    return harness.load_tolerances(MANIFEST)


def load_runtime():
    """(libamdhip64, None), or (None, why it cannot be loaded)."""
    errors = []
    for name in RUNTIME_NAMES:
        try:
            hip = ctypes.CDLL(name)
        except OSError as error:
            errors.append(str(error))
            continue
        hip.hipGetErrorName.restype = ctypes.c_char_p
        return hip, None
    return None, "no HIP runtime: %s" % "; ".join(errors)


def open_runtime():
    """Return (libamdhip64, None) when an AMD GPU is usable, else (None, reason)."""
    hip, reason = load_runtime()
    if hip is None:
        return None, reason
    count = ctypes.c_int()
    rc = hip.hipGetDeviceCount(ctypes.byref(count))
    if rc != 0:
        return None, "no AMD GPU: hipGetDeviceCount returned %s" % hip.hipGetErrorName(rc).decode()
    if count.value == 0:
        return None, "no AMD GPU: hipGetDeviceCount found no device"
    return hip, None


class Device:
    """AMD GPU 0, made current: the device the library's launches go to."""

    def __init__(self, hip):
        self.hip = hip
        size = ctypes.c_size_t
        for name, argtypes in (("hipMalloc", [ctypes.POINTER(P), size]),
                               ("hipFree", [P]),
                               ("hipMemcpy", [P, P, size, INT]),
                               ("hipStreamCreate", [ctypes.POINTER(P)]),
                               ("hipStreamSynchronize", [P]),
                               ("hipStreamDestroy", [P]),
                               ("hipDeviceGetName", [ctypes.c_char_p, INT, INT])):
            getattr(hip, name).argtypes = argtypes
        self.check("hipSetDevice", 0)

    def check(self, name, *args):
        rc = getattr(self.hip, name)(*args)
        if rc != 0:
            raise HipError("%s failed with %s" % (name, self.hip.hipGetErrorName(rc).decode()))

    def describe(self):
        name = ctypes.create_string_buffer(256)
        self.check("hipDeviceGetName", name, len(name), 0)
        version = ctypes.c_int()
        self.check("hipRuntimeGetVersion", ctypes.byref(version))
        return "%s, HIP runtime %d" % (name.value.decode(errors="replace"), version.value)

    def alloc(self, nbytes):
        pointer = P()
        self.check("hipMalloc", ctypes.byref(pointer), nbytes)
        return pointer.value

    def upload(self, data):
        pointer = self.alloc(len(data))
        try:
            self.check("hipMemcpy", pointer, data, len(data), HIP_MEMCPY_HOST_TO_DEVICE)
        except HipError:
            self.free(pointer)
            raise
        return pointer

    def download(self, pointer, nbytes):
        buffer = ctypes.create_string_buffer(nbytes)
        self.check("hipMemcpy", buffer, pointer, nbytes, HIP_MEMCPY_DEVICE_TO_HOST)
        return buffer.raw

    def free(self, pointer):
        self.check("hipFree", pointer)

    def synchronize(self, stream=None):
        if stream is None:
            self.check("hipDeviceSynchronize")
        else:
            self.check("hipStreamSynchronize", stream)


def encode(values, dtype):
    if dtype == "f32":
        return struct.pack("<%df" % len(values), *values)
    return struct.pack("<%dH" % len(values), *ref.to_bf16_bits(values))


def decode(data, dtype):
    if dtype == "f32":
        return list(struct.unpack("<%df" % (len(data) // 4), data))
    return ref.from_bf16_bits(struct.unpack("<%dH" % (len(data) // 2), data))


class Library:
    """ctypes bindings of the HIP library; run() moves flat lists through device memory."""

    def __init__(self, path):
        self.dll = harness.load_library(path, SIGNATURES)

    def error_string(self, code):
        return self.dll.llmops_error_string(code).decode()

    def run(self, device, op, dtype, inputs):
        """Queue op on the null stream, wait, return (rc, flat output).

        The output of rope_neox is q followed by k; an rc other than 0 comes
        with output None.
        """
        function = getattr(self.dll, "llmops_%s_%s" % (op, dtype))
        allocations = []

        def upload(data):
            allocations.append(device.upload(data))
            return allocations[-1]

        def empty(count):
            allocations.append(device.alloc(count * ELEMENT_SIZE[dtype]))
            return allocations[-1], count

        try:
            if op == "rope_neox":
                positions = inputs["positions"]
                results = [(upload(encode(inputs["q"], dtype)), len(inputs["q"])),
                           (upload(encode(inputs["k"], dtype)), len(inputs["k"]))]
                rc = function(results[0][0], results[1][0],
                              upload(struct.pack("<%dq" % len(positions), *positions)),
                              upload(encode(inputs["cos_sin_cache"], "f32")), inputs["tokens"],
                              inputs["q_heads"], inputs["k_heads"], inputs["head_dim"],
                              inputs["rotary_dim"], inputs["max_position"], None)
            else:
                results = [empty(inputs["rows"] * inputs["cols"])]
                given = {"rmsnorm": ("x", "weight"), "silu_mul": ("gate_up",),
                         "softmax": ("x",)}[op]
                args = [results[0][0]] + [upload(encode(inputs[k], dtype)) for k in given]
                args += [inputs["rows"], inputs["cols"]]
                rc = function(*(args + ([inputs["eps"]] if op == "rmsnorm" else []) + [None]))
            if rc != 0:
                return rc, None
            device.synchronize()
            out = []
            for pointer, count in results:
                out.extend(decode(device.download(pointer, count * ELEMENT_SIZE[dtype]), dtype))
            return rc, out
        finally:
            for pointer in allocations:
                device.free(pointer)


def run_all(lib, device, tolerances):
    """Run CASES in every dtype; print the table; return the list of failures."""
    rng = random.Random(20261204)
    worst, failures = {}, []
    for dtype in DTYPES:
        for op, shape, magnitude in CASES:
            key = "%s_%s" % (op, dtype)
            inputs, expected = ref.make_case(op, shape, magnitude, rng, ROUNDING[dtype])
            rc, out = lib.run(device, op, dtype, inputs)
            if rc != 0:
                failures.append("%s %s: returned %d (%s)" % (key, shape, rc, lib.error_string(rc)))
                continue
            worst[key] = max(worst.get(key, 0.0), ref.max_scaled_error(out, expected))
    print("%-16s %-12s %-12s %s" % ("op", "max_error", "tolerance", "result"))
    for key in sorted(worst):
        tol = tolerances.get(key)
        if tol is None:
            failures.append("%s: no tolerance in %s" % (key, os.path.basename(MANIFEST)))
            continue
        passed = worst[key] <= tol
        print("%-16s %-12.3e %-12.3e %s" % (key, worst[key], tol, "ok" if passed else "FAIL"))
        if not passed:
            failures.append("%s: max error %.3e exceeds tolerance %.3e" % (key, worst[key], tol))
    return failures


def build_parser():
    parser = argparse.ArgumentParser(
        description="Run every llm_ops HIP op, fp32 and bf16, against the float64 reference.",
        epilog="example: python3 backends/hip/llm_ops/parity.py --arch gfx90a")
    parser.add_argument("--arch", help="build for this gfx target only "
                                       "(default: build.sh's fat library)")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    hip, reason = open_runtime()
    if hip is None:
        print("SKIP: %s" % reason)
        return 0
    tolerances = load_tolerances()
    with tempfile.TemporaryDirectory(prefix="llmops-hip-parity-") as out_dir:
        try:
            lib = Library(build(out_dir, args.arch))
        except BuildError as error:
            print("error: %s" % error, file=sys.stderr)
            return 2
        try:
            device = Device(hip)
            print("device: %s" % device.describe())
            failures = run_all(lib, device, tolerances)
        except HipError as error:
            failures = ["HIP runtime: %s" % error]
    for failure in failures:
        print("FAIL: %s" % failure)
    print("%d failure(s)" % len(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
