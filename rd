#!/usr/bin/env bash
# rd: the one entry point for setting up, building, testing and running RingDilated.
# Run `./rd help` for the commands. Works on a fresh Debian 12, with or without CUDA.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$ROOT"

# Everything the build needs from Debian. gcc's OpenMP runtime (libgomp) comes with
# build-essential; OpenBLAS provides CBLAS (whichever build Debian selects, pthread by
# default: the CPU backend keeps its thread count equal to OpenMP's, kernels/cpu/parallel.h);
# Gloo carries the multi-process CPU communicator (optional to CMake: without it that
# backend and its tests are left out); matplotlib draws the plots of tools/rdplot.py
# (./rd plot).
DEB_PACKAGES=(
  build-essential cmake ninja-build pkg-config python3 python3-matplotlib
  libabsl-dev libgtest-dev libgmock-dev libbenchmark-dev libopenblas-dev nlohmann-json3-dev
  libgloo-dev
)
PRESETS=(release cpu asan)

log() { printf '[rd] %s\n' "$*"; }
die() {
  printf '[rd] error: %s\n' "$*" >&2
  exit 1
}

usage() {
  cat <<'EOF'
Usage: ./rd <command> [args]

  setup            Install missing Debian packages (apt-get; skipped when all are present)
                   and report whether the CUDA toolkit was found.
  build [preset]   setup, configure and build a preset: release (default; CUDA when nvcc
                   is found), cpu (no CUDA) or asan (ASan + UBSan, CPU only).
  test             setup, then build and test the release and asan presets (GPU tests run
                   only where a GPU is present); prints "tests: N passed, F failed".
  train [args]     setup, build rd_train and train (defaults: a small model on the passkey
                   task, on the GPU when there is one), then plot the run's metrics into
                   <out_dir>/plots; `train sample --checkpoint=runs/passkey --prompt=...`
                   samples from it (docs/training.md; rd_train --help lists the flags).
  demo [args]      setup, build and run the demo (build/release/train/rd_demo).
  launch [args]    setup, build rd_launch and run it: start the ranks of a job on this
                   machine, e.g. ./rd launch -n 4 -- ./my_program (docs/launching.md).
  bench [args]     setup, build and run the CPU benchmarks (and the GPU ones where a GPU
                   is present); args go to Google Benchmark, e.g.
                   ./rd bench --benchmark_filter=Matmul
  plot <what> ...  PNG plots with matplotlib (tools/rdplot.py; installs python3-matplotlib
                   if missing): `plot metrics run/metrics.jsonl ... -o out/` draws loss and
                   accuracy of training runs against steps and wall time; `plot bench
                   bench.json ... -o out/` the plots of docs/benchmarks.md (--help for more).
  gpu-pack         (machine with nvcc) build release and pack the GPU tests and benches,
                   stripped, with the libraries a bare GPU machine lacks, into
                   .carry/gpu.tar.xz (RD_PACK_ONLY="name ..." packs just those).
  gpu-run [phase]  (GPU machine) unpack .carry/gpu.tar.xz, run the GPU tests (phase tests),
                   again under compute-sanitizer memcheck (memcheck), then the benches and
                   their markdown report (bench); default all. Logs to $OUT/gpu-logs.tgz.
                   Phase multi (several GPUs): the NCCL, trainer and scaling suites and
                   PyTorch's context parallelism; logs to $OUT/gpu-multi.tgz.
                   Phase profile: trace rd_train's reference model (tools/cupti_trace.cc)
                   at RD_PROFILE_SEQ tokens (default 65536) and break a step down by kernel
                   (tools/kernel_profile.py); logs to $OUT/gpu-profile.tgz.
  help             This text.

Build folders: build/<preset>. Set RD_JOBS=N to limit parallel compile jobs.
EOF
}

# --- CUDA -----------------------------------------------------------------------------

# Makes nvcc visible when the toolkit sits in its usual place but is not on PATH, so that
# CMake's CUDA detection (RD_CUDA=AUTO) finds it.
add_cuda_to_path() {
  command -v nvcc >/dev/null 2>&1 && return 0
  local dir
  for dir in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda; do
    if [[ -n "$dir" && -x "$dir/bin/nvcc" ]]; then
      export PATH="$dir/bin:$PATH"
      return 0
    fi
  done
}

have_nvcc() { command -v nvcc >/dev/null 2>&1; }

have_gpu() {
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '
}

# ---- HOOK: CUDA extras ----------------------------------------------------------------
# The cuDNN attention path (kernels/cuda/cudnn_attention.cc) needs the header-only
# cudnn-frontend, which NVIDIA ships on PyPI as nvidia-cudnn-frontend. Only its include/
# folder is kept, in .whl/cudnn_frontend/include (git ignores .whl/), where CMake looks by
# default (RD_CUDNN_FRONTEND_INCLUDE_DIR). cuDNN itself comes with the CUDA toolkit. The
# version is pinned; a VERSION file beside include/ makes a re-run skip the download. Any
# failure only warns: the build then leaves the cuDNN path out and says so.
CUDNN_FRONTEND_VERSION=1.32.0
CUDNN_FRONTEND_DIR=.whl/cudnn_frontend

setup_cuda_extras() {
  local stamp="$CUDNN_FRONTEND_DIR/VERSION"
  if [[ -f "$CUDNN_FRONTEND_DIR/include/cudnn_frontend.h" && -f "$stamp" &&
    "$(cat "$stamp")" == "$CUDNN_FRONTEND_VERSION" ]]; then
    log "cuDNN frontend $CUDNN_FRONTEND_VERSION: headers present in $CUDNN_FRONTEND_DIR/include"
    return 0
  fi
  if ! python3 -m pip --version >/dev/null 2>&1 && command -v dpkg-query >/dev/null 2>&1; then
    log "cuDNN frontend: installing python3-pip to download it"
    (install_packages python3-pip) || true
  fi
  # The wheel goes to a temporary folder, not .whl/: GPU runs install every .whl/*.whl.
  local download
  download="$(mktemp -d)"
  log "cuDNN frontend: downloading nvidia-cudnn-frontend==$CUDNN_FRONTEND_VERSION from PyPI"
  if python3 -m pip download --quiet --no-deps --only-binary=:all: \
    "nvidia-cudnn-frontend==$CUDNN_FRONTEND_VERSION" -d "$download" &&
    rm -rf "$CUDNN_FRONTEND_DIR" && mkdir -p "$CUDNN_FRONTEND_DIR" &&
    python3 - "$download" "$CUDNN_FRONTEND_DIR" <<'PY'
import glob, sys, zipfile
wheel = glob.glob(sys.argv[1] + "/nvidia_cudnn_frontend-*.whl")[0]
with zipfile.ZipFile(wheel) as archive:
    archive.extractall(sys.argv[2], [n for n in archive.namelist() if n.startswith("include/")])
PY
  then
    echo "$CUDNN_FRONTEND_VERSION" >"$stamp"
    log "cuDNN frontend $CUDNN_FRONTEND_VERSION: headers installed in $CUDNN_FRONTEND_DIR/include"
  else
    rm -rf "$CUDNN_FRONTEND_DIR"
    log "warning: could not install the cudnn-frontend headers; the cuDNN attention path is left out"
  fi
  rm -rf "$download"
  return 0
}
# ---- end of HOOK ----------------------------------------------------------------------

# --- setup ----------------------------------------------------------------------------

# Tools installed some other way (a newer cmake from pip, say) count as present.
declare -A PACKAGE_COMMAND=([cmake]=cmake [ninja-build]=ninja [pkg-config]=pkg-config
  [python3]=python3)

missing_packages() {
  local package
  for package in "${DEB_PACKAGES[@]}"; do
    if dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q 'install ok installed'; then
      continue
    fi
    if [[ -n "${PACKAGE_COMMAND[$package]:-}" ]] &&
      command -v "${PACKAGE_COMMAND[$package]}" >/dev/null 2>&1; then
      continue
    fi
    echo "$package"
  done
}

install_packages() {
  local sudo=()
  if ((EUID != 0)); then
    command -v sudo >/dev/null 2>&1 || die "not root and no sudo: install $* by hand"
    sudo=(sudo)
  fi
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$@"
}

cmd_setup() {
  if command -v dpkg-query >/dev/null 2>&1; then
    local missing
    mapfile -t missing < <(missing_packages)
    if ((${#missing[@]} > 0)); then
      log "installing missing packages: ${missing[*]}"
      install_packages "${missing[@]}"
    else
      log "all required Debian packages are installed"
    fi
  else
    log "warning: no dpkg-query (not Debian?); install by hand: ${DEB_PACKAGES[*]}"
  fi

  add_cuda_to_path
  if have_nvcc; then
    log "CUDA: nvcc found at $(command -v nvcc); the release preset builds the CUDA backend"
    setup_cuda_extras
  else
    log "CUDA: nvcc not found; building for the CPU only"
  fi
}

# --- build ----------------------------------------------------------------------------

check_preset() {
  local preset
  for preset in "${PRESETS[@]}"; do
    [[ "$1" == "$preset" ]] && return 0
  done
  die "unknown preset '$1' (choose one of: ${PRESETS[*]})"
}

# configure_and_build PRESET [TARGET...]: every step returns its failure, so callers may
# run it under `if` (where `set -e` does not apply).
configure_and_build() {
  local preset="$1"
  shift
  local args=(--build --preset "$preset")
  [[ -n "${RD_JOBS:-}" ]] && args+=(-j "$RD_JOBS")
  (($# > 0)) && args+=(--target "$@")
  log "configure: cmake --preset $preset"
  cmake --preset "$preset" || return
  log "build: cmake ${args[*]}"
  cmake "${args[@]}" || return
}

cmd_build() {
  local preset="${1:-release}"
  check_preset "$preset"
  cmd_setup
  configure_and_build "$preset"
}

# --- test -----------------------------------------------------------------------------

TOTAL_PASSED=0
TOTAL_FAILED=0
SUMMARY_LINES=()

# run_ctest NAME ARGS...: runs ctest, then adds the counts of the JUnit report it writes
# (tests, and failures + errors; skipped tests count as passed, as ctest's summary does).
run_ctest() {
  local name="$1"
  shift
  local junit rc counts failed total
  junit="$(mktemp --suffix=.xml)"
  log "ctest $*"
  set +e
  ctest "$@" --output-junit "$junit"
  rc=$?
  set -e
  counts="$(junit_counts "$junit")"
  rm -f "$junit"
  if [[ -n "$counts" ]]; then
    read -r total failed <<<"$counts"
  else
    # ctest itself failed before reporting: count that as one failure.
    failed=1
    total=1
  fi
  ((rc != 0 && failed == 0)) && failed=1 && total=$((total + 1))
  TOTAL_PASSED=$((TOTAL_PASSED + total - failed))
  TOTAL_FAILED=$((TOTAL_FAILED + failed))
  SUMMARY_LINES+=("$name: $((total - failed)) passed, $failed failed")
}

# junit_counts FILE: "TESTS FAILED" from a ctest JUnit report; nothing when it is unreadable.
junit_counts() {
  python3 - "$1" <<'PY' 2>/dev/null || true
import sys
import xml.etree.ElementTree as ET

root = ET.parse(sys.argv[1]).getroot()
suite = root if root.tag == "testsuite" else root.find("testsuite")
tests = int(suite.get("tests", "0"))
failed = int(suite.get("failures", "0")) + int(suite.get("errors", "0") or "0")
print(tests, failed)
PY
}

# Builds a preset and runs its CPU tests (everything not labelled gpu).
test_preset() {
  local preset="$1"
  log "=== $preset: build"
  if ! configure_and_build "$preset"; then
    log "=== $preset: BUILD FAILED; its tests did not run"
    TOTAL_FAILED=$((TOTAL_FAILED + 1))
    SUMMARY_LINES+=("$preset: build failed, tests not run (counted as 1 failure)")
    return 0
  fi
  log "=== $preset: CPU tests"
  run_ctest "$preset (CPU tests)" --preset "$preset" --output-on-failure -j2 -LE gpu
}

# GPU tests (label gpu) need the CUDA build and a visible GPU.
test_gpu() {
  if ! have_gpu; then
    SUMMARY_LINES+=("GPU tests: skipped, no GPU present (0 GPU tests run)")
    return 0
  fi
  if ! have_nvcc; then
    SUMMARY_LINES+=("GPU tests: skipped, a GPU is present but no CUDA toolkit (0 run)")
    return 0
  fi
  if [[ ! -f build/release/CMakeCache.txt ]]; then
    SUMMARY_LINES+=("GPU tests: skipped, the release build failed (0 run)")
    return 0
  fi
  log "=== release: GPU tests"
  run_ctest "release (GPU tests)" --preset release-gpu --output-on-failure -j1 -L gpu
}

cmd_test() {
  cmd_setup
  test_preset release
  test_preset asan
  test_gpu
  echo
  log "=== summary"
  local line
  for line in "${SUMMARY_LINES[@]}"; do
    log "$line"
  done
  echo "tests: $TOTAL_PASSED passed, $TOTAL_FAILED failed"
  ((TOTAL_FAILED == 0))
}

# --- GPU suite --------------------------------------------------------------------------
# The GPU machine has the CUDA runtime and cuBLASLt but not our Debian dependencies
# (Abseil, OpenBLAS). So the suite is built here (release preset) and packed, stripped and
# with the libraries the GPU machine lacks, into .carry/gpu.tar.xz (git-ignored). On the
# GPU machine, `./rd gpu-run` unpacks it and runs every GPU test binary, then again under
# compute-sanitizer memcheck, then the GPU benchmarks; logs go to $OUT/gpu-logs.tgz.
GPU_PACK_DIR=.carry/gpu
GPU_PACK=.carry/gpu.tar.xz

# The build targets of the GPU suite: the CUDA tests and benches and the op suite (only
# these are built and packed: CI builds and tests the rest).
gpu_targets() {
  local source
  for source in tests/cuda_*_test.cc bench/cuda_*_bench.cc; do
    [[ -f "$source" ]] && basename "${source%.cc}"
  done
  # Suites whose CUDA cases register or run only where a GPU is visible.
  echo op_suite_test
  echo dilated_attention_test
  echo attention_merge_test
  echo ring_dilated_attention_test
  echo rotary_test
  echo foreach_ops_test
  # The trainer, for training runs on the GPU (MFU, longest sequence; docs/benchmarks.md),
  # its launcher, and the test that trains on several GPUs through both.
  echo rd_train_cli
  echo rd_launch
  echo train_multiprocess_test
  # Loads cuBLASLt and cuDNN (opened at run time, not linked) the way the library does.
  echo shared_library_test
  # The CUPTI kernel tracer behind `gpu-run profile` (the GPU machine has no Nsight).
  echo rd_cupti_trace
}

cmd_gpu_pack() {
  cmd_setup
  have_nvcc || die "gpu-pack needs the CUDA toolkit (nvcc) on this machine"
  local targets
  mapfile -t targets < <(gpu_targets)
  # RD_PACK_ONLY="name ...": pack just these of the suite (a smaller pack, packed sooner).
  [[ -n "${RD_PACK_ONLY:-}" ]] && read -r -a targets <<<"$RD_PACK_ONLY"
  configure_and_build release "${targets[@]}"
  rm -rf "$GPU_PACK_DIR"
  mkdir -p "$GPU_PACK_DIR/bin" "$GPU_PACK_DIR/lib"
  local binary name path
  # The test binaries that run on the GPU: the CUDA tests, plus the op suite, whose CUDA
  # cases register only where a GPU is visible; then the CUDA benches.
  for name in "${targets[@]}"; do
    for binary in "build/release/tests/$name" "build/release/bench/$name"; do
      [[ -x "$binary" ]] && strip -o "$GPU_PACK_DIR/bin/$name" "$binary"
    done
  done
  strip -o "$GPU_PACK_DIR/bin/rd_train" build/release/train/rd_train
  strip -o "$GPU_PACK_DIR/bin/rd_launch" build/release/train/rd_launch
  cp bench/report.py "$GPU_PACK_DIR/bin/" 2>/dev/null || true
  [[ -f build/release/tools/librd_cupti_trace.so ]] &&
    strip -o "$GPU_PACK_DIR/bin/librd_cupti_trace.so" build/release/tools/librd_cupti_trace.so
  # Carry what a binary links beyond the C/C++ runtime, the driver and the CUDA toolkit.
  for binary in "$GPU_PACK_DIR"/bin/*_test "$GPU_PACK_DIR"/bin/*_bench "$GPU_PACK_DIR"/bin/rd_* \
    "$GPU_PACK_DIR"/bin/*.so; do
    while read -r name path; do
      [[ "$name" =~ ^lib(absl_|gomp|openblas|gfortran|quadmath|benchmark|gloo|hiredis|ibverbs|nl-|cupti) ]] || continue
      cp -L -n "$path" "$GPU_PACK_DIR/lib/$name"
    done < <(ldd "$binary" | awk '$3 ~ /^\// {print $1, $3}')
  done
  # The test binaries share most of their bytes (the ~40 MB of kernels each links), which
  # compress to about one copy when the dictionary spans several binaries and the stream is
  # one block: 1 GB -> 26 MB, leaving room for the tree (~5 MB) under the 64 MiB carry limit
  # (xz -9 -T2 cut it into blocks that each kept a copy: 60 MB). Single-threaded: ~9 minutes.
  tar -C .carry -cf - gpu | xz -T1 --lzma2=preset=9,dict=192MiB >"$GPU_PACK"
  rm -rf "$GPU_PACK_DIR"
  log "packed $(du -h "$GPU_PACK" | cut -f1) into $GPU_PACK; carry .carry and run ./rd gpu-run there"
}

# gtest arguments for one GPU test binary: the op suite runs only its CUDA cases (and the
# harness checks), since CI covers its CPU cases.
gpu_test_args() {
  case "$1" in
    op_suite_test) echo "--gtest_brief=1 --gtest_filter=*cuda*:Harness.*" ;;
    dilated_attention_test | attention_merge_test | ring_dilated_attention_test | \
      train_multiprocess_test)
      echo "--gtest_brief=1 --gtest_filter=*Cuda*" ;;
    cuda_multi_gpu_test) echo "--gtest_print_time=1" ;;
    *) echo "--gtest_brief=1" ;;
  esac
}

# Unpacks the GPU suite and sets the environment its programs need: the carried
# libraries, the programs the multi-process tests start, NCCL without NVLink multicast.
unpack_gpu_suite() {
  [[ -f "$GPU_PACK" ]] || die "no $GPU_PACK: run ./rd gpu-pack first and carry .carry"
  tar -C .carry -xJf "$GPU_PACK"
  export LD_LIBRARY_PATH="$ROOT/$GPU_PACK_DIR/lib:${LD_LIBRARY_PATH:-}"
  export RD_TRAIN="$ROOT/$GPU_PACK_DIR/bin/rd_train" RD_LAUNCH="$ROOT/$GPU_PACK_DIR/bin/rd_launch"
  export NCCL_NVLS_ENABLE=0
}

# Runs one GPU test binary under a timeout of $3 seconds (its gtest arguments from
# gpu_test_args), logging to $2/<name>.log and printing its summary; returns its status.
run_gpu_test() {
  local binary="$1" logs="$2" limit="$3" name rc=0 args
  name="$(basename "$binary")"
  read -r -a args <<<"$(gpu_test_args "$name")"
  timeout "$limit" "$binary" "${args[@]}" >"$logs/$name.log" 2>&1 || rc=$?
  log "$name: exit $rc"
  grep -E 'PASSED|FAILED|SKIPPED|resumed vs' "$logs/$name.log" | tail -n 12 || true
  return "$rc"
}

# Runs the GPU tests (phase "tests"), the same under compute-sanitizer memcheck
# ("memcheck"), and the benches ("bench"); "all" runs the three. Phase "multi" (a machine
# with several GPUs) runs the suites that use several and their benches: cmd_gpu_multi.
cmd_gpu_run() {
  local phase="${1:-all}"
  [[ "$phase" =~ ^(all|tests|memcheck|bench|multi|profile)$ ]] || die "gpu-run: unknown phase '$phase'"
  if [[ "$phase" == multi ]]; then
    cmd_gpu_multi "${2:-all}"
    return
  fi
  if [[ "$phase" == profile ]]; then
    cmd_gpu_profile
    return
  fi
  unpack_gpu_suite
  local logs binary name rc passed=0 failed=0 args
  logs="$(mktemp -d)"
  nvidia-smi -L
  for binary in "$GPU_PACK_DIR"/bin/*_test; do
    name="$(basename "$binary")"
    read -r -a args <<<"$(gpu_test_args "$name")"
    if [[ "$phase" == all || "$phase" == tests ]]; then
      if run_gpu_test "$binary" "$logs" 400; then
        passed=$((passed + 1))
      else
        failed=$((failed + 1))
      fi
    fi
    if [[ "$phase" == all || "$phase" == memcheck ]] && command -v compute-sanitizer >/dev/null; then
      rc=0
      # API errors are expected (the out-of-memory tests); memory errors are not.
      timeout 400 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \
        "$binary" "${args[@]}" >"$logs/$name.memcheck.log" 2>&1 || rc=$?
      log "$name under memcheck: exit $rc"
      grep -E 'ERROR SUMMARY|FAILED' "$logs/$name.memcheck.log" | tail -n 8 || true
      if ((rc == 0)); then passed=$((passed + 1)); else failed=$((failed + 1)); fi
    fi
  done
  if [[ "$phase" == all || "$phase" == bench ]]; then
    for binary in "$GPU_PACK_DIR"/bin/*_bench; do
      [[ -x "$binary" ]] || continue
      name="$(basename "$binary")"
      # shellcheck disable=SC2086  # RD_BENCH_ARGS holds several words on purpose
      # One repetition: Google Benchmark 1.7 aborts when repetitions of a manually timed
      # row settle on different iteration counts.
      "$binary" --benchmark_min_time=0.3 --benchmark_out="$logs/$name.json" \
        --benchmark_out_format=json ${RD_BENCH_ARGS:-} >"$logs/$name.txt" 2>&1 || true
      tail -n 5 "$logs/$name.txt"
    done
    if compgen -G "$logs/*.json" >/dev/null; then
      python3 "$GPU_PACK_DIR/bin/report.py" "$logs"/*.json >"$logs/report.md" 2>&1 || true
      cat "$logs/report.md"
    fi
  fi
  tar -C "$logs" -czf "${OUT:-build}/gpu-logs.tgz" .
  echo "gpu runs: $passed passed, $failed failed"
  ((failed == 0))
}

# Several GPUs, in parts that each fit one device call (all: every part): "tests" the NCCL
# suites (threads and processes, rank failure) and the trainer on 2 and 4 GPUs; "bench" the
# multi-GPU benches; "torch" PyTorch's context parallelism on the same machine and workload
# (tools/torch_cp_bench.py). Logs and JSON to $OUT/gpu-multi-<part>.tgz.
cmd_gpu_multi() {
  local part="${1:-all}"
  [[ "$part" =~ ^(all|tests|bench|torch)$ ]] || die "gpu-run multi: unknown part '$part'"
  unpack_gpu_suite
  local logs bin="$GPU_PACK_DIR/bin" name failed=0 gpus
  logs="$(mktemp -d)"
  gpus="$(nvidia-smi -L | grep -c '^GPU ')"
  nvidia-smi -L
  nvidia-smi topo -m >"$logs/topology.txt" 2>&1 || true
  if [[ "$part" == all || "$part" == tests ]]; then
    for name in cuda_multi_gpu_test train_multiprocess_test cuda_nccl_test \
      ring_dilated_attention_test; do
      run_gpu_test "$bin/$name" "$logs" "${RD_TEST_TIMEOUT:-500}" || failed=$((failed + 1))
    done
  fi
  if [[ "$part" == all || "$part" == bench ]]; then
    # shellcheck disable=SC2086  # RD_BENCH_ARGS holds several words on purpose
    timeout "${RD_BENCH_TIMEOUT:-540}" "$bin/cuda_multi_gpu_bench" \
      --benchmark_out="$logs/multi_gpu.json" --benchmark_out_format=json ${RD_BENCH_ARGS:-} \
      >"$logs/multi_gpu.txt" 2>&1 || true
    cat "$logs/multi_gpu.txt"
  fi
  if [[ "$part" == all || "$part" == torch ]] && python3 -c 'import torch' 2>/dev/null; then
    local P N
    for N in 131072 262144; do
      for P in 1 2 4; do
        ((P <= gpus)) || continue
        timeout 300 torchrun --standalone --nproc_per_node="$P" tools/torch_cp_bench.py \
          --seq_len "$N" --heads 16 --head_dim 128 --out "$logs/torch_cp.jsonl" \
          >>"$logs/torch_cp.txt" 2>&1 || log "torch_cp_bench P=$P N=$N failed"
      done
    done
    tail -n 40 "$logs/torch_cp.txt" || true
  fi
  tar -C "$logs" -czf "${OUT:-build}/gpu-multi-$part.tgz" .
  echo "gpu multi $part: $failed suites failed"
  ((failed == 0))
}

# Traces a few steps of rd_train's reference model per sequence length in RD_PROFILE_SEQ
# (extra rd_train flags in RD_PROFILE_ARGS) and prints where a step's GPU time goes; the
# trainer's own progress lines (tokens/s, MFU) come from an untraced run of the same shape.
cmd_gpu_profile() {
  unpack_gpu_suite
  local logs bin="$GPU_PACK_DIR/bin" N run
  logs="$(mktemp -d)"
  nvidia-smi -L
  for N in ${RD_PROFILE_SEQ:-65536}; do
    # shellcheck disable=SC2086  # RD_PROFILE_ARGS holds several flags on purpose
    run=("$bin/rd_train" --flagfile=train/configs/gpu_reference.flags --seq_len="$N" --steps=8
      --warmup_steps=1 --log_every=2 --eval_every=0 --final_eval_batches=1
      --out_dir="$logs/run-$N" ${RD_PROFILE_ARGS:-})
    "${run[@]}" >"$logs/train-$N.txt" 2>&1 || log "rd_train at $N tokens failed"
    tr '\r' '\n' <"$logs/train-$N.txt" | grep -E '^step [0-9]+/' | tail -n 2 || tail -n 5 "$logs/train-$N.txt"
    CUDA_INJECTION64_PATH="$ROOT/$bin/librd_cupti_trace.so" RD_CUPTI_TRACE="$logs/trace-$N.csv" \
      "${run[@]/--out_dir=*/--out_dir=$logs/traced-$N}" >"$logs/traced-$N.txt" 2>&1 ||
      log "traced rd_train at $N tokens failed"
    python3 tools/kernel_profile.py "$logs/trace-$N.csv" --steps 4 >"$logs/profile-$N.md" 2>&1 || true
    cat "$logs/profile-$N.md"
    gzip -f "$logs/trace-$N.csv"
  done
  tar -C "$logs" -czf "${OUT:-build}/gpu-profile.tgz" .
}

# --- demo and bench -------------------------------------------------------------------

# OpenMP threads spin while they wait for work by default. On a busy machine (a shared CI
# box, or ctest running two test programs at once) the spinning threads take the cores
# from the ones doing the work, which made the demo about 10x slower there. Passive waiting
# costs little for these workloads. The test presets set the same; benchmarks keep the
# default, which is faster on an idle machine. A value set by the caller is kept.
prefer_passive_openmp() {
  export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
}

cmd_demo() {
  cmd_setup
  prefer_passive_openmp
  configure_and_build release rd_demo
  log "run: build/release/train/rd_demo $*"
  build/release/train/rd_demo "$@"
}

# rd_launch (train/launch_main.cc) from the release build; its arguments pass through.
cmd_launch() {
  cmd_setup >&2
  configure_and_build release rd_launch >&2
  exec build/release/train/rd_launch "$@"
}

# Runs the CPU benchmarks (bench/*_bench.cc); the GPU ones (bench/cuda_*_bench.cc) too when
# a GPU and the CUDA toolkit are present.
cmd_bench() {
  cmd_setup
  local targets=() source name
  for source in bench/*_bench.cc; do
    [[ -e "$source" ]] || continue
    name="$(basename "$source" .cc)"
    if [[ "$name" == cuda_* ]] && ! { have_gpu && have_nvcc; }; then
      log "skipping $name: it needs a GPU"
      continue
    fi
    targets+=("$name")
  done
  ((${#targets[@]} > 0)) || die "no benchmarks to run in bench/"
  configure_and_build release "${targets[@]}"
  local target
  for target in "${targets[@]}"; do
    log "run: build/release/bench/$target $*"
    "build/release/bench/$target" "$@"
  done
}

# --- plot -----------------------------------------------------------------------------

# The python3 that imports matplotlib, or nothing: Debian's python3-matplotlib serves
# /usr/bin/python3, and a python3 earlier on PATH (pyenv, a virtual environment) may lack it.
plot_python() {
  local candidate
  for candidate in python3 /usr/bin/python3; do
    if "$candidate" -c "import matplotlib" >/dev/null 2>&1; then
      echo "$candidate"
      return 0
    fi
  done
}

# Plotting needs only matplotlib, so this installs just that (not the whole setup).
# rd_train (train/train_main.cc, docs/training.md): builds it (with CUDA where a GPU and nvcc
# are present, else the CPU-only preset, which builds much faster), trains (the passkey task
# by default; arguments go to rd_train), then draws the run's metrics into <out_dir>/plots.
# `./rd train sample ...` samples from a checkpoint instead.
cmd_train() {
  cmd_setup
  prefer_passive_openmp
  local preset=cpu
  if have_gpu && have_nvcc; then preset=release; fi
  configure_and_build "$preset" rd_train_cli
  local binary="build/$preset/train/rd_train"
  if [[ "${1:-}" == sample ]]; then
    exec "$binary" "$@"
  fi
  local out_dir="runs/passkey" arg
  for arg in "$@"; do
    [[ "$arg" == --out_dir=* ]] && out_dir="${arg#--out_dir=}"
    # Help trains nothing: no plots after it.
    [[ "$arg" =~ ^--?(h|help|helpfull|helpshort)$ ]] && exec "$binary" "$@"
  done
  log "run: $binary $*"
  "$binary" "$@" || return
  local python
  python="$(plot_python)"
  if [[ -n "$python" && -f "$out_dir/metrics.jsonl" ]]; then
    "$python" tools/rdplot.py metrics "$out_dir/metrics.jsonl" -o "$out_dir/plots" &&
      log "plots: $out_dir/plots"
  else
    log "no plots: python3-matplotlib is missing (./rd setup installs it)"
  fi
}

cmd_plot() {
  local python
  python="$(plot_python)"
  if [[ -z "$python" ]]; then
    command -v dpkg-query >/dev/null 2>&1 || die "plot needs matplotlib; install it by hand"
    log "installing python3-matplotlib for the plots"
    install_packages python3-matplotlib >&2
    python="$(plot_python)"
    [[ -n "$python" ]] || die "python3-matplotlib is installed, but no python3 imports matplotlib"
  fi
  exec "$python" tools/rdplot.py "$@"
}

# --- main -----------------------------------------------------------------------------

command="${1:-help}"
(($# > 0)) && shift
case "$command" in
  setup) cmd_setup ;;
  build) cmd_build "$@" ;;
  test) cmd_test ;;
  train) cmd_train "$@" ;;
  demo) cmd_demo "$@" ;;
  launch) cmd_launch "$@" ;;
  bench) cmd_bench "$@" ;;
  plot) cmd_plot "$@" ;;
  gpu-pack) cmd_gpu_pack ;;
  gpu-run) cmd_gpu_run "$@" ;;
  help | -h | --help) usage ;;
  *)
    usage >&2
    die "unknown command '$command'"
    ;;
esac
