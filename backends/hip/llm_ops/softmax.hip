// Numerically stable row softmax: one block per row.
#include "common.hpp"

namespace {

template <typename T>
__global__ void softmax_kernel(T* out, const T* x, int cols) {
    const size_t row = (size_t)blockIdx.x * cols;
    float peak = -INFINITY;
    for (int c = threadIdx.x; c < cols; c += blockDim.x)
        peak = fmaxf(peak, llmops::load(x, row + c));
    peak = llmops::block_reduce(peak, llmops::Max());
    // Every exponent is <= 0 and the peak's term is 1: no overflow, total >= 1.
    float total = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x)
        total += expf(llmops::load(x, row + c) - peak);
    total = llmops::block_reduce(total, llmops::Sum());
    // Both reductions end in a barrier, so writing in place is safe from here.
    for (int c = threadIdx.x; c < cols; c += blockDim.x)
        llmops::store(out, row + c, expf(llmops::load(x, row + c) - peak) / total);
}

template <typename T>
int softmax(T* out, const T* x, int rows, int cols, hipStream_t stream) {
    if (!out || !x) return LLMOPS_ERR_NULL_POINTER;
    if (rows <= 0 || cols <= 0) return LLMOPS_ERR_NONPOSITIVE_SIZE;
    hipLaunchKernelGGL(softmax_kernel<T>, dim3(rows), dim3(llmops::kBlock), 0, stream, out, x,
                       cols);
    return llmops::launch_status();
}

}  // namespace

extern "C" int llmops_softmax_f32(float* out, const float* x, int rows, int cols,
                                  hipStream_t stream) {
    return softmax(out, x, rows, cols, stream);
}

extern "C" int llmops_softmax_bf16(uint16_t* out, const uint16_t* x, int rows, int cols,
                                   hipStream_t stream) {
    return softmax(llmops::bf16(out), llmops::bf16(x), rows, cols, stream);
}
