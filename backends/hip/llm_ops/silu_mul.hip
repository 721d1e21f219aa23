// SiLU-gated product of the two halves of a fused gate/up projection.
#include <algorithm>

#include "common.hpp"

namespace {

template <typename T>
__global__ void silu_mul_kernel(T* out, const T* gate_up, int cols, size_t total) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const size_t gate = i / cols * 2 * cols + i % cols;
        const float g = llmops::load(gate_up, gate);
        // For g << 0, expf(-g) is inf and g / inf is -0: the right limit.
        llmops::store(out, i, g / (1.0f + expf(-g)) * llmops::load(gate_up, gate + cols));
    }
}

template <typename T>
int silu_mul(T* out, const T* gate_up, int rows, int cols, hipStream_t stream) {
    if (!out || !gate_up) return LLMOPS_ERR_NULL_POINTER;
    if (rows <= 0 || cols <= 0) return LLMOPS_ERR_NONPOSITIVE_SIZE;
    const size_t total = (size_t)rows * cols;
    // Enough blocks to fill any current GPU; the grid-stride loop does the rest.
    const size_t blocks = std::min((total + llmops::kBlock - 1) / llmops::kBlock, (size_t)1 << 16);
    hipLaunchKernelGGL(silu_mul_kernel<T>, dim3((unsigned)blocks), dim3(llmops::kBlock), 0,
                       stream, out, gate_up, cols, total);
    return llmops::launch_status();
}

}  // namespace

extern "C" int llmops_silu_mul_f32(float* out, const float* gate_up, int rows, int cols,
                                   hipStream_t stream) {
    return silu_mul(out, gate_up, rows, cols, stream);
}

extern "C" int llmops_silu_mul_bf16(uint16_t* out, const uint16_t* gate_up, int rows, int cols,
                                    hipStream_t stream) {
    return silu_mul(llmops::bf16(out), llmops::bf16(gate_up), rows, cols, stream);
}
