// Rotary position embedding, NeoX (rotate-half) layout: one block per token.
#include "common.hpp"

namespace {

template <typename T>
__global__ void rope_neox_kernel(T* q, T* k, const int64_t* positions,
                                 const float* cos_sin_cache, int q_heads, int k_heads,
                                 int head_dim, int rotary_dim, int max_position) {
    const size_t token = blockIdx.x;
    const int64_t position = positions[token];
    if (position < 0 || position >= max_position) return;  // documented: token unchanged
    const int half = rotary_dim / 2;
    const float* cos_row = cos_sin_cache + position * rotary_dim;
    const float* sin_row = cos_row + half;
    const int64_t pairs = ((int64_t)q_heads + k_heads) * half;
    for (int64_t j = threadIdx.x; j < pairs; j += blockDim.x) {
        const int64_t head = j / half;
        const int i = (int)(j % half);
        T* x = head < q_heads ? q + (token * q_heads + head) * head_dim
                              : k + (token * k_heads + (head - q_heads)) * head_dim;
        const float x1 = llmops::load(x, i), x2 = llmops::load(x, i + half);
        const float c = cos_row[i], s = sin_row[i];
        llmops::store(x, i, llmops::diff_of_products(x1, c, x2, s));
        llmops::store(x, i + half, llmops::diff_of_products(x2, c, -x1, s));
    }
}

template <typename T>
int rope_neox(T* q, T* k, const int64_t* positions, const float* cos_sin_cache, int tokens,
              int q_heads, int k_heads, int head_dim, int rotary_dim, int max_position,
              hipStream_t stream) {
    if (!q || !k || !positions || !cos_sin_cache) return LLMOPS_ERR_NULL_POINTER;
    if (tokens <= 0 || q_heads <= 0 || k_heads <= 0 || head_dim <= 0 || rotary_dim <= 0 ||
        max_position <= 0)
        return LLMOPS_ERR_NONPOSITIVE_SIZE;
    if (rotary_dim % 2 != 0 || rotary_dim > head_dim) return LLMOPS_ERR_INVALID_ARGUMENT;
    hipLaunchKernelGGL(rope_neox_kernel<T>, dim3(tokens), dim3(llmops::kBlock), 0, stream, q, k,
                       positions, cos_sin_cache, q_heads, k_heads, head_dim, rotary_dim,
                       max_position);
    return llmops::launch_status();
}

}  // namespace

extern "C" int llmops_rope_neox_f32(float* q, float* k, const int64_t* positions,
                                    const float* cos_sin_cache, int tokens, int q_heads,
                                    int k_heads, int head_dim, int rotary_dim, int max_position,
                                    hipStream_t stream) {
    return rope_neox(q, k, positions, cos_sin_cache, tokens, q_heads, k_heads, head_dim,
                     rotary_dim, max_position, stream);
}

extern "C" int llmops_rope_neox_bf16(uint16_t* q, uint16_t* k, const int64_t* positions,
                                     const float* cos_sin_cache, int tokens, int q_heads,
                                     int k_heads, int head_dim, int rotary_dim,
                                     int max_position, hipStream_t stream) {
    return rope_neox(llmops::bf16(q), llmops::bf16(k), positions, cos_sin_cache, tokens,
                     q_heads, k_heads, head_dim, rotary_dim, max_position, stream);
}
