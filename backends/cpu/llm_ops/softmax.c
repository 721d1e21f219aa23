/* Numerically stable softmax over each row. */
#include <math.h>
#include <stddef.h>

#include "ops.h"

int llmops_softmax_f32(float* out, const float* x, int rows, int cols) {
    if (!out || !x) return LLMOPS_ERR_NULL_POINTER;
    if (rows <= 0 || cols <= 0) return LLMOPS_ERR_NONPOSITIVE_SIZE;

    for (size_t r = 0; r < (size_t)rows; ++r) {
        const float* xr = x + r * (size_t)cols;
        float* outr = out + r * (size_t)cols;
        float peak = xr[0];
        for (int c = 1; c < cols; ++c) peak = xr[c] > peak ? xr[c] : peak;
        /* Each exponent is <= 0, so nothing overflows; the largest term is 1,
         * so the sum is >= 1. */
        double total = 0.0;
        for (int c = 0; c < cols; ++c) {
            const float e = expf(xr[c] - peak);
            outr[c] = e;
            total += e;
        }
        const double inv_total = 1.0 / total;
        for (int c = 0; c < cols; ++c) outr[c] = (float)(outr[c] * inv_total);
    }
    return LLMOPS_OK;
}
