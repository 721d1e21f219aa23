/* Rotary position embedding, NeoX (rotate-half) layout, from a cos/sin cache. */
#include <stddef.h>

#include "ops.h"

static void rotate_heads(float* x, int heads, int head_dim, int half,
                         const float* cos, const float* sin) {
    for (int h = 0; h < heads; ++h) {
        float* head = x + (size_t)h * head_dim;
        for (int i = 0; i < half; ++i) {
            /* float * float is exact in double, so each output is rounded
             * once: no cancellation error when x1*cos ~ x2*sin. */
            const double x1 = head[i], x2 = head[i + half];
            head[i] = (float)(x1 * cos[i] - x2 * sin[i]);
            head[i + half] = (float)(x2 * cos[i] + x1 * sin[i]);
        }
    }
}

int llmops_rope_neox_f32(float* q, float* k, const int64_t* positions,
                         const float* cos_sin_cache, int tokens, int q_heads,
                         int k_heads, int head_dim, int rotary_dim,
                         int max_position) {
    if (!q || !k || !positions || !cos_sin_cache) return LLMOPS_ERR_NULL_POINTER;
    if (tokens <= 0 || q_heads <= 0 || k_heads <= 0 || head_dim <= 0 ||
        rotary_dim <= 0 || max_position <= 0)
        return LLMOPS_ERR_NONPOSITIVE_SIZE;
    if (rotary_dim % 2 != 0 || rotary_dim > head_dim) return LLMOPS_ERR_INVALID_ARGUMENT;
    /* Check every position before touching q or k: an error writes nothing. */
    for (int t = 0; t < tokens; ++t)
        if (positions[t] < 0 || positions[t] >= max_position)
            return LLMOPS_ERR_INVALID_ARGUMENT;

    const int half = rotary_dim / 2;
    for (size_t t = 0; t < (size_t)tokens; ++t) {
        const float* cos = cos_sin_cache + (size_t)positions[t] * rotary_dim;
        const float* sin = cos + half;
        rotate_heads(q + t * q_heads * (size_t)head_dim, q_heads, head_dim, half, cos, sin);
        rotate_heads(k + t * k_heads * (size_t)head_dim, k_heads, head_dim, half, cos, sin);
    }
    return LLMOPS_OK;
}
