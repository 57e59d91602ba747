#!/usr/bin/env bash
# Issue 20's before/after check on the GPUs: the one-engine redesign must change no result
# and no speed. Runs, from two packs carried in .carry/ (after: `./rd gpu-pack` of the
# redesign; before: the same of the last commit before it, fa93b30, renamed
# .carry/gpu_before.tar.xz), interleaved in one device session so both see the same GPUs:
#   tests   the GPU suite of the redesign (tools/gpu.sh run tests) and the multi-GPU suites
#   single  cuda_dilated_attention_bench's fixed-variant kAuto rows, before, after, before,
#           after (ABAB: a drift shows as a difference between the two runs of one side)
#   multi   cuda_multi_gpu_bench's strong rows at 4M (P = 1, 2, 4; causal per layout), ABAB
#   targets-single, targets-multi  the other open issues' GPU rows on one GPU and on several,
#           on the redesign's pack only
# Prints one table per bench: row, before ms (two runs), after ms (two runs), after/before.
# Logs and JSON go to $OUT (or build/issue20); SNAPSHOT=<path.tgz> packs them after each
# bench. Time: tests about 420 s on 4 H200s (the suites in parallel); single over 400 s on
# one H100 (it did not end within a 400 s call: run its halves in separate calls, e.g.
# BENCH_TIMEOUT=120); multi about 4 x 120 s. RUNS="1" (or "2") runs one before/after pair
# of single or multi, so that the two pairs fit two calls; `OUT=<folder of both calls' JSON>
# tools/gpu_issue20.sh compare <bench binary>` prints the table here, without a GPU.
#   tools/gpu_issue20.sh tests|single|multi|targets-single|targets-multi|compare BINARY
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
export NCCL_NVLS_ENABLE=0
LOGS="${OUT:-build/issue20}"
mkdir -p "$LOGS"
if [[ "${1:-}" != compare ]]; then
  mkdir -p .carry/after .carry/before
  tar -C .carry/after -xJf .carry/gpu.tar.xz
  tar -C .carry/before -xJf .carry/gpu_before.tar.xz
  nvidia-smi -L
fi

# snapshot: with SNAPSHOT set (a .tgz path under the device's $OUT), packs the logs so far
# there, so that a call cut short by its time limit still brings back what ran.
snapshot() {
  if [[ -n "${SNAPSHOT:-}" ]]; then tar -C "$LOGS" -czf "$SNAPSHOT" .; fi
}

# bench SIDE RUN BINARY FILTER: one run of a bench of one pack (at most BENCH_TIMEOUT
# seconds, default 280), its JSON kept; prints its rows as it ends (a call cut short shows
# how far it got) and snapshots the logs.
bench() {
  local side="$1" run="$2" binary="$3" filter="$4" started=$SECONDS
  LD_LIBRARY_PATH=".carry/$side/gpu/lib:${LD_LIBRARY_PATH:-}" timeout "${BENCH_TIMEOUT:-280}" \
    ".carry/$side/gpu/bin/$binary" --benchmark_filter="$filter" \
    --benchmark_out="$LOGS/$binary.$side.$run.json" --benchmark_out_format=json \
    >"$LOGS/$binary.$side.$run.txt" 2>&1 || echo "$binary ($side, run $run): exit $?"
  echo "== $binary $side run $run: $((SECONDS - started)) s"
  grep -E '^[a-z_]+/' "$LOGS/$binary.$side.$run.txt" | sed -E 's/ +/ /g' | cut -c1-120
  snapshot
}

# compare BINARY: per row, the median real time of each run, and after / before.
compare() {
  python3 - "$LOGS" "$1" <<'PY'
import json, os, re, statistics, sys
logs, binary = sys.argv[1], sys.argv[2]
def times(side, run):
    path = os.path.join(logs, f"{binary}.{side}.{run}.json")
    rows = {}
    try:
        for e in json.load(open(path)).get("benchmarks", []):
            if e.get("run_type") == "aggregate" or e.get("error_occurred"):
                continue
            rows.setdefault(e["run_name"].split("/iterations")[0], []).append(e["real_time"])
    except (OSError, ValueError):  # none, or cut short: the rows its text printed
        try:
            text = open(path[:-len(".json")] + ".txt").read()
        except OSError:
            return {}
        for name, ms in re.findall(r"^(\S+?)/iterations:\d+/manual_time\s+([\d.]+) ms", text, re.M):
            rows.setdefault(name, []).append(float(ms))
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

# The suites that need several GPUs run alone with every GPU; the others run in parallel,
# one binary per GPU at a time (each job takes the first free GPU's lock).
MULTI_GPU_SUITES='cuda_multi_gpu_test cuda_nccl_test train_multiprocess_test cuda_transfer_test'

# suite_job NAME: one single-GPU suite binary on the first free GPU (called by xargs).
suite_job() {
  local name="$1" gpu rc=0
  while :; do
    for gpu in $(seq 0 $(($(nvidia-smi -L | grep -c '^GPU ') - 1))); do
      exec 9>"/tmp/rd_gpu_lane.$gpu"
      if flock -n 9; then
        CUDA_VISIBLE_DEVICES="$gpu" tools/gpu.sh run-one "$name" "$LOGS" || rc=$?
        flock -u 9
        return "$rc"
      fi
    done
    sleep 1
  done
}
export -f suite_job

part_tests() {
  tar -C .carry -xJf .carry/gpu.tar.xz
  local names name
  names="$(cut -f1 .carry/gpu/suite.tsv)"
  export LOGS
  grep -vxF -f <(tr ' ' '\n' <<<"$MULTI_GPU_SUITES") <<<"$names" |
    xargs -P "$(nvidia-smi -L | grep -c '^GPU ')" -I{} bash -c 'suite_job {}'
  for name in $MULTI_GPU_SUITES; do
    tools/gpu.sh run-one "$name" "$LOGS"
  done
  grep -lE '^\[  FAILED  \]|exit [1-9]' "$LOGS"/*.log 2>/dev/null | sed 's/^/failed: /'
}

part_single() {
  local rows='dilated/fixed/fwdbwd/H16D128/N(32768|262144|1048576)/(dense|causal)/auto'
  for run in ${RUNS:-1 2}; do
    bench before "$run" cuda_dilated_attention_bench "$rows"
    bench after "$run" cuda_dilated_attention_bench "$rows"
  done
  compare cuda_dilated_attention_bench
}

part_multi() {
  local rows='strong.*/N4194304'
  # Lazy module loading, as the runs of docs/benchmarks.md (issue 19) set it: the bench's
  # default (every kernel loaded at start, cuDNN's too) made the first P = 2 row load them
  # on each new GPU, and it did not end within 280 s (4 x H200, 2026-11-26), before and
  # after alike.
  export CUDA_MODULE_LOADING=LAZY
  for run in ${RUNS:-1 2}; do
    bench before "$run" cuda_multi_gpu_bench "$rows"
    bench after "$run" cuda_multi_gpu_bench "$rows"
  done
  compare cuda_multi_gpu_bench
}

# The open issues' GPU targets on the redesign's pack only (no before/after). One GPU:
# issue 21's grouped-query and document-mask rows and decoding latency.
targets_single() {
  bench after targets cuda_dilated_attention_bench 'target/(gqa|documents)'
  bench after targets decode_bench 'cuda'
  tail -n 20 "$LOGS/decode_bench.after.targets.txt"
}

# Two or more GPUs: issue 19's NCCL thread-mode timeout and weak scaling.
targets_multi() {
  LD_LIBRARY_PATH=".carry/after/gpu/lib:${LD_LIBRARY_PATH:-}" timeout 200 \
    .carry/after/gpu/bin/cuda_nccl_test --gtest_filter='NcclGroup.*' >"$LOGS/nccl_group.log" 2>&1
  echo "cuda_nccl_test NcclGroup.*: exit $?"
  grep -E '^\[ +(OK|FAILED|SKIPPED) ' "$LOGS/nccl_group.log"
  CUDA_MODULE_LOADING=LAZY bench after weak cuda_multi_gpu_bench 'weak'
  snapshot
}

case "${1:-}" in
  tests) part_tests ;;
  single) part_single ;;
  multi) part_multi ;;
  targets-single) targets_single ;;
  compare) compare "$2" ;;
  targets-multi) targets_multi ;;
  *) echo "usage: tools/gpu_issue20.sh tests|single|multi|targets-single|targets-multi" >&2; exit 2 ;;
esac
