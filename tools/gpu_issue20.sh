#!/usr/bin/env bash
# Issue 20's before/after check on the GPUs: the one-engine redesign must change no result
# and no speed. Runs, from two packs carried in .carry/ (after: `./rd gpu-pack` of the
# redesign; before: the same of the last commit before it, fa93b30, renamed
# .carry/gpu_before.tar.xz), interleaved in one device session so both see the same GPUs:
#   tests   the GPU suite of the redesign (tools/gpu.sh run tests) and the multi-GPU suites
#   single  cuda_dilated_attention_bench's fixed-variant kAuto rows, before, after, before,
#           after (ABAB: a drift shows as a difference between the two runs of one side)
#   multi   cuda_multi_gpu_bench's strong rows at 4M (P = 1, 2, 4; causal per layout), ABAB
#   targets the other open issues' GPU rows, on the redesign's pack only (part_targets)
# Prints one table per bench: row, before ms (two runs), after ms (two runs), after/before.
# Logs and JSON go to $OUT (or build/issue20).
#   tools/gpu_issue20.sh tests|single|multi|targets
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
export NCCL_NVLS_ENABLE=0
LOGS="${OUT:-build/issue20}"
mkdir -p "$LOGS" .carry/after .carry/before
tar -C .carry/after -xJf .carry/gpu.tar.xz
tar -C .carry/before -xJf .carry/gpu_before.tar.xz
nvidia-smi -L

# bench SIDE RUN BINARY FILTER: one run of a bench of one pack, its JSON kept.
bench() {
  local side="$1" run="$2" binary="$3" filter="$4"
  LD_LIBRARY_PATH=".carry/$side/gpu/lib:${LD_LIBRARY_PATH:-}" timeout 280 \
    ".carry/$side/gpu/bin/$binary" --benchmark_filter="$filter" \
    --benchmark_out="$LOGS/$binary.$side.$run.json" --benchmark_out_format=json \
    >"$LOGS/$binary.$side.$run.txt" 2>&1 || echo "$binary ($side, run $run): exit $?"
}

# compare BINARY: per row, the median real time of each run, and after / before.
compare() {
  python3 - "$LOGS" "$1" <<'PY'
import json, os, statistics, sys
logs, binary = sys.argv[1], sys.argv[2]
def times(side, run):
    path = os.path.join(logs, f"{binary}.{side}.{run}.json")
    if not os.path.exists(path):
        return {}
    rows = {}
    for e in json.load(open(path)).get("benchmarks", []):
        if e.get("run_type") == "aggregate" or e.get("error_occurred"):
            continue
        rows.setdefault(e["run_name"].split("/iterations")[0], []).append(e["real_time"])
    return {k: statistics.median(v) for k, v in rows.items()}
runs = {(s, r): times(s, r) for s in ("before", "after") for r in (1, 2)}
names = sorted(set().union(*[set(t) for t in runs.values()]))
print(f"{'row':64} {'before ms':>17} {'after ms':>17} {'after/before':>12}")
for name in names:
    b = [runs["before", r].get(name) for r in (1, 2)]
    a = [runs["after", r].get(name) for r in (1, 2)]
    fmt = lambda v: " / ".join("-" if x is None else f"{x:.2f}" for x in v)
    bs, as_ = [x for x in b if x], [x for x in a if x]
    ratio = f"{statistics.mean(as_) / statistics.mean(bs):.3f}" if bs and as_ else "-"
    print(f"{name[:64]:64} {fmt(b):>17} {fmt(a):>17} {ratio:>12}")
PY
}

part_tests() {
  tools/gpu.sh run tests
  local bin=.carry/after/gpu/bin
  LD_LIBRARY_PATH=".carry/after/gpu/lib:${LD_LIBRARY_PATH:-}" timeout 300 \
    "$bin/cuda_multi_gpu_test" --gtest_brief=1 >"$LOGS/cuda_multi_gpu_test.log" 2>&1
  echo "cuda_multi_gpu_test: exit $?"
  grep -E '^\[  (PASSED|FAILED) ' "$LOGS/cuda_multi_gpu_test.log" | tail -n 12
}

part_single() {
  local rows='dilated/fixed/fwdbwd/H16D128/N(32768|262144|1048576)/(dense|causal)/auto'
  for run in 1 2; do
    bench before "$run" cuda_dilated_attention_bench "$rows"
    bench after "$run" cuda_dilated_attention_bench "$rows"
  done
  compare cuda_dilated_attention_bench
}

part_multi() {
  local rows='strong.*/N4194304'
  for run in 1 2; do
    bench before "$run" cuda_multi_gpu_bench "$rows"
    bench after "$run" cuda_multi_gpu_bench "$rows"
  done
  compare cuda_multi_gpu_bench
}

# The open issues' GPU targets on the redesign's pack only (no before/after): issue 21's
# grouped-query and document-mask rows and decoding latency; issue 19's weak scaling and the
# NCCL thread-mode timeout (2 or more GPUs).
part_targets() {
  local bin=.carry/after/gpu/bin
  export LD_LIBRARY_PATH=".carry/after/gpu/lib:${LD_LIBRARY_PATH:-}"
  bench after 1 cuda_dilated_attention_bench 'target/(gqa|documents)'
  grep -E '^target' "$LOGS/cuda_dilated_attention_bench.after.1.txt"
  bench after 1 decode_bench 'cuda'
  tail -n 20 "$LOGS/decode_bench.after.1.txt"
  timeout 200 "$bin/cuda_nccl_test" --gtest_filter='NcclGroup.*' >"$LOGS/nccl_group.log" 2>&1
  echo "cuda_nccl_test NcclGroup.*: exit $?"
  grep -E '^\[ +(OK|FAILED|SKIPPED) ' "$LOGS/nccl_group.log"
  bench after 1 cuda_multi_gpu_bench 'weak'
  grep -E '^weak' "$LOGS/cuda_multi_gpu_bench.after.1.txt"
}

case "${1:-}" in
  tests) part_tests ;;
  single) part_single ;;
  multi) part_multi ;;
  targets) part_targets ;;
  *) echo "usage: tools/gpu_issue20.sh tests|single|multi|targets" >&2; exit 2 ;;
esac
