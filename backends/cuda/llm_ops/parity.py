#!/usr/bin/env python3
"""GPU parity of the llm_ops CUDA backend against the float64 reference.

Builds the backend with its build.sh into a temporary directory, runs every
op in fp32 and bf16 on GPU 0 through the CUDA driver API (ctypes on
libcuda.so.1: primary context, cuMemAlloc, copies; kernels on the default
stream, then a context synchronisation), and prints per op the largest scaled
error |out - ref| / max(1, |ref|) next to the tolerance declared in
llm_ops.backend.json.

Without a usable GPU (no libcuda.so.1, cuInit fails, or no device) it prints
one line starting "SKIP:" with the reason and exits 0.

Usage:
    python3 backends/cuda/llm_ops/parity.py [--arch CC]

Exit codes:
    0  every op is within its tolerance, or skipped (no GPU)
    1  an op exceeds its tolerance, returns an error code, or has no tolerance;
       or a CUDA driver call failed
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
LIBRARY_NAME = "libllmops_cuda.so"

sys.path.insert(0, os.path.join(REPO_ROOT, "backends", "reference"))
import llm_ops_ref as ref  # noqa: E402
import backend_harness as harness  # noqa: E402
from backend_harness import BuildError  # noqa: E402

DTYPES = ("f32", "bf16")
ROUNDING = {"f32": ref.to_f32, "bf16": ref.round_bf16}
ELEMENT_SIZE = {"f32": 4, "bf16": 2}

# (op, shape, magnitude): see llm_ops_ref.make_case; each runs in every dtype,
# and its tolerance is the manifest's "<op>_<dtype>". Rows longer than a block
# (256 threads) and more rope pairs than threads exercise the strided loops.
CASES = [
    ("rmsnorm", {"rows": 1, "cols": 1}, 1.0),
    ("rmsnorm", {"rows": 3, "cols": 33}, 1e3),
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
    ("rope_neox", {"tokens": 2, "q_heads": 2, "k_heads": 2, "head_dim": 6,
                   "rotary_dim": 6, "max_position": 9, "offset": -100.0}, 50.0),
    ("softmax", {"rows": 1, "cols": 1}, 1.0),
    ("softmax", {"rows": 3, "cols": 33}, 1.0),
    ("softmax", {"rows": 2, "cols": 4099}, 1e2),
    ("softmax", {"rows": 4, "cols": 7, "offset": -1e4}, 1e4),
    ("softmax", {"rows": 200, "cols": 3, "offset": 8e4}, 100.0),
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

CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76


class DriverError(Exception):
    pass


def build(out_dir, arch=None):
    """Run build.sh into out_dir; return the library path. Raises BuildError."""
    return harness.build(BACKEND_DIR, LIBRARY_NAME, out_dir, arch)


def load_tolerances():
    return harness.load_tolerances(MANIFEST)


def open_driver():
    """Return (libcuda, None) when a GPU is usable, else (None, reason)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as error:
        return None, "no NVIDIA driver: libcuda.so.1 cannot be loaded (%s)" % error
    rc = cuda.cuInit(0)
    if rc != 0:
        return None, "cuInit failed with CUresult %d (no usable GPU)" % rc
    count = ctypes.c_int()
    rc = cuda.cuDeviceGetCount(ctypes.byref(count))
    if rc != 0:
        return None, "cuDeviceGetCount failed with CUresult %d" % rc
    if count.value == 0:
        return None, "no CUDA device"
    return cuda, None


class Device:
    """GPU 0's primary context, made current: the one the CUDA runtime in the library uses."""

    def __init__(self, cuda):
        self.cuda = cuda
        u64, size = ctypes.c_uint64, ctypes.c_size_t
        for name, argtypes in (("cuMemAlloc_v2", [ctypes.POINTER(u64), size]),
                               ("cuMemFree_v2", [u64]),
                               ("cuMemcpyHtoD_v2", [u64, ctypes.c_void_p, size]),
                               ("cuMemcpyDtoH_v2", [ctypes.c_void_p, u64, size]),
                               ("cuStreamCreate", [ctypes.POINTER(ctypes.c_void_p),
                                                   ctypes.c_uint]),
                               ("cuStreamSynchronize", [ctypes.c_void_p]),
                               ("cuStreamDestroy_v2", [ctypes.c_void_p])):
            getattr(cuda, name).argtypes = argtypes
        self.device = ctypes.c_int()
        self.check("cuDeviceGet", ctypes.byref(self.device), 0)
        self.context = ctypes.c_void_p()
        self.check("cuDevicePrimaryCtxRetain", ctypes.byref(self.context), self.device)
        self.check("cuCtxSetCurrent", self.context)

    def check(self, name, *args):
        rc = getattr(self.cuda, name)(*args)
        if rc != 0:
            raise DriverError("%s failed with CUresult %d" % (name, rc))

    def describe(self):
        name = ctypes.create_string_buffer(256)
        self.check("cuDeviceGetName", name, len(name), self.device)
        major, minor, version = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        self.check("cuDeviceGetAttribute", ctypes.byref(major),
                   CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.device)
        self.check("cuDeviceGetAttribute", ctypes.byref(minor),
                   CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.device)
        self.check("cuDriverGetVersion", ctypes.byref(version))
        return "%s (sm_%d%d), driver API %d.%d" % (
            name.value.decode(errors="replace"), major.value, minor.value,
            version.value // 1000, version.value % 1000 // 10)

    def alloc(self, nbytes):
        pointer = ctypes.c_uint64()
        self.check("cuMemAlloc_v2", ctypes.byref(pointer), nbytes)
        return pointer.value

    def upload(self, data):
        pointer = self.alloc(len(data))
        try:
            self.check("cuMemcpyHtoD_v2", pointer, data, len(data))
        except DriverError:
            self.free(pointer)
            raise
        return pointer

    def download(self, pointer, nbytes):
        buffer = ctypes.create_string_buffer(nbytes)
        self.check("cuMemcpyDtoH_v2", buffer, pointer, nbytes)
        return buffer.raw

    def free(self, pointer):
        self.check("cuMemFree_v2", pointer)

    def synchronize(self, stream=None):
        if stream is None:
            self.check("cuCtxSynchronize")
        else:
            self.check("cuStreamSynchronize", stream)

    def create_stream(self):
        stream = ctypes.c_void_p()
        self.check("cuStreamCreate", ctypes.byref(stream), 0)
        return stream

    def destroy_stream(self, stream):
        self.check("cuStreamDestroy_v2", stream)

    def close(self):
        release = getattr(self.cuda, "cuDevicePrimaryCtxRelease_v2", None)
        if release is None:
            release = self.cuda.cuDevicePrimaryCtxRelease
        release(self.device)


def encode(values, dtype):
    if dtype == "f32":
        return struct.pack("<%df" % len(values), *values)
    return struct.pack("<%dH" % len(values), *ref.to_bf16_bits(values))


def decode(data, dtype):
    if dtype == "f32":
        return list(struct.unpack("<%df" % (len(data) // 4), data))
    return ref.from_bf16_bits(struct.unpack("<%dH" % (len(data) // 2), data))


class Library:
    """ctypes bindings of the CUDA library; run() moves flat lists through device memory."""

    def __init__(self, path):
        self.dll = harness.load_library(path, SIGNATURES)

    def error_string(self, code):
        return self.dll.llmops_error_string(code).decode()

    def run(self, device, op, dtype, inputs, stream=None):
        """Queue op on stream (None: the default stream), wait, return (rc, flat output).

        The output of rope_neox is q followed by k; an rc other than 0 comes
        with output None.
        """
        function = getattr(self.dll, "llmops_%s_%s" % (op, dtype))
        size = ELEMENT_SIZE[dtype]
        allocations = []

        def upload(data):
            allocations.append(device.upload(data))
            return allocations[-1]

        def empty(count):
            allocations.append(device.alloc(count * size))
            return allocations[-1]

        try:
            if op == "rmsnorm":
                count = inputs["rows"] * inputs["cols"]
                results = [(empty(count), count)]
                rc = function(results[0][0], upload(encode(inputs["x"], dtype)),
                              upload(encode(inputs["weight"], dtype)), inputs["rows"],
                              inputs["cols"], inputs["eps"], stream)
            elif op == "silu_mul":
                count = inputs["rows"] * inputs["cols"]
                results = [(empty(count), count)]
                rc = function(results[0][0], upload(encode(inputs["gate_up"], dtype)),
                              inputs["rows"], inputs["cols"], stream)
            elif op == "rope_neox":
                q = upload(encode(inputs["q"], dtype))
                k = upload(encode(inputs["k"], dtype))
                positions = inputs["positions"]
                results = [(q, len(inputs["q"])), (k, len(inputs["k"]))]
                rc = function(q, k, upload(struct.pack("<%dq" % len(positions), *positions)),
                              upload(encode(inputs["cos_sin_cache"], "f32")), inputs["tokens"],
                              inputs["q_heads"], inputs["k_heads"], inputs["head_dim"],
                              inputs["rotary_dim"], inputs["max_position"], stream)
            elif op == "softmax":
                count = inputs["rows"] * inputs["cols"]
                results = [(empty(count), count)]
                rc = function(results[0][0], upload(encode(inputs["x"], dtype)),
                              inputs["rows"], inputs["cols"], stream)
            else:
                raise ValueError("unknown op %r" % op)
            if rc != 0:
                return rc, None
            device.synchronize(stream)
            out = []
            for pointer, count in results:
                out.extend(decode(device.download(pointer, count * size), dtype))
            return rc, out
        finally:
            for pointer in allocations:
                device.free(pointer)


def run_case(lib, device, op, dtype, shape, magnitude, rng):
    """Run one case; return (rc, max scaled error). The error is None when rc != 0."""
    inputs, expected = ref.make_case(op, shape, magnitude, rng, ROUNDING[dtype])
    rc, out = lib.run(device, op, dtype, inputs)
    if rc != 0:
        return rc, None
    return rc, ref.max_scaled_error(out, expected)


def run_all(lib, device, tolerances):
    """Run CASES in every dtype; print the table; return the list of failures."""
    rng = random.Random(20261130)
    worst, failures = {}, []
    for dtype in DTYPES:
        for op, shape, magnitude in CASES:
            key = "%s_%s" % (op, dtype)
            rc, error = run_case(lib, device, op, dtype, shape, magnitude, rng)
            if rc != 0:
                failures.append("%s %s: returned %d (%s)" % (key, shape, rc,
                                                            lib.error_string(rc)))
                continue
            worst[key] = max(worst.get(key, 0.0), error)
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
        description="Run every llm_ops CUDA op, fp32 and bf16, against the float64 reference.",
        epilog="example: python3 backends/cuda/llm_ops/parity.py --arch 90")
    parser.add_argument("--arch", help="build for this compute capability only "
                                       "(default: build.sh's fat library)")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    cuda, reason = open_driver()
    if cuda is None:
        print("SKIP: %s" % reason)
        return 0
    tolerances = load_tolerances()
    with tempfile.TemporaryDirectory(prefix="llmops-cuda-parity-") as out_dir:
        try:
            lib = Library(build(out_dir, args.arch))
        except BuildError as error:
            print("error: %s" % error, file=sys.stderr)
            return 2
        try:
            device = Device(cuda)
            try:
                print("device: %s" % device.describe())
                failures = run_all(lib, device, tolerances)
            finally:
                device.close()
        except DriverError as error:
            failures = ["CUDA driver: %s" % error]
    for failure in failures:
        print("FAIL: %s" % failure)
    print("%d failure(s)" % len(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
