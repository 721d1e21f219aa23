/* SiLU-gated product of the two halves of a fused gate/up projection. */
#include <math.h>
#include <stddef.h>

#include "ops.h"

int llmops_silu_mul_f32(float* out, const float* gate_up, int rows, int cols) {
    if (!out || !gate_up) return LLMOPS_ERR_NULL_POINTER;
    if (rows <= 0 || cols <= 0) return LLMOPS_ERR_NONPOSITIVE_SIZE;

    for (size_t r = 0; r < (size_t)rows; ++r) {
        const float* gate = gate_up + r * 2 * (size_t)cols;
        const float* up = gate + cols;
        float* outr = out + r * (size_t)cols;
        for (int c = 0; c < cols; ++c) {
            /* For g << 0, expf(-g) overflows to inf and g / inf is -0: the
             * correct limit, so no branch is needed. */
            const float g = gate[c];
            outr[c] = g / (1.0f + expf(-g)) * up[c];
        }
    }
    return LLMOPS_OK;
}
