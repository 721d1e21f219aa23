#!/usr/bin/env bash
# Build the llm_ops CPU backend: ./build.sh <output-dir> [<march>]
# Objects go to <output-dir>/obj/ through an incremental make; the shared
# library is <output-dir>/libllmops_cpu.so. <march> is a gcc -march value
# (default x86-64, the baseline every x86-64 machine runs).
set -euo pipefail

if [ $# -lt 1 ] || [ $# -gt 2 ]; then
  echo "usage: $0 <output-dir> [<march>]" >&2
  exit 2
fi
march=${2:-x86-64}
mkdir -p "$1"
out_dir=$(cd "$1" && pwd)
src_dir=$(cd "$(dirname "$0")" && pwd)

make --no-print-directory -C "$src_dir" -j2 OBJ_DIR="$out_dir/obj" MARCH="$march" objects
"${CC:-cc}" -shared -fPIC -march="$march" -o "$out_dir/libllmops_cpu.so" \
  "$out_dir"/obj/errors.o "$out_dir"/obj/rmsnorm.o "$out_dir"/obj/silu_mul.o \
  "$out_dir"/obj/rope.o "$out_dir"/obj/softmax.o -lm
