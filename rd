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
  gpu-pack         (machine with nvcc) build the GPU suite and pack it into .carry/gpu.tar.xz
                   for a GPU machine without our dependencies (RD_PACK_ONLY="name ..."
                   packs just those); tools/gpu.sh, which packs and runs it, says more.
  gpu-run [--dry-run] [phase]
                   (GPU machine) run the pack: phase tests, memcheck, bench, all (default),
                   multi or profile; logs to $OUT. --dry-run prints the commands instead.
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

# Free space, in GiB, of the file system holding the build folders: a full disk fails the
# build with "No space left on device" deep in the log, so the summary says how much was free.
free_disk_gib() {
  df -P -BG . | awk 'NR == 2 { sub("G", "", $4); print $4 }'
}

# Disk a build tree takes, in GiB, with margin (measured 2026-11-27: release ~3, asan ~3).
PRESET_TREE_GIB=4

# Builds a preset and runs its CPU tests: everything not labelled gpu (the regex also leaves
# out the GPU suite, label gpu_suite).
test_preset() {
  local preset="$1"
  log "=== $preset: build ($(free_disk_gib) GiB free; a tree takes up to ~$PRESET_TREE_GIB GiB)"
  if ! configure_and_build "$preset"; then
    log "=== $preset: BUILD FAILED; its tests did not run ($(free_disk_gib) GiB free)"
    TOTAL_FAILED=$((TOTAL_FAILED + 1))
    SUMMARY_LINES+=("$preset: build failed, tests not run (counted as 1 failure)")
    return 0
  fi
  log "=== $preset: CPU tests"
  run_ctest "$preset (CPU tests)" --preset "$preset" --output-on-failure -j2 -LE gpu
}

# GPU tests (label gpu exactly: the GPU suite's gpu_suite tests run the same binaries whole)
# need the CUDA build and a visible GPU.
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
  run_ctest "release (GPU tests)" --preset release-gpu --output-on-failure -j1 -L '^gpu$'
}

# make_room PRESET: where the disk could not hold another build tree, deletes PRESET's
# linked test and bench programs once its tests have run (most of its tree: each links the
# whole library; CI machines may have only a few GiB). Ninja relinks them when next built.
make_room() {
  local preset="$1" free
  free="$(free_disk_gib)"
  ((free >= PRESET_TREE_GIB + 1)) && return 0
  log "only $free GiB free: deleting build/$preset's test and bench programs (relinked on the next build)"
  find "build/$preset/tests" "build/$preset/bench" -maxdepth 1 -type f -executable \
    \( -name '*_test' -o -name '*_bench' \) -delete 2>/dev/null || true
  rm -rf "build/$preset/tests/consumer_package"
  log "now $(free_disk_gib) GiB free"
}

cmd_test() {
  cmd_setup
  test_preset release
  test_gpu
  make_room release
  test_preset asan
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
# Packing and running the GPU suite on a lent GPU machine live in tools/gpu.sh; packing
# builds first, with this script's setup and release preset.
cmd_gpu_pack() {
  cmd_setup
  have_nvcc || die "gpu-pack needs the CUDA toolkit (nvcc) on this machine"
  # The suite's list comes from the configured build (ctest), so configure before listing.
  log "configure: cmake --preset release"
  cmake --preset release
  local listed targets
  listed="$(tools/gpu.sh targets)"
  mapfile -t targets <<<"$listed"
  configure_and_build release "${targets[@]}"
  tools/gpu.sh pack "${targets[@]}"
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
  gpu-run) exec tools/gpu.sh run "$@" ;;
  help | -h | --help) usage ;;
  *)
    usage >&2
    die "unknown command '$command'"
    ;;
esac
