"""The float64 reference itself, on inputs whose results are known in closed form.

Every backend is judged against it, so a mistake here would pass silently.
"""

import math
import os
import random
import sys
import unittest

BACKEND_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(BACKEND_DIR)))
sys.path.insert(0, os.path.join(REPO_ROOT, "backends", "reference"))
import llm_ops_ref as ref  # noqa: E402


class ReferenceOpsTest(unittest.TestCase):
    def test_rmsnorm_of_a_constant_row_is_its_sign_times_weight(self):
        out = ref.rmsnorm([-3.0] * 4 + [2.0] * 4, [1.0, 2.0, 3.0, 4.0], 2, 4, 0.0)
        self.assertEqual(out, [-1.0, -2.0, -3.0, -4.0, 1.0, 2.0, 3.0, 4.0])

    def test_rmsnorm_adds_eps_inside_the_square_root(self):
        self.assertAlmostEqual(ref.rmsnorm([1.0], [1.0], 1, 1, 3.0)[0], 0.5, places=15)

    def test_silu_mul_matches_the_closed_form_and_its_limits(self):
        out = ref.silu_mul([0.0, 1.0, -1000.0, 1000.0, 2.0, 3.0, 5.0, 7.0], 1, 4)
        self.assertEqual(out[0], 0.0)
        self.assertAlmostEqual(out[1], 3.0 / (1.0 + math.exp(-1.0)), places=15)
        self.assertEqual(out[2], -0.0)
        self.assertEqual(out[3], 7000.0)

    def test_rope_cache_rows_hold_cos_then_sin_of_position_times_frequency(self):
        cache = ref.rope_cos_sin_cache(3, 4, base=100.0)
        frequencies = [1.0, 0.1]
        for p in range(3):
            row = cache[4 * p:4 * p + 4]
            self.assertEqual(row, [math.cos(p * f) for f in frequencies]
                             + [math.sin(p * f) for f in frequencies])

    def test_rope_rotates_the_two_halves_as_neox_does(self):
        cache = [0.0, 1.0]  # cos 0, sin 1: a quarter turn
        q, k = ref.rope_neox([1.0, 2.0, 9.0], [3.0, 4.0, 8.0], [0], cache, 1, 1, 1, 3, 2)
        self.assertEqual(q, [-2.0, 1.0, 9.0])
        self.assertEqual(k, [-4.0, 3.0, 8.0])

    def test_softmax_is_shift_invariant_and_sums_to_one(self):
        row = [1.0, 2.0, 3.0]
        shifted = ref.softmax([v + 1e4 for v in row] + row, 2, 3)
        total = math.exp(1) + math.exp(2) + math.exp(3)
        for r in range(2):
            for c, v in enumerate(row):
                self.assertAlmostEqual(shifted[3 * r + c], math.exp(v) / total, places=15)

    def test_make_case_rounds_inputs_to_the_requested_type(self):
        shape = {"rows": 2, "cols": 5, "offset": -3.0}
        inputs, expected = ref.make_case("softmax", shape, 1.0, random.Random(0), ref.round_bf16)
        self.assertEqual(inputs["x"], ref.round_bf16(inputs["x"]))
        self.assertTrue(all(-4.0 <= v <= -2.0 for v in inputs["x"]))
        self.assertEqual(expected, ref.softmax(inputs["x"], 2, 5))

    def test_make_case_rejects_an_unknown_op(self):
        with self.assertRaisesRegex(ValueError, "unknown op 'gelu'"):
            ref.make_case("gelu", {}, 1.0, random.Random(0))


class RoundingTest(unittest.TestCase):
    def test_to_f32_rounds_to_nearest_float32(self):
        self.assertEqual(ref.to_f32([0.1]), [0.10000000149011612])

    def test_bf16_rounding_is_to_nearest_even(self):
        halfway_down = 1.0 + 2.0 ** -8        # between 1 and 1 + 2^-7: even is 1
        halfway_up = 1.0 + 3 * 2.0 ** -8      # between 1 + 2^-7 and 1 + 2^-6: even is up
        self.assertEqual(ref.round_bf16([halfway_down, halfway_up, -2.5, 1.0 + 2.0 ** -9]),
                         [1.0, 1.0 + 2.0 ** -6, -2.5, 1.0])
        self.assertEqual(ref.to_bf16_bits([1.0, -2.0, 0.0]), [0x3F80, 0xC000, 0x0000])

    def test_bf16_keeps_infinities_and_nans_and_overflows_to_infinity(self):
        bits = ref.to_bf16_bits([math.inf, -math.inf, math.nan, 3.4e38])
        self.assertEqual(bits[:2], [0x7F80, 0xFF80])
        self.assertTrue(math.isnan(ref.from_bf16_bits([bits[2]])[0]))
        self.assertEqual(bits[3], 0x7F80)

    def test_max_scaled_error_is_relative_above_one_and_absolute_below(self):
        self.assertEqual(ref.max_scaled_error([101.0, 0.5], [100.0, 0.25]), 0.25)
        self.assertEqual(ref.max_scaled_error([math.nan], [1.0]), math.inf)
        self.assertEqual(ref.max_scaled_error([math.nan], [math.nan]), 0.0)
        with self.assertRaisesRegex(ValueError, "output has 1 elements, reference 2"):
            ref.max_scaled_error([1.0], [1.0, 2.0])


if __name__ == "__main__":
    unittest.main()
