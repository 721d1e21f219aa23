// Device helpers shared by the llm_ops HIP kernels (not part of the ABI).
#pragma once

#include <hip/hip_runtime.h>

#include "llm_ops.h"

namespace llmops {

// 256 threads: four wavefronts of 64 on CDNA (gfx90a, gfx940), eight of 32
// on RDNA (gfx1030); a block is always whole wavefronts.
constexpr int kBlock = 256;
constexpr int kMaxWaves = kBlock / 32;

// bf16 is kept as its bit pattern: the top half of an fp32.
struct Bf16 {
    uint16_t bits;
};

__device__ __forceinline__ float load(const float* p, size_t i) { return p[i]; }
__device__ __forceinline__ float load(const Bf16* p, size_t i) {
    return __uint_as_float((uint32_t)p[i].bits << 16);
}
__device__ __forceinline__ void store(float* p, size_t i, float v) { p[i] = v; }
// Round to nearest, ties to even; a NaN stays a (quiet) NaN.
__device__ __forceinline__ void store(Bf16* p, size_t i, float v) {
    uint32_t u = __float_as_uint(v);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        u |= 0x00400000u;
    else
        u += 0x7fffu + ((u >> 16) & 1u);
    p[i].bits = (uint16_t)(u >> 16);
}

struct Sum {
    __device__ float operator()(float a, float b) const { return a + b; }
    static constexpr float identity = 0.0f;
};
struct Max {
    __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
    static constexpr float identity = -INFINITY;
};

// Reduce v across the wavefront, whatever its width on this target.
template <typename Op>
__device__ float wave_reduce(float v, Op op) {
    for (int offset = warpSize / 2; offset > 0; offset >>= 1)
        v = op(v, __shfl_xor(v, offset));
    return v;
}

// Reduce v over the block; every thread gets the result. Safe to call
// repeatedly in one kernel (the leading barrier guards the shared slots).
template <typename Op>
__device__ float block_reduce(float v, Op op) {
    __shared__ float partial[kMaxWaves];
    v = wave_reduce(v, op);
    const int lane = threadIdx.x % warpSize, wave = threadIdx.x / warpSize;
    __syncthreads();
    if (lane == 0) partial[wave] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x / warpSize) ? partial[lane] : Op::identity;
    return wave_reduce(v, op);
}

// a*b - c*d with one rounding of each product's error recovered by fma
// (Kahan), so x1*cos - x2*sin keeps full precision when the terms cancel.
__device__ __forceinline__ float diff_of_products(float a, float b, float c, float d) {
    const float cd = c * d;
    const float err = fmaf(-c, d, cd);
    return fmaf(a, b, -cd) + err;
}

inline int launch_status() {
    return hipGetLastError() == hipSuccess ? LLMOPS_OK : LLMOPS_ERR_LAUNCH_FAILED;
}

inline Bf16* bf16(uint16_t* p) { return reinterpret_cast<Bf16*>(p); }
inline const Bf16* bf16(const uint16_t* p) { return reinterpret_cast<const Bf16*>(p); }

}  // namespace llmops
