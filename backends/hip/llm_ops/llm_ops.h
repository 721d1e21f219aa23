/*
 * llm_ops HIP backend: the C ABI (the same ops and codes as the CPU and CUDA
 * backends).
 *
 * Tensors are dense, row-major arrays in device memory: fp32 (float) or bf16
 * (uint16_t holding the bfloat16 bit pattern, so C callers need no HIP
 * headers for the type). bf16 variants read and write bf16 and compute in
 * fp32; reductions accumulate in fp32. The rope cos/sin cache is fp32 for
 * both variants.
 *
 * Every entry point queues its work on `stream` (the last argument; 0 is the
 * null stream), never synchronises, and returns LLMOPS_OK (0) once the work
 * is queued, or a code >= 1000 that llmops_error_string() explains.
 * Arguments are checked on the host before anything is queued; contents of
 * device memory cannot be checked without a synchronisation, so a rope
 * position outside [0, max_position) leaves that token's q and k unchanged.
 * LLMOPS_ERR_LAUNCH_FAILED reports what hipGetLastError() returned after the
 * launch (and clears it, as hipGetLastError does).
 */
#ifndef LLMOPS_HIP_LLM_OPS_H
#define LLMOPS_HIP_LLM_OPS_H

#include <stdint.h>

#include <hip/hip_runtime_api.h>

#define LLMOPS_ABI_VERSION 1

#define LLMOPS_OK 0
#define LLMOPS_ERR_NULL_POINTER 1000     /* a required pointer is NULL */
#define LLMOPS_ERR_NONPOSITIVE_SIZE 1001 /* a size argument is <= 0 */
#define LLMOPS_ERR_INVALID_ARGUMENT 1002 /* a value outside its documented range */
#define LLMOPS_ERR_LAUNCH_FAILED 1003    /* the HIP runtime refused the kernel launch */

#if defined(__GNUC__)
#define LLMOPS_API __attribute__((visibility("default")))
#else
#define LLMOPS_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

LLMOPS_API uint32_t llmops_abi_version(void);

/* A static English sentence for any code; never NULL. */
LLMOPS_API const char* llmops_error_string(int code);

/*
 * out[r][c] = x[r][c] / sqrt(mean_k(x[r][k]^2) + eps) * weight[c]
 * x, out: [rows][cols]; weight: [cols]. eps must be finite and >= 0.
 * out may equal x.
 */
LLMOPS_API int llmops_rmsnorm_f32(float* out, const float* x, const float* weight,
                                  int rows, int cols, float eps, hipStream_t stream);
LLMOPS_API int llmops_rmsnorm_bf16(uint16_t* out, const uint16_t* x, const uint16_t* weight,
                                   int rows, int cols, float eps, hipStream_t stream);

/*
 * out[r][c] = silu(gate_up[r][c]) * gate_up[r][cols + c], silu(g) = g / (1 + e^-g)
 * gate_up: [rows][2*cols] (gate half, then up half); out: [rows][cols].
 */
LLMOPS_API int llmops_silu_mul_f32(float* out, const float* gate_up, int rows, int cols,
                                   hipStream_t stream);
LLMOPS_API int llmops_silu_mul_bf16(uint16_t* out, const uint16_t* gate_up, int rows,
                                    int cols, hipStream_t stream);

/*
 * Rotary position embedding, NeoX ("rotate half") layout, in place:
 *   q: [tokens][q_heads][head_dim], k: [tokens][k_heads][head_dim]
 *   positions: [tokens] (int64, as serving engines keep them)
 *   cos_sin_cache: fp32 [max_position][rotary_dim]; row p holds cos(p * f_i)
 *     for i < rotary_dim/2 followed by sin(p * f_i), f_i = base^(-2i/rotary_dim).
 * For every head and i < rotary_dim/2, with x1 = x[i], x2 = x[i + rotary_dim/2]:
 *   x[i]                = x1 * cos_i - x2 * sin_i
 *   x[i + rotary_dim/2] = x2 * cos_i + x1 * sin_i
 * Dimensions from rotary_dim to head_dim are left unchanged (partial rotary).
 * rotary_dim must be even and <= head_dim.
 */
LLMOPS_API int llmops_rope_neox_f32(float* q, float* k, const int64_t* positions,
                                    const float* cos_sin_cache, int tokens, int q_heads,
                                    int k_heads, int head_dim, int rotary_dim,
                                    int max_position, hipStream_t stream);
LLMOPS_API int llmops_rope_neox_bf16(uint16_t* q, uint16_t* k, const int64_t* positions,
                                     const float* cos_sin_cache, int tokens, int q_heads,
                                     int k_heads, int head_dim, int rotary_dim,
                                     int max_position, hipStream_t stream);

/*
 * Row softmax, stable for any finite input (the row maximum is subtracted
 * before exponentiation):
 *   out[r][c] = exp(x[r][c] - m_r) / sum_k exp(x[r][k] - m_r), m_r = max_k x[r][k]
 * x, out: [rows][cols]. out may equal x.
 */
LLMOPS_API int llmops_softmax_f32(float* out, const float* x, int rows, int cols,
                                  hipStream_t stream);
LLMOPS_API int llmops_softmax_bf16(uint16_t* out, const uint16_t* x, int rows, int cols,
                                   hipStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
