"""The CPU llm_ops library, built with build.sh and loaded with ctypes, against the reference."""

import ctypes
import json
import math
import os
import random
import sys
import tempfile
import unittest

BACKEND_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(BACKEND_DIR)))
sys.path.insert(0, os.path.join(REPO_ROOT, "backends", "reference"))
sys.path.insert(0, BACKEND_DIR)
import llm_ops_ref as ref  # noqa: E402
import parity  # noqa: E402

ROPE = {"tokens": 1, "q_heads": 1, "k_heads": 1, "head_dim": 2, "rotary_dim": 2,
        "max_position": 1}

# Edge cases on top of parity.CASES: one row, one column, sizes that are not
# multiples of 4 or 32, large and tiny magnitudes, all-negative inputs.
EDGE_CASES = [
    ("rmsnorm", {"rows": 1, "cols": 1}, 1e4),
    ("rmsnorm", {"rows": 9, "cols": 1}, 1.0),
    ("rmsnorm", {"rows": 3, "cols": 31}, 1.0),
    ("rmsnorm", {"rows": 2, "cols": 65}, 1e-20),
    ("rmsnorm", {"rows": 4, "cols": 129, "offset": -500.0}, 10.0),
    ("rmsnorm", {"rows": 1, "cols": 5000}, 3e4),
    ("silu_mul", {"rows": 9, "cols": 1}, 1.0),
    ("silu_mul", {"rows": 3, "cols": 33}, 100.0),
    ("silu_mul", {"rows": 2, "cols": 63, "offset": -50.0}, 45.0),
    ("silu_mul", {"rows": 5, "cols": 257}, 1e4),
    ("rope_neox", dict(ROPE, tokens=7, max_position=3), 1.0),
    ("rope_neox", dict(ROPE, tokens=3, q_heads=32, k_heads=8, head_dim=128,
                           rotary_dim=128, max_position=8192), 1.0),
    ("rope_neox", dict(ROPE, tokens=4, q_heads=5, k_heads=3, head_dim=96,
                           rotary_dim=24, max_position=17), 1e4),
    ("rope_neox", dict(ROPE, tokens=2, q_heads=3, k_heads=1, head_dim=10,
                           rotary_dim=2, max_position=5, offset=-100.0), 50.0),
    ("softmax", {"rows": 9, "cols": 1}, 1.0),
    ("softmax", {"rows": 1, "cols": 2}, 1e4),
    ("softmax", {"rows": 5, "cols": 31}, 30.0),
    ("softmax", {"rows": 2, "cols": 4099, "offset": -3e4}, 10.0),
    ("softmax", {"rows": 3, "cols": 100, "offset": 8e4}, 100.0),
]

lib = None
build_dir = None


def setUpModule():
    global lib, build_dir
    build_dir = tempfile.TemporaryDirectory(prefix="llmops-cpu-test-")
    lib = parity.Library(parity.build(build_dir.name))


def tearDownModule():
    build_dir.cleanup()


def floats(values):
    return (ctypes.c_float * len(values))(*values)


class NumericParityTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tolerances = parity.load_tolerances()

    def check_op(self, op):
        rng = random.Random(op)
        cases = [c for c in parity.CASES + EDGE_CASES if c[0] == op]
        self.assertGreater(len(cases), 4)
        for _, shape, magnitude in cases:
            with self.subTest(shape=shape, magnitude=magnitude):
                rc, error = parity.run_case(lib, op, shape, magnitude, rng)
                self.assertEqual(rc, 0, lib.error_string(rc))
                self.assertLessEqual(error, self.tolerances[op + "_f32"])

    def test_rmsnorm_matches_reference_within_tolerance(self):
        self.check_op("rmsnorm")

    def test_silu_mul_matches_reference_within_tolerance(self):
        self.check_op("silu_mul")

    def test_rope_neox_matches_reference_within_tolerance(self):
        self.check_op("rope_neox")

    def test_softmax_matches_reference_within_tolerance(self):
        self.check_op("softmax")

    def test_every_declared_tolerance_names_an_exported_op(self):
        for op in self.tolerances:
            self.assertTrue(hasattr(lib.dll, "llmops_" + op), op)


class KernelBehaviourTest(unittest.TestCase):
    def test_rmsnorm_in_place_equals_out_of_place(self):
        x = ref.to_f32([(-1) ** i * (i + 0.5) for i in range(3 * 37)])
        weight = ref.to_f32([0.25 * i for i in range(37)])
        _, expected = lib.rmsnorm(x, weight, 3, 37, 1e-5)
        buffer = floats(x)
        self.assertEqual(lib.dll.llmops_rmsnorm_f32(buffer, buffer, floats(weight), 3, 37,
                                                    1e-5), 0)
        self.assertEqual(list(buffer), expected)

    def test_softmax_in_place_equals_out_of_place(self):
        x = ref.to_f32([math.sin(i) * 40 for i in range(2 * 50)])
        _, expected = lib.softmax(x, 2, 50)
        buffer = floats(x)
        self.assertEqual(lib.dll.llmops_softmax_f32(buffer, buffer, 2, 50), 0)
        self.assertEqual(list(buffer), expected)

    def test_softmax_of_huge_logits_is_finite_and_sums_to_one(self):
        rc, out = lib.softmax([3e38, 3e38, -3e38, 1e38], 1, 4)
        self.assertEqual(rc, 0)
        self.assertEqual(out, [0.5, 0.5, 0.0, 0.0])

    def test_silu_mul_of_very_negative_gate_is_zero_not_nan(self):
        rc, out = lib.silu_mul([-1e30, -200.0, 5.0, 7.0], 1, 2)
        self.assertEqual(rc, 0)
        self.assertEqual(out, [0.0, 0.0])

    def test_rope_leaves_dimensions_past_rotary_dim_unchanged(self):
        head_dim, rotary_dim = 12, 4
        q = ref.to_f32([1.0 + i for i in range(2 * head_dim)])
        k = ref.to_f32([-3.0 - i for i in range(head_dim)])
        cache = ref.to_f32(ref.rope_cos_sin_cache(10, rotary_dim))
        rc, out = lib.rope_neox(q, k, [7], cache, 1, 2, 1, head_dim, rotary_dim, 10)
        self.assertEqual(rc, 0)
        q_out, k_out = out[:len(q)], out[len(q):]
        for h in range(2):
            head = slice(h * head_dim + rotary_dim, (h + 1) * head_dim)
            self.assertEqual(q_out[head], q[head])
        self.assertEqual(k_out[rotary_dim:], k[rotary_dim:])
        self.assertNotEqual(q_out[:rotary_dim], q[:rotary_dim])

    def test_rope_at_position_zero_is_the_identity(self):
        q = ref.to_f32([0.1 * i - 2 for i in range(3 * 8)])
        k = ref.to_f32([0.3 * i for i in range(8)])
        cache = ref.to_f32(ref.rope_cos_sin_cache(4, 8))
        rc, out = lib.rope_neox(q, k, [0], cache, 1, 3, 1, 8, 8, 4)
        self.assertEqual(rc, 0)
        self.assertEqual(out, q + k)


class BadArgumentTest(unittest.TestCase):
    """Bad arguments return the codes documented in ops.h and write nothing."""

    NULL, SIZE, INVALID = 1000, 1001, 1002

    def setUp(self):
        self.a, self.b, self.c = floats([1.0] * 64), floats([2.0] * 64), floats([3.0] * 64)
        self.positions = (ctypes.c_int64 * 4)(0, 1, 2, 3)

    def rope(self, **changes):
        args = dict(q=self.a, k=self.b, positions=self.positions, cache=self.c, tokens=2,
                    q_heads=2, k_heads=1, head_dim=8, rotary_dim=8, max_position=4)
        args.update(changes)
        return lib.dll.llmops_rope_neox_f32(*args.values())

    def test_null_pointers_return_the_null_pointer_code(self):
        d = lib.dll
        a, b, c = self.a, self.b, self.c
        self.assertEqual(d.llmops_rmsnorm_f32(None, b, c, 1, 4, 1e-6), self.NULL)
        self.assertEqual(d.llmops_rmsnorm_f32(a, None, c, 1, 4, 1e-6), self.NULL)
        self.assertEqual(d.llmops_rmsnorm_f32(a, b, None, 1, 4, 1e-6), self.NULL)
        self.assertEqual(d.llmops_silu_mul_f32(None, b, 1, 4), self.NULL)
        self.assertEqual(d.llmops_silu_mul_f32(a, None, 1, 4), self.NULL)
        self.assertEqual(d.llmops_softmax_f32(None, b, 1, 4), self.NULL)
        self.assertEqual(d.llmops_softmax_f32(a, None, 1, 4), self.NULL)
        for name in ("q", "k", "positions", "cache"):
            self.assertEqual(self.rope(**{name: None}), self.NULL, name)

    def test_zero_and_negative_sizes_return_the_size_code(self):
        d = lib.dll
        a, b, c = self.a, self.b, self.c
        for rows, cols in ((0, 4), (4, 0), (-1, 4), (4, -2147483648)):
            with self.subTest(rows=rows, cols=cols):
                self.assertEqual(d.llmops_rmsnorm_f32(a, b, c, rows, cols, 1e-6), self.SIZE)
                self.assertEqual(d.llmops_silu_mul_f32(a, b, rows, cols), self.SIZE)
                self.assertEqual(d.llmops_softmax_f32(a, b, rows, cols), self.SIZE)
        for name in ("tokens", "q_heads", "k_heads", "head_dim", "rotary_dim", "max_position"):
            for value in (0, -3):
                self.assertEqual(self.rope(**{name: value}), self.SIZE, (name, value))

    def test_out_of_range_values_return_the_invalid_argument_code(self):
        d = lib.dll
        for eps in (-1e-6, math.nan, math.inf):
            self.assertEqual(d.llmops_rmsnorm_f32(self.a, self.b, self.c, 1, 4, eps),
                             self.INVALID, eps)
        self.assertEqual(self.rope(rotary_dim=7), self.INVALID)
        self.assertEqual(self.rope(rotary_dim=10), self.INVALID)
        self.assertEqual(self.rope(max_position=1), self.INVALID)
        self.positions[1] = -1
        self.assertEqual(self.rope(), self.INVALID)

    def test_rope_with_a_bad_position_writes_nothing(self):
        self.positions[1] = 4
        self.assertEqual(self.rope(), self.INVALID)
        self.assertEqual(list(self.a), [1.0] * 64)
        self.assertEqual(list(self.b), [2.0] * 64)

    def test_error_strings_explain_every_code(self):
        self.assertEqual(lib.error_string(0), "success")
        self.assertEqual(lib.error_string(self.NULL), "a required pointer argument is NULL")
        self.assertEqual(lib.error_string(self.SIZE), "a size argument is zero or negative")
        self.assertEqual(lib.error_string(self.INVALID),
                         "an argument is outside its documented range (see ops.h)")
        for code in (-1, 1, 999, 1003):
            self.assertEqual(lib.error_string(code), "unknown llmops error code")


class AbiTest(unittest.TestCase):
    def test_abi_version_matches_the_manifest(self):
        with open(parity.MANIFEST) as f:
            manifest = json.load(f)
        self.assertEqual(lib.dll.llmops_abi_version(), manifest["abi_version"])


if __name__ == "__main__":
    unittest.main()
