#!/usr/bin/env bash
# Where a hung multi-GPU test sits: runs it line-buffered, then dumps every thread's stack
# with cuda-gdb (the GPU machine has no gdb). tools/gpu_diag_hang.sh BINARY FILTER SECONDS
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export NCCL_NVLS_ENABLE=0
[[ -d .carry/gpu/bin ]] || tar -C .carry -xJf .carry/gpu.tar.xz
BIN="$PWD/.carry/gpu/bin"
export LD_LIBRARY_PATH="$PWD/.carry/gpu/lib:${LD_LIBRARY_PATH:-}"
LOGS="${OUT:-build/diag}"
mkdir -p "$LOGS"
name="$1" filter="$2" wait_s="$3"
stdbuf -oL -eL "$BIN/$name" --gtest_filter="$filter" >"$LOGS/$name.hang.log" 2>&1 &
pid=$!
for ((i = 0; i < wait_s; ++i)); do
  sleep 1
  kill -0 "$pid" 2>/dev/null || break
done
if kill -0 "$pid" 2>/dev/null; then
  echo "$name still running after ${wait_s}s: dumping stacks"
  timeout 60 cuda-gdb -p "$pid" -batch -ex "set pagination off" -ex "info threads" \
    -ex "thread apply all bt 30" >"$LOGS/$name.stacks.txt" 2>&1
  kill -9 "$pid"
  grep -E "^Thread|^#[0-9]+ " "$LOGS/$name.stacks.txt" | grep -vE "^#([3-9]|[12][0-9]) " | cut -c1-200 | head -80
fi
wait "$pid" 2>/dev/null
tail -n 15 "$LOGS/$name.hang.log"
