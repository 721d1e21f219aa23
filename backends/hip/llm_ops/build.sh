#!/usr/bin/env bash
# Build the llm_ops HIP backend: ./build.sh <output-dir> [<gfx-target>]
# Without a target: one fat library with code objects for gfx90a (MI200),
# gfx940 (MI300) and gfx1030 (RDNA2). With one (e.g. gfx90a, or with its
# features, gfx90a:xnack+): that target only, for fast development builds.
# Writes <output-dir>/libllmops_hip.so; set HIPCC to use another hipcc.
set -euo pipefail

if [ $# -lt 1 ] || [ $# -gt 2 ]; then
  echo "usage: $0 <output-dir> [<gfx-target>]" >&2
  exit 2
fi
if [ $# -ge 2 ]; then
  targets=(--offload-arch="$2")
else
  targets=(--offload-arch=gfx90a --offload-arch=gfx940 --offload-arch=gfx1030)
fi
mkdir -p "$1"
out_dir=$(cd "$1" && pwd)
cd "$(dirname "$0")"

# AMD's compiler, not nvcc: hipcc picks the NVIDIA platform where it finds CUDA.
# Hidden visibility keeps the C++ runtime's names out of the exports; the
# kernels are in anonymous namespaces, which is what hides their host-side
# handles under hipcc (the visibility does not).
HIP_PLATFORM=amd "${HIPCC:-hipcc}" -std=c++17 -O3 -shared -fPIC -fvisibility=hidden \
  -Wall -Wextra "${targets[@]}" -o "$out_dir/libllmops_hip.so" \
  errors.hip rmsnorm.hip silu_mul.hip rope.hip softmax.hip
