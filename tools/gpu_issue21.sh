#!/usr/bin/env bash
# Issue 21's grouped-query rows on one GPU, repeated: each run of
# cuda_dilated_attention_bench measures the grouped call and the H_kv = 16 call in the same
# row; RUNS runs (default 5) give the spread of the ratio, summarized per row (median, min,
# max). On the device machine, from the repository root, with the pack in .carry/gpu.
#   tools/gpu_issue21.sh [RUNS] [FILTER]
set -uo pipefail
runs=${1:-5} filter=${2:-'target/gqa|gqa/'}
out=${OUT:-/tmp}/issue21
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 CUDA_MODULE_LOADING=LAZY LD_LIBRARY_PATH=".carry/gpu/lib:${LD_LIBRARY_PATH:-}"
nvidia-smi -L
for run in $(seq 1 "$runs"); do
  .carry/gpu/bin/cuda_dilated_attention_bench --benchmark_filter="$filter" \
    --benchmark_out="$out/gqa.$run.json" --benchmark_out_format=json >"$out/gqa.$run.txt" 2>&1
  echo "run $run: exit $?"
done
python3 - "$out" <<'PY'
import glob, json, statistics, sys
rows = {}
for path in sorted(glob.glob(sys.argv[1] + "/gqa.*.json")):
    for b in json.load(open(path))["benchmarks"]:
        if "ratio" in b:
            rows.setdefault(b["name"].split("/iterations")[0], []).append(
                (b["ratio"], b["real_time"], b.get("full_heads_s", 0) * 1e3))
for name, values in rows.items():
    ratios = [v[0] for v in values]
    print(f"{name}: ratio median {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f}, {len(ratios)} runs); "
          f"grouped {statistics.median(v[1] for v in values):.2f} ms, "
          f"H_kv = 16 {statistics.median(v[2] for v in values):.2f} ms")
PY
