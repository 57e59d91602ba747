#!/bin/sh
# runtime_deps_test.sh PROGRAM...: fails when a program links a CUDA library (the runtime,
# cuBLAS/cuBLASLt, cuDNN, NCCL, NVRTC, the driver), directly or through another library. A
# CUDA build links the runtime statically and opens the others on first use, so that every
# program starts, and runs on the CPU, where they are not installed. Exits 77 (ctest:
# skipped) where ldd is missing.
set -eu
if ! command -v ldd >/dev/null 2>&1; then
  echo "runtime_deps_test: SKIPPED: no ldd"
  exit 77
fi
[ "$#" -gt 0 ] || { echo "runtime_deps_test: FAILED: no program given" >&2; exit 1; }

failed=0
for program in "$@"; do
  if [ ! -x "$program" ]; then
    echo "runtime_deps_test: FAILED: $program is not an executable" >&2
    failed=1
    continue
  fi
  # ldd lists every library the loader would map, "name => path" or "name (address)";
  # a missing one reads "name => not found", and still counts.
  cuda_libraries="$(ldd "$program" | awk '{print $1}' |
    grep -E '^lib(cudart|cublas|cublasLt|cudnn[a-z_]*|nccl|nvrtc|cuda)\.so' || true)"
  if [ -n "$cuda_libraries" ]; then
    echo "runtime_deps_test: FAILED: $program links" $cuda_libraries >&2
    failed=1
  fi
done
[ "$failed" -eq 0 ] && echo "runtime_deps_test: $# programs link no CUDA library"
exit "$failed"
