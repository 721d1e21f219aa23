#!/usr/bin/env bash
# Build the llm_ops CUDA backend: ./build.sh <output-dir> [<compute-capability>]
# Without a compute capability: one fat library with SASS for sm_80, sm_89 and
# sm_90 plus compute_90 PTX, which newer GPUs JIT-compile. With one (e.g. 89
# or 90a): code for that architecture only, for fast development builds.
# Writes <output-dir>/libllmops_cuda.so; set NVCC to use another nvcc.
set -euo pipefail

if [ $# -lt 1 ] || [ $# -gt 2 ]; then
  echo "usage: $0 <output-dir> [<compute-capability>]" >&2
  exit 2
fi
if [ $# -ge 2 ]; then
  targets=(-gencode "arch=compute_$2,code=sm_$2")
else
  targets=(-gencode arch=compute_80,code=sm_80
           -gencode arch=compute_89,code=sm_89
           -gencode "arch=compute_90,code=[sm_90,compute_90]")
fi
mkdir -p "$1"
out_dir=$(cd "$1" && pwd)
cd "$(dirname "$0")"

# Hidden visibility keeps the statically linked CUDA runtime out of the
# library's dynamic symbols: only the llmops_ ABI is exported.
"${NVCC:-nvcc}" -std=c++17 -O3 -shared --threads 2 \
  -Xcompiler -fPIC,-fvisibility=hidden,-Wall,-Wextra -Xlinker --exclude-libs,ALL \
  "${targets[@]}" -o "$out_dir/libllmops_cuda.so" \
  errors.cu rmsnorm.cu silu_mul.cu rope.cu softmax.cu
