#!/usr/bin/env bash
# A change's effect on one device machine, old binaries against new in the same call: the
# pack's (new) cuda_dilated_attention_bench and rd_train against .carry/bench_old.xz and
# .carry/rd_train_old.xz (xz-compressed binaries of the baseline build, carried beside the
# pack). From the repository root, with .carry/gpu.tar.xz:
#   tools/gpu_before_after.sh bench FILTER [RUNS]  bench rows, old then new, RUNS times (A B A B)
#   tools/gpu_before_after.sh train                tools/gpu_issue19.sh docs_train, old then new
#                                                  (CP2_ONLY=1: context parallel 2 only)
#   tools/gpu_before_after.sh reference [ARGS...]  rd_train on train/configs/gpu_reference.flags
#                                                  (head groups), STEPS (40) steps, RUNS (2) times
#                                                  A B on one GPU;
#                                                  ARGS are added rd_train flags
#   tools/gpu_before_after.sh trace GPUS ARGS...   the new rd_train under the CUPTI tracer
# With OLD_ENV set (e.g. OLD_ENV=RD_ATTENTION_PATH=flash), the old side is the pack's own
# binary run under that environment: a runtime switch's A/B needs no second build.
# Logs and JSON go to $OUT (or build/before_after).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source tools/device_env.sh
LOGS="${OUT:-build/before_after}"
mkdir -p "$LOGS" .carry/old
for name in bench rd_train; do
  [[ -f .carry/${name}_old.xz && ! -x .carry/old/$name ]] &&
    xz -dc ".carry/${name}_old.xz" >".carry/old/$name" && chmod +x ".carry/old/$name"
done

# Runs a side's command: the old side under OLD_ENV where it is set.
run_side() {
  local side="$1"
  shift
  if [[ $side == old && -n ${OLD_ENV:-} ]]; then env ${OLD_ENV} "$@"; else "$@"; fi
}

# The binary `name` of the pack ($BIN) runs a side, or the old build's (.carry/old/OLD_NAME)
# for the old side without OLD_ENV.
side_binary() {
  local side="$1" name="$2" old_name="$3"
  if [[ $side == old && -z ${OLD_ENV:-} ]]; then echo ".carry/old/$old_name"; else echo "$BIN/$name"; fi
}

part_bench() {
  local filter="$1" runs="${2:-2}"
  for run in $(seq 1 "$runs"); do
    for side in old new; do
      local bin
      bin=$(side_binary "$side" cuda_dilated_attention_bench bench)
      run_side "$side" timeout 400 "$bin" --benchmark_filter="$filter" --benchmark_out="$LOGS/$side.$run.json" \
        --benchmark_out_format=json >"$LOGS/$side.$run.txt" 2>&1 || echo "bench $side $run: exit $?"
    done
  done
  python3 - "$LOGS" <<'PY'
import glob, json, statistics, sys
rows = {}
for path in sorted(glob.glob(sys.argv[1] + "/*.*.json")):
    side = path.split("/")[-1].split(".")[0]
    for b in json.load(open(path))["benchmarks"]:
        rows.setdefault(b["name"].split("/iterations")[0], {}).setdefault(side, []).append(
            (b["real_time"], b.get("ratio")))
for name, sides in rows.items():
    cells = []
    for side in ("old", "new"):
        values = sides.get(side, [])
        if values:
            ms = statistics.median(v[0] for v in values)
            ratio = [v[1] for v in values if v[1] is not None]
            cells.append(f"{side} {ms:.2f} ms" + (f" (ratio {statistics.median(ratio):.3f})" if ratio else ""))
    print(f"{name}: " + ", ".join(cells))
PY
}

# The runs write checkpoints: they go to a scratch folder, and only their logs and metrics
# come back, in $LOGS/train.tgz (one file: the device tool returns few).
part_train() {
  local scratch=/tmp/before_after_train
  OUT=$scratch STEPS="${STEPS:-20}" RD_TRAIN="$PWD/.carry/old/rd_train" TAG=old- \
    bash tools/gpu_issue19.sh docs_train
  OUT=$scratch STEPS="${STEPS:-20}" TAG=new- bash tools/gpu_issue19.sh docs_train
  tar -C "$scratch" -czf "$LOGS/train.tgz" --exclude=checkpoints . 2>/dev/null
  for log in "$scratch"/train-*.txt; do
    local name
    name=$(basename "$log" .txt)
    grep -q 'step [0-9]*/' "$log" || { echo "== $name: no step line; its end:"; tail -n 5 "$log"; }
  done
}

# tokens/s per side from rd_train's step lines, steps 1-10 (where new graphs are built) and
# 11 on, and each run's line on cuDNN's graphs.
summarize_steps() {
  python3 - "$LOGS" <<'PY'
import glob, re, statistics, sys
for side in ("old", "new"):
    rates = {"steps 1-10": [], "steps 11+": []}
    for path in sorted(glob.glob(f"{sys.argv[1]}/reference-{side}.*.txt")):
        for line in open(path, errors="replace").read().replace("\r", "\n").splitlines():
            m = re.match(r"step (\d+)/\d+.*\| ([\d.]+)([kM]?) tok/s", line)
            if m:
                rate = float(m.group(2)) * {"k": 1e3, "M": 1e6, "": 1}[m.group(3)]
                rates["steps 1-10" if int(m.group(1)) <= 10 else "steps 11+"].append(rate)
            if line.startswith("cuDNN attention graphs"):
                print(f"{side} {path.split('/')[-1]}: {line}")
    for span, values in rates.items():
        if values:
            print(f"{side} {span}: {statistics.median(values) / 1e3:.1f}k tok/s, median of "
                  f"{len(values)} (min {min(values) / 1e3:.1f}k, max {max(values) / 1e3:.1f}k)")
PY
}

part_reference() {
  for run in $(seq 1 "${RUNS:-2}"); do
    for side in old new; do
      local bin
      bin=$(side_binary "$side" rd_train rd_train)
      run_side "$side" timeout 200 "$bin" --flagfile=train/configs/gpu_reference.flags --steps="${STEPS:-40}" --warmup_steps=2 \
        --log_every=1 --final_eval_batches=1 --out_dir="/tmp/reference-$side-$run" --resume= "$@" \
        >"$LOGS/reference-$side.$run.txt" 2>&1 || echo "reference $side $run: exit $?"
    done
  done
  summarize_steps
}

part_trace() {
  local gpus="$1"
  shift
  local cmd=("$BIN/rd_train" "$@")
  ((gpus > 1)) && cmd=("$BIN/rd_launch" -n "$gpus" -- "${cmd[@]}")
  CUDA_INJECTION64_PATH="$BIN/librd_cupti_trace.so" RD_CUPTI_TRACE="$LOGS/trace.csv" \
    timeout 300 "${cmd[@]}" >"$LOGS/trace-train.txt" 2>&1 || echo "trace: exit $?"
  python3 tools/kernel_profile.py "$LOGS/trace.csv.rank0" --steps 3 >"$LOGS/trace-rank0.md" 2>&1 ||
    python3 tools/kernel_profile.py "$LOGS/trace.csv" --steps 3 >"$LOGS/trace-rank0.md" 2>&1
  head -45 "$LOGS/trace-rank0.md"
  rm -f "$LOGS"/trace.csv*
}

case "${1:-}" in
  bench) shift; part_bench "$@" ;;
  train) part_train ;;
  reference) shift; part_reference "$@" ;;
  trace) shift; part_trace "$@" ;;
  *) echo "usage: tools/gpu_before_after.sh bench FILTER [RUNS] | train | reference [ARGS...] | trace GPUS ARGS..." >&2; exit 2 ;;
esac
