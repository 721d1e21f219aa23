"""The CUDA kernels on a GPU against the float64 reference, within the manifest's tolerances.

Skipped, with the reason, when there is no usable GPU (checked through
libcuda.so.1: cuInit and cuDeviceGetCount) or no nvcc to build the library.
"""

import os
import random
import shutil
import sys
import tempfile
import unittest

BACKEND_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, BACKEND_DIR)
import parity  # noqa: E402
from parity import ref  # noqa: E402

NVCC = os.environ.get("NVCC") or shutil.which("nvcc")
ROPE = {"tokens": 1, "q_heads": 1, "k_heads": 1, "head_dim": 2, "rotary_dim": 2,
        "max_position": 1}

# Edge cases on top of parity.CASES: one row or column, sizes off multiples of
# 4 and 32, tiny and huge magnitudes, all-negative inputs.
EDGE_CASES = [
    ("rmsnorm", {"rows": 9, "cols": 1}, 1e4),
    ("rmsnorm", {"rows": 2, "cols": 65}, 1e-20),
    ("rmsnorm", {"rows": 1, "cols": 257, "offset": -500.0}, 10.0),
    ("silu_mul", {"rows": 9, "cols": 1}, 1.0),
    ("silu_mul", {"rows": 5, "cols": 33}, 1e4),
    ("rope_neox", dict(ROPE, tokens=7, max_position=3), 1.0),
    ("rope_neox", dict(ROPE, tokens=4, q_heads=5, k_heads=3, head_dim=96, rotary_dim=24,
                       max_position=17), 1e4),
    ("softmax", {"rows": 9, "cols": 1}, 1.0),
    ("softmax", {"rows": 1, "cols": 2}, 1e4),
    ("softmax", {"rows": 2, "cols": 1031, "offset": -3e4}, 10.0),
]

lib = device = build_dir = None


def setUpModule():
    global lib, device, build_dir
    cuda, reason = parity.open_driver()
    if cuda is None:
        raise unittest.SkipTest("no GPU: %s" % reason)
    if not NVCC:
        raise unittest.SkipTest("nvcc not found on PATH (set NVCC to build the CUDA backend)")
    build_dir = tempfile.TemporaryDirectory(prefix="llmops-cuda-gpu-")
    lib = parity.Library(parity.build(build_dir.name))
    device = parity.Device(cuda)


def tearDownModule():
    if device is not None:
        device.close()
    if build_dir is not None:
        build_dir.cleanup()


class GpuParityTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tolerances = parity.load_tolerances()

    def check_op(self, op):
        for dtype in parity.DTYPES:
            rng = random.Random(op + dtype)
            for _, shape, magnitude in [c for c in parity.CASES + EDGE_CASES if c[0] == op]:
                with self.subTest(dtype=dtype, shape=shape, magnitude=magnitude):
                    rc, error = parity.run_case(lib, device, op, dtype, shape, magnitude, rng)
                    self.assertEqual(rc, 0, lib.error_string(rc))
                    self.assertLessEqual(error, self.tolerances["%s_%s" % (op, dtype)])

    def test_rmsnorm_matches_reference_within_tolerance(self):
        self.check_op("rmsnorm")

    def test_silu_mul_matches_reference_within_tolerance(self):
        self.check_op("silu_mul")

    def test_rope_neox_matches_reference_within_tolerance(self):
        self.check_op("rope_neox")

    def test_softmax_matches_reference_within_tolerance(self):
        self.check_op("softmax")


class GpuBehaviourTest(unittest.TestCase):
    def test_work_queued_on_a_created_stream_matches_the_default_stream(self):
        inputs, _ = ref.make_case("softmax", {"rows": 64, "cols": 300}, 20.0, random.Random(1))
        _, on_default = lib.run(device, "softmax", "f32", inputs)
        stream = device.create_stream()
        try:
            rc, on_stream = lib.run(device, "softmax", "f32", inputs, stream)
        finally:
            device.destroy_stream(stream)
        self.assertEqual(rc, 0)
        self.assertEqual(on_stream, on_default)

    def test_rmsnorm_and_softmax_in_place_equal_out_of_place(self):
        x = ref.to_f32([(-1) ** i * (i % 50) * 0.7 for i in range(3 * 300)])
        weight = ref.to_f32([0.01 * i for i in range(300)])
        eps = ref.to_f32([1e-6])[0]
        w = device.upload(parity.encode(weight, "f32"))
        self.addCleanup(device.free, w)
        for op in ("rmsnorm", "softmax"):
            with self.subTest(op=op):
                inputs = {"x": x, "rows": 3, "cols": 300}
                if op == "rmsnorm":
                    inputs.update(weight=weight, eps=eps)
                _, expected = lib.run(device, op, "f32", inputs)
                p = device.upload(parity.encode(x, "f32"))
                try:
                    if op == "rmsnorm":
                        rc = lib.dll.llmops_rmsnorm_f32(p, p, w, 3, 300, eps, None)
                    else:
                        rc = lib.dll.llmops_softmax_f32(p, p, 3, 300, None)
                    self.assertEqual(rc, 0)
                    device.synchronize()
                    self.assertEqual(parity.decode(device.download(p, 4 * len(x)), "f32"),
                                     expected)
                finally:
                    device.free(p)

    def test_rope_leaves_a_token_with_an_out_of_range_position_unchanged(self):
        q = ref.to_f32([1.0 + i for i in range(3 * 8)])
        k = ref.to_f32([-1.0 - i for i in range(3 * 8)])
        cache = ref.to_f32(ref.rope_cos_sin_cache(4, 8))
        rc, out = lib.run(device, "rope_neox", "f32", {
            "q": q, "k": k, "positions": [3, 4, -1], "cos_sin_cache": cache, "tokens": 3,
            "q_heads": 1, "k_heads": 1, "head_dim": 8, "rotary_dim": 8, "max_position": 4})
        self.assertEqual(rc, 0)
        q_out, k_out = out[:24], out[24:]
        self.assertEqual((q_out[8:], k_out[8:]), (q[8:], k[8:]))
        self.assertNotEqual(q_out[:8], q[:8])

    def test_silu_mul_of_very_negative_gate_is_zero_not_nan(self):
        for dtype in parity.DTYPES:
            rc, out = lib.run(device, "silu_mul", dtype,
                              {"gate_up": [-1e30, -200.0, 5.0, 7.0], "rows": 1, "cols": 2})
            self.assertEqual((rc, out), (0, [0.0, 0.0]), dtype)

if __name__ == "__main__":
    unittest.main()
