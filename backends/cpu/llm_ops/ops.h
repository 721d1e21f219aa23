/*
 * llm_ops CPU backend: the C ABI.
 *
 * Tensors are dense, row-major fp32 arrays in host memory; sums are
 * accumulated in double. Every entry point returns LLMOPS_OK (0) or one of the
 * codes >= 1000 below, which llmops_error_string() explains; on an error
 * nothing has been written. Entry points are thread-safe and keep no state.
 */
#ifndef LLMOPS_CPU_OPS_H
#define LLMOPS_CPU_OPS_H

#include <stdint.h>

#define LLMOPS_ABI_VERSION 1

#define LLMOPS_OK 0
#define LLMOPS_ERR_NULL_POINTER 1000     /* a required pointer is NULL */
#define LLMOPS_ERR_NONPOSITIVE_SIZE 1001 /* a size argument is <= 0 */
#define LLMOPS_ERR_INVALID_ARGUMENT 1002 /* a value outside its documented range */

#ifdef __cplusplus
extern "C" {
#endif

uint32_t llmops_abi_version(void);

/* A static English sentence for any code; never NULL. */
const char* llmops_error_string(int code);

/*
 * out[r][c] = x[r][c] / sqrt(mean_k(x[r][k]^2) + eps) * weight[c]
 * x, out: [rows][cols]; weight: [cols]. eps must be finite and >= 0.
 * out may equal x.
 */
int llmops_rmsnorm_f32(float* out, const float* x, const float* weight,
                       int rows, int cols, float eps);

/*
 * out[r][c] = silu(gate_up[r][c]) * gate_up[r][cols + c], silu(g) = g / (1 + e^-g)
 * gate_up: [rows][2*cols] (gate half, then up half); out: [rows][cols].
 */
int llmops_silu_mul_f32(float* out, const float* gate_up, int rows, int cols);

/*
 * Rotary position embedding, NeoX ("rotate half") layout, in place, as the
 * serving engines apply it after the QKV projection:
 *   q: [tokens][q_heads][head_dim], k: [tokens][k_heads][head_dim]
 *   positions: [tokens], each in [0, max_position)
 *   cos_sin_cache: [max_position][rotary_dim]; row p holds cos(p * f_i) for
 *     i < rotary_dim/2 followed by sin(p * f_i), f_i = base^(-2i/rotary_dim).
 * For every head and i < rotary_dim/2, with x1 = x[i], x2 = x[i + rotary_dim/2]:
 *   x[i]                = x1 * cos_i - x2 * sin_i
 *   x[i + rotary_dim/2] = x2 * cos_i + x1 * sin_i
 * Dimensions from rotary_dim to head_dim are left unchanged (partial rotary).
 * rotary_dim must be even and <= head_dim; a position outside
 * [0, max_position) is LLMOPS_ERR_INVALID_ARGUMENT.
 */
int llmops_rope_neox_f32(float* q, float* k, const int64_t* positions,
                         const float* cos_sin_cache, int tokens, int q_heads,
                         int k_heads, int head_dim, int rotary_dim,
                         int max_position);

/*
 * Row softmax, stable for any finite input (the row maximum is subtracted
 * before exponentiation):
 *   out[r][c] = exp(x[r][c] - m_r) / sum_k exp(x[r][k] - m_r), m_r = max_k x[r][k]
 * x, out: [rows][cols]. out may equal x.
 */
int llmops_softmax_f32(float* out, const float* x, int rows, int cols);

#ifdef __cplusplus
}
#endif

#endif
