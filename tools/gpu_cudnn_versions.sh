#!/usr/bin/env bash
# Runs one bench's rows under the system cuDNN and under another cuDNN 9 (a directory holding
# libcudnn.so.9 and its sub-libraries, e.g. PyTorch's wheel), interleaved A B A B in one
# session, so that a cuDNN version's effect is measured against a same-run baseline.
#   tools/gpu_cudnn_versions.sh BENCH FILTER OTHER_CUDNN_DIR [RUNS]
# On the device machine, from the repository root, with the pack in .carry/gpu.
set -uo pipefail
bench=$1 filter=$2 other=$3 runs=${4:-2}
out=${OUT:-/tmp}/cudnn_versions
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 CUDA_MODULE_LOADING=LAZY
run_with() {  # label, extra library dir ("" for the system's), run number
  local label=$1 dir=$2 run=$3
  LD_LIBRARY_PATH="${dir:+$dir:}.carry/gpu/lib:${LD_LIBRARY_PATH:-}" \
    ".carry/gpu/bin/$bench" --benchmark_filter="$filter" \
    --benchmark_out="$out/$bench.$label.$run.json" --benchmark_out_format=json \
    >"$out/$bench.$label.$run.txt" 2>&1
  echo "== $label run $run (exit $?)"
  grep -E '^(target|gqa|dilated|documents)' "$out/$bench.$label.$run.txt" | cut -c1-200
}
for run in $(seq 1 "$runs"); do
  run_with system "" "$run"
  run_with other "$other" "$run"
done
