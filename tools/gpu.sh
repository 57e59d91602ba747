#!/usr/bin/env bash
# The GPU suite on a lent GPU machine: `targets` and `pack` on the build machine (./rd gpu-pack
# builds, then packs), `run [--dry-run] [phase]` on the GPU machine (./rd gpu-run).
#
# The GPU machine has the CUDA runtime, cuBLASLt, cuDNN and NCCL but not our Debian
# dependencies (Abseil, OpenBLAS, Gloo). So the suite is built with the release preset and
# packed, stripped and with the libraries the GPU machine lacks, into .carry/gpu.tar.xz
# (git-ignored; tools/gpu_issue19.sh and tools/gpu_diag_hang.sh use the same pack). Which
# test binaries make the suite, and their arguments, is stated once, in tests/CMakeLists.txt
# (ctest label gpu_suite); the pack carries that list as gpu/suite.tsv, since the GPU machine
# has no CMake build to ask.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

BUILD=build/release
PACK_DIR=.carry/gpu
PACK=.carry/gpu.tar.xz
# One line per suite binary: name, timeout in seconds, then its gtest arguments; tab-separated.
SUITE="$PACK_DIR/suite.tsv"

log() { printf '[rd] %s\n' "$*"; }
die() {
  printf '[rd] error: %s\n' "$*" >&2
  exit 1
}

usage() {
  cat <<'EOF'
Usage: tools/gpu.sh <command> [args]   (./rd gpu-pack and ./rd gpu-run call it)

  targets          (build machine) the build targets of the pack, one a line: the suite
                   (ctest -L gpu_suite in build/release, configured), the CUDA benches,
                   rd_train, rd_launch and the CUPTI tracer; RD_PACK_ONLY="name ..." instead.
  pack [target...] (build machine) pack the built targets (default: `targets`) of
                   build/release into .carry/gpu.tar.xz. ./rd gpu-pack builds them first.
  run [--dry-run] [phase [part]]
                   (GPU machine) unpack .carry/gpu.tar.xz and run phase tests (the suite),
                   memcheck (the suite under compute-sanitizer), bench (the benches and
                   their markdown report), all (default: the three; logs $OUT/gpu-logs.tgz),
                   multi [tests|bench|torch|all] (several GPUs; $OUT/gpu-multi-<part>.tgz) or
                   profile (rd_train's reference model traced by kernel at RD_PROFILE_SEQ
                   tokens, default 65536; $OUT/gpu-profile.tgz). --dry-run prints the
                   commands instead of running them (no GPU needed).
EOF
}

# --- the suite, from CTest -----------------------------------------------------------------

# The suite as registered in tests/CMakeLists.txt, in the format of $SUITE, sorted by name:
# each gpu_suite test runs one binary (its name) with its arguments under its TIMEOUT.
suite_from_ctest() {
  [[ -f "$BUILD/CTestTestfile.cmake" ]] || die "$BUILD is not configured: cmake --preset release"
  ctest --test-dir "$BUILD" --show-only=json-v1 -L '^gpu_suite$' | python3 -c '
import json, os, sys

rows = []
for test in json.load(sys.stdin)["tests"]:
    properties = {p["name"]: p["value"] for p in test.get("properties", [])}
    program, *args = test["command"]
    rows.append([os.path.basename(program), str(int(properties["TIMEOUT"]))] + args)
if not rows:
    sys.exit("no test labelled gpu_suite (a build without tests?)")
for row in sorted(rows):
    print("\t".join(row))
'
}

# --- targets and pack (build machine) --------------------------------------------------------

cmd_targets() {
  if [[ -n "${RD_PACK_ONLY:-}" ]]; then
    # A smaller pack, packed sooner (tools/gpu_issue19.sh runs its own selection).
    local only
    read -r -a only <<<"$RD_PACK_ONLY"
    printf '%s\n' "${only[@]}"
    return
  fi
  suite_from_ctest | cut -f1
  local source
  for source in bench/cuda_*_bench.cc; do
    [[ -f "$source" ]] && basename "${source%.cc}"
  done
  # Decoding steps against recomputation, with rows on every visible device (issue 21's
  # latency targets are the GPU rows).
  printf '%s
' decode_bench
  # The trainer (training runs on the GPU: MFU, longest sequence; docs/benchmarks.md) and its
  # launcher, which train_multiprocess_test also starts; the CUPTI kernel tracer behind
  # `run profile` (the GPU machine has no Nsight) and the host's sampling profiler (no perf).
  printf '%s\n' rd_train_cli rd_launch rd_cupti_trace rd_host_sampler
}

# Strips the built programs among TARGETS into $PACK_DIR/bin, with the scripts the run uses.
pack_programs() {
  local name binary
  for name in "$@"; do
    for binary in "$BUILD/tests/$name" "$BUILD/bench/$name"; do
      [[ -x "$binary" ]] && strip -o "$PACK_DIR/bin/$name" "$binary"
    done
  done
  strip -o "$PACK_DIR/bin/rd_train" "$BUILD/train/rd_train"
  strip -o "$PACK_DIR/bin/rd_launch" "$BUILD/train/rd_launch"
  cp bench/report.py "$PACK_DIR/bin/" 2>/dev/null || true
  local tool
  for tool in librd_cupti_trace.so librd_host_sampler.so; do
    if [[ -f "$BUILD/tools/$tool" ]]; then strip -o "$PACK_DIR/bin/$tool" "$BUILD/tools/$tool"; fi
  done
}

# Carries what a packed program links beyond the C/C++ runtime, the driver and the CUDA
# toolkit, all of which the GPU machine has.
pack_libraries() {
  local binary name path
  for binary in "$PACK_DIR"/bin/*_test "$PACK_DIR"/bin/*_bench "$PACK_DIR"/bin/rd_* \
    "$PACK_DIR"/bin/*.so; do
    [[ -e "$binary" ]] || continue
    while read -r name path; do
      [[ "$name" =~ ^lib(absl_|gomp|openblas|gfortran|quadmath|benchmark|gloo|hiredis|ibverbs|nl-|cupti) ]] || continue
      cp -L -n "$path" "$PACK_DIR/lib/$name"
    done < <(ldd "$binary" | awk '$3 ~ /^\// {print $1, $3}')
  done
}

# Writes $SUITE: the suite's lines whose binary is packed (all of them unless RD_PACK_ONLY).
pack_suite_list() {
  local suite name line
  suite="$(suite_from_ctest)"
  while IFS= read -r line; do
    [[ -x "$PACK_DIR/bin/${line%%$'\t'*}" ]] && printf '%s\n' "$line"
  done <<<"$suite" >"$SUITE"
  for name in "$PACK_DIR"/bin/*_test; do
    [[ -e "$name" ]] || continue
    grep -q "^$(basename "$name")"$'\t' "$SUITE" ||
      log "$(basename "$name") is packed but not in the suite (tests/CMakeLists.txt): run ignores it"
  done
}

cmd_pack() {
  local targets=("$@")
  if ((${#targets[@]} == 0)); then
    local listed
    listed="$(cmd_targets)"
    mapfile -t targets <<<"$listed"
  fi
  rm -rf "$PACK_DIR"
  mkdir -p "$PACK_DIR/bin" "$PACK_DIR/lib"
  pack_programs "${targets[@]}"
  pack_libraries
  pack_suite_list
  # The test binaries share most of their bytes (the ~40 MB of kernels each links), which
  # compress to about one copy when the dictionary spans several binaries and the stream is
  # one block: 1 GB -> 26 MB, leaving room for the tree (~5 MB) under the 64 MiB carry limit
  # (xz -9 -T2 cut it into blocks that each kept a copy: 60 MB). Single-threaded: ~9 minutes.
  tar -C .carry -cf - gpu | xz -T1 --lzma2=preset=9,dict=192MiB >"$PACK"
  rm -rf "$PACK_DIR"
  log "packed $(du -h "$PACK" | cut -f1) into $PACK; carry .carry and run ./rd gpu-run there"
}

# --- run (GPU machine) -----------------------------------------------------------------------

DRY_RUN=0
declare -A SUITE_ARGS SUITE_TIMEOUT
SUITE_NAMES=()
COMMAND=()
LOGS=

# x CMD...: runs CMD; under --dry-run prints it on fd 3 (the terminal, wherever the caller
# sends CMD's output) and succeeds.
x() {
  if ((DRY_RUN)); then
    {
      printf '+'
      printf ' %q' "$@"
      printf '\n'
    } >&3
    return 0
  fi
  "$@"
}

# new_logs: sets LOGS to a fresh folder for a phase's logs; a dry run leaves none behind.
new_logs() {
  LOGS="$(mktemp -d)"
  if ((DRY_RUN)); then trap 'rm -rf "$LOGS"' EXIT; fi
}

# Unpacks the pack, reads its suite list and sets the environment its programs need: the
# carried libraries, the programs the multi-process tests start, NCCL without NVLink
# multicast.
unpack_suite() {
  [[ -f "$PACK" ]] || die "no $PACK: run ./rd gpu-pack first and carry .carry"
  tar -C .carry -xJf "$PACK"
  read_suite
}

# Reads the unpacked pack's suite list and sets the environment (see unpack_suite).
read_suite() {
  [[ -f "$SUITE" ]] || die "$PACK has no suite list: pack it again with ./rd gpu-pack"
  local name timeout args
  while IFS=$'\t' read -r name timeout args; do
    SUITE_NAMES+=("$name")
    SUITE_TIMEOUT[$name]="$timeout"
    SUITE_ARGS[$name]="$args"
  done <"$SUITE"
  export LD_LIBRARY_PATH="$ROOT/$PACK_DIR/lib:${LD_LIBRARY_PATH:-}"
  export RD_TRAIN="$ROOT/$PACK_DIR/bin/rd_train" RD_LAUNCH="$ROOT/$PACK_DIR/bin/rd_launch"
  export NCCL_NVLS_ENABLE=0
}

# suite_command NAME: sets COMMAND to the suite binary NAME with its gtest arguments; fails
# when the pack lacks it (RD_PACK_ONLY).
suite_command() {
  if [[ -z "${SUITE_TIMEOUT[$1]:-}" ]]; then
    log "$1: not in the pack"
    return 127
  fi
  local args
  IFS=$'\t' read -r -a args <<<"${SUITE_ARGS[$1]}"
  COMMAND=("$PACK_DIR/bin/$1" "${args[@]}")
}

# run_gpu_test NAME LOGS SECONDS: the suite binary NAME under a timeout, logging to
# LOGS/NAME.log and printing its summary; returns its status.
run_gpu_test() {
  local name="$1" logs="$2" limit="$3" rc=0
  suite_command "$name" || return
  x timeout "$limit" "${COMMAND[@]}" >"$logs/$name.log" 2>&1 || rc=$?
  log "$name: exit $rc"
  grep -E 'PASSED|FAILED|SKIPPED|resumed vs' "$logs/$name.log" | tail -n 12 || true
  return "$rc"
}

# run_memcheck NAME LOGS: the same under compute-sanitizer memcheck. API errors are expected
# (the out-of-memory tests); memory errors are not.
run_memcheck() {
  local name="$1" logs="$2" rc=0
  suite_command "$name" || return
  x timeout "${SUITE_TIMEOUT[$name]}" compute-sanitizer --tool memcheck --report-api-errors no \
    --error-exitcode 9 "${COMMAND[@]}" >"$logs/$name.memcheck.log" 2>&1 || rc=$?
  log "$name under memcheck: exit $rc"
  grep -E 'ERROR SUMMARY|FAILED' "$logs/$name.memcheck.log" | tail -n 8 || true
  return "$rc"
}

# Runs every packed bench, then bench/report.py's markdown report of their JSON.
run_benches() {
  local logs="$1" binary name extra
  read -r -a extra <<<"${RD_BENCH_ARGS:-}"
  for binary in "$PACK_DIR"/bin/*_bench; do
    [[ -x "$binary" ]] || continue
    name="$(basename "$binary")"
    # One repetition: Google Benchmark 1.7 aborts when repetitions of a manually timed
    # row settle on different iteration counts.
    x "$binary" --benchmark_min_time=0.3 --benchmark_out="$logs/$name.json" \
      --benchmark_out_format=json "${extra[@]}" >"$logs/$name.txt" 2>&1 || true
    tail -n 5 "$logs/$name.txt"
  done
  if compgen -G "$logs/*.json" >/dev/null; then
    python3 "$PACK_DIR/bin/report.py" "$logs"/*.json >"$logs/report.md" 2>&1 || true
    cat "$logs/report.md"
  fi
}

# Phases tests, memcheck and bench of one GPU ("all": the three); each suite binary runs
# plainly, then under memcheck (where compute-sanitizer is installed).
run_single() {
  local phase="$1" logs name passed=0 failed=0
  new_logs
  logs="$LOGS"
  x nvidia-smi -L
  for name in "${SUITE_NAMES[@]}"; do
    if [[ "$phase" == all || "$phase" == tests ]]; then
      if run_gpu_test "$name" "$logs" "${SUITE_TIMEOUT[$name]}"; then
        passed=$((passed + 1))
      else
        failed=$((failed + 1))
      fi
    fi
    if [[ "$phase" == all || "$phase" == memcheck ]] &&
      { ((DRY_RUN)) || command -v compute-sanitizer >/dev/null; }; then
      if run_memcheck "$name" "$logs"; then passed=$((passed + 1)); else failed=$((failed + 1)); fi
    fi
  done
  if [[ "$phase" == all || "$phase" == bench ]]; then
    run_benches "$logs"
  fi
  x tar -C "$logs" -czf "${OUT:-build}/gpu-logs.tgz" .
  echo "gpu runs: $passed passed, $failed failed"
  ((failed == 0))
}

# Several GPUs, in parts that each fit one device call (all: every part): "tests" the NCCL
# suites (threads and processes, rank failure) and the trainer on 2 and 4 GPUs; "bench" the
# multi-GPU benches; "torch" PyTorch's context parallelism on the same machine and workload
# (tools/torch_cp_bench.py). Logs and JSON to $OUT/gpu-multi-<part>.tgz.
run_multi() {
  local part="${1:-all}"
  [[ "$part" =~ ^(all|tests|bench|torch)$ ]] || die "run multi: unknown part '$part'"
  local logs name failed=0 gpus=4
  new_logs
  logs="$LOGS"
  ((DRY_RUN)) || gpus="$(nvidia-smi -L | grep -c '^GPU ')"
  x nvidia-smi -L
  x nvidia-smi topo -m >"$logs/topology.txt" 2>&1 || true
  if [[ "$part" == all || "$part" == tests ]]; then
    for name in cuda_multi_gpu_test train_multiprocess_test cuda_nccl_test \
      ring_dilated_attention_test; do
      run_gpu_test "$name" "$logs" "${RD_TEST_TIMEOUT:-500}" || failed=$((failed + 1))
    done
  fi
  if [[ "$part" == all || "$part" == bench ]]; then
    local extra
    read -r -a extra <<<"${RD_BENCH_ARGS:-}"
    x timeout "${RD_BENCH_TIMEOUT:-540}" "$PACK_DIR/bin/cuda_multi_gpu_bench" \
      --benchmark_out="$logs/multi_gpu.json" --benchmark_out_format=json "${extra[@]}" \
      >"$logs/multi_gpu.txt" 2>&1 || true
    cat "$logs/multi_gpu.txt"
  fi
  if [[ "$part" == all || "$part" == torch ]] &&
    { ((DRY_RUN)) || python3 -c 'import torch' 2>/dev/null; }; then
    run_torch "$logs" "$gpus"
  fi
  x tar -C "$logs" -czf "${OUT:-build}/gpu-multi-$part.tgz" .
  echo "gpu multi $part: $failed suites failed"
  ((failed == 0))
}

# PyTorch's context parallelism at two sequence lengths on 1, 2 and 4 of GPUS GPUs.
run_torch() {
  local logs="$1" gpus="$2" P N
  for N in 131072 262144; do
    for P in 1 2 4; do
      ((P <= gpus)) || continue
      x timeout 300 torchrun --standalone --nproc_per_node="$P" tools/torch_cp_bench.py \
        --seq_len "$N" --heads 16 --head_dim 128 --out "$logs/torch_cp.jsonl" \
        >>"$logs/torch_cp.txt" 2>&1 || log "torch_cp_bench P=$P N=$N failed"
    done
  done
  tail -n 40 "$logs/torch_cp.txt" || true
}

# Traces a few steps of rd_train's reference model per sequence length in RD_PROFILE_SEQ
# (extra rd_train flags in RD_PROFILE_ARGS) and prints where a step's GPU time goes; the
# trainer's own progress lines (tokens/s, MFU) come from an untraced run of the same shape.
run_profile() {
  local logs bin="$PACK_DIR/bin" N run extra
  new_logs
  logs="$LOGS"
  read -r -a extra <<<"${RD_PROFILE_ARGS:-}"
  x nvidia-smi -L
  for N in ${RD_PROFILE_SEQ:-65536}; do
    run=("$bin/rd_train" --flagfile=train/configs/gpu_reference.flags --seq_len="$N" --steps=8
      --warmup_steps=1 --log_every=2 --eval_every=0 --final_eval_batches=1
      --out_dir="$logs/run-$N" "${extra[@]}")
    x "${run[@]}" >"$logs/train-$N.txt" 2>&1 || log "rd_train at $N tokens failed"
    tr '\r' '\n' <"$logs/train-$N.txt" | grep -E '^step [0-9]+/' | tail -n 2 || tail -n 5 "$logs/train-$N.txt"
    x env CUDA_INJECTION64_PATH="$ROOT/$bin/librd_cupti_trace.so" RD_CUPTI_TRACE="$logs/trace-$N.csv" \
      "${run[@]/--out_dir=*/--out_dir=$logs/traced-$N}" >"$logs/traced-$N.txt" 2>&1 ||
      log "traced rd_train at $N tokens failed"
    x python3 tools/kernel_profile.py "$logs/trace-$N.csv" --steps 4 >"$logs/profile-$N.md" 2>&1 || true
    cat "$logs/profile-$N.md"
    # A failed trace leaves no file; the logs are still worth packing.
    if [[ -f "$logs/trace-$N.csv" ]]; then gzip -f "$logs/trace-$N.csv"; fi
  done
  x tar -C "$logs" -czf "${OUT:-build}/gpu-profile.tgz" .
}

cmd_run() {
  if [[ "${1:-}" == --dry-run ]]; then
    DRY_RUN=1
    shift
  fi
  local phase="${1:-all}"
  [[ "$phase" =~ ^(all|tests|memcheck|bench|multi|profile)$ ]] || die "run: unknown phase '$phase'"
  exec 3>&1
  unpack_suite
  case "$phase" in
    multi) run_multi "${2:-all}" ;;
    profile) run_profile ;;
    *) run_single "$phase" ;;
  esac
}

# --- main ------------------------------------------------------------------------------------

command="${1:-help}"
(($# > 0)) && shift
case "$command" in
  targets) cmd_targets ;;
  pack) cmd_pack "$@" ;;
  run) cmd_run "$@" ;;
  # run-one NAME LOGS: one suite binary of the unpacked pack (parallel runners call it).
  run-one)
    read_suite
    run_gpu_test "$1" "$2" "${SUITE_TIMEOUT[$1]}"
    ;;
  help | -h | --help) usage ;;
  *)
    usage >&2
    die "unknown command '$command'"
    ;;
esac
