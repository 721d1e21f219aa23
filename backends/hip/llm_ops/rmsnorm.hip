// RMSNorm over the last dimension: one block per row.
#include "common.hpp"

namespace {

template <typename T>
__global__ void rmsnorm_kernel(T* out, const T* x, const T* weight, int cols, float eps) {
    const size_t row = (size_t)blockIdx.x * cols;
    float sum_squares = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const float v = llmops::load(x, row + c);
        sum_squares = fmaf(v, v, sum_squares);
    }
    sum_squares = llmops::block_reduce(sum_squares, llmops::Sum());
    const float inv_rms = 1.0f / sqrtf(sum_squares / cols + eps);
    for (int c = threadIdx.x; c < cols; c += blockDim.x)
        llmops::store(out, row + c,
                      llmops::load(x, row + c) * inv_rms * llmops::load(weight, c));
}

template <typename T>
int rmsnorm(T* out, const T* x, const T* weight, int rows, int cols, float eps,
            hipStream_t stream) {
    if (!out || !x || !weight) return LLMOPS_ERR_NULL_POINTER;
    if (rows <= 0 || cols <= 0) return LLMOPS_ERR_NONPOSITIVE_SIZE;
    if (!(eps >= 0.0f) || std::isinf(eps)) return LLMOPS_ERR_INVALID_ARGUMENT;
    hipLaunchKernelGGL(rmsnorm_kernel<T>, dim3(rows), dim3(llmops::kBlock), 0, stream, out, x,
                       weight, cols, eps);
    return llmops::launch_status();
}

}  // namespace

extern "C" int llmops_rmsnorm_f32(float* out, const float* x, const float* weight, int rows,
                                  int cols, float eps, hipStream_t stream) {
    return rmsnorm(out, x, weight, rows, cols, eps, stream);
}

extern "C" int llmops_rmsnorm_bf16(uint16_t* out, const uint16_t* x, const uint16_t* weight,
                                   int rows, int cols, float eps, hipStream_t stream) {
    return rmsnorm(llmops::bf16(out), llmops::bf16(x), llmops::bf16(weight), rows, cols, eps,
                   stream);
}
