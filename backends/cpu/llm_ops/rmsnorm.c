/* RMSNorm over the last dimension. */
#include <math.h>
#include <stddef.h>

#include "ops.h"

int llmops_rmsnorm_f32(float* out, const float* x, const float* weight,
                       int rows, int cols, float eps) {
    if (!out || !x || !weight) return LLMOPS_ERR_NULL_POINTER;
    if (rows <= 0 || cols <= 0) return LLMOPS_ERR_NONPOSITIVE_SIZE;
    if (!(eps >= 0.0f) || isinf(eps)) return LLMOPS_ERR_INVALID_ARGUMENT;

    for (size_t r = 0; r < (size_t)rows; ++r) {
        const float* xr = x + r * (size_t)cols;
        float* outr = out + r * (size_t)cols;
        double sum_squares = 0.0;
        for (int c = 0; c < cols; ++c) sum_squares += (double)xr[c] * xr[c];
        const double inv_rms = 1.0 / sqrt(sum_squares / cols + eps);
        for (int c = 0; c < cols; ++c)
            outr[c] = (float)((double)xr[c] * inv_rms * weight[c]);
    }
    return LLMOPS_OK;
}
