// Device helpers shared by the llm_ops CUDA kernels (not part of the ABI).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "llm_ops.h"

namespace llmops {

// Every kernel runs blocks of whole warps, so full-mask shuffles are safe.
constexpr int kBlock = 256;

__device__ __forceinline__ float load(const float* p, size_t i) { return p[i]; }
__device__ __forceinline__ float load(const __nv_bfloat16* p, size_t i) {
    return __bfloat162float(p[i]);
}
__device__ __forceinline__ void store(float* p, size_t i, float v) { p[i] = v; }
__device__ __forceinline__ void store(__nv_bfloat16* p, size_t i, float v) {
    p[i] = __float2bfloat16_rn(v);
}

struct Sum {
    __device__ float operator()(float a, float b) const { return a + b; }
    static constexpr float identity = 0.0f;
};
struct Max {
    __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
    static constexpr float identity = -INFINITY;
};

// Reduce v over the block; every thread gets the result. Safe to call
// repeatedly in one kernel (the leading barrier guards the shared slots).
template <typename Op>
__device__ float block_reduce(float v, Op op) {
    __shared__ float partial[32];
    for (int offset = 16; offset > 0; offset >>= 1)
        v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = Op::identity;
    if (lane < (int)(blockDim.x >> 5)) v = partial[lane];
    for (int offset = 16; offset > 0; offset >>= 1)
        v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

// a*b - c*d with one rounding of each product's error recovered by fma
// (Kahan), so x1*cos - x2*sin keeps full precision when the terms cancel.
__device__ __forceinline__ float diff_of_products(float a, float b, float c, float d) {
    const float cd = c * d;
    const float err = fmaf(-c, d, cd);
    return fmaf(a, b, -cd) + err;
}

inline int launch_status() {
    return cudaGetLastError() == cudaSuccess ? LLMOPS_OK : LLMOPS_ERR_LAUNCH_FAILED;
}

inline __nv_bfloat16* bf16(uint16_t* p) { return reinterpret_cast<__nv_bfloat16*>(p); }
inline const __nv_bfloat16* bf16(const uint16_t* p) {
    return reinterpret_cast<const __nv_bfloat16*>(p);
}

}  // namespace llmops
