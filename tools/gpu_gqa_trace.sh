#!/usr/bin/env bash
# Where a grouped-query fwd+bwd spends GPU time that the full-heads call does not: each side
# of issue 21's target row alone (gqa/fwdbwd_alone/.../KV<16|4|1>) under the CUPTI tracer,
# summarized per call by tools/trace_per_call.py: $OUT/trace_kv<n>.md over every call (the
# warm-up's graph builds included), $OUT/steady_kv<n>.md over the timed repetitions only.
# RD_CUPTI_API=1 adds the host's CUDA calls; TIMELINE_MS=22 prints the last call in order.
# On the device machine, from the repository root, with the pack in .carry/gpu.tar.xz.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source tools/device_env.sh
LOGS="${OUT:-build/gqa_trace}"
mkdir -p "$LOGS"
for kv in ${KV_HEADS:-16 4 1}; do
  CUDA_INJECTION64_PATH="$BIN/librd_cupti_trace.so" RD_CUPTI_TRACE="/tmp/gqa_trace_$kv.csv" \
    timeout 300 "$BIN/cuda_dilated_attention_bench" --benchmark_filter="gqa/fwdbwd_alone/.*/KV$kv/" \
    --benchmark_out="$LOGS/alone_kv$kv.json" --benchmark_out_format=json >"$LOGS/alone_kv$kv.txt" 2>&1 ||
    echo "trace kv $kv: exit $?"
  calls=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['benchmarks'][0]['calls_run'])" \
    "$LOGS/alone_kv$kv.json")
  python3 tools/trace_per_call.py "/tmp/gqa_trace_$kv.csv" "$calls" --top 40 >"$LOGS/trace_kv$kv.md"
  # The steady state: the last three bursts (the benchmark's timed repetitions of 2 calls).
  python3 tools/trace_per_call.py "/tmp/gqa_trace_$kv.csv" 6 --last_bursts 3 --top 40 \
    --timeline_ms "${TIMELINE_MS:-0}" >"$LOGS/steady_kv$kv.md"
  head -25 "$LOGS/trace_kv$kv.md"
  rm -f "/tmp/gqa_trace_$kv.csv"
done
