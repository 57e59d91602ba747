#!/usr/bin/env bash
# Issue 19's runs on one machine of 4 GPUs, in parts that each fit one device call, from the
# pack of `./rd gpu-pack` (carry .carry): tools/gpu_issue19.sh tests|bench|links|train.
#   tests  the NCCL suites (thread ranks: the P = 4 hang; a skipped collective's timeout),
#          the ring on one GPU, the trainer on 2 and 4 GPUs (recomputation with MLP chunks)
#   bench  strong scaling at 1M and 4M, causal per sequence layout (cuda_multi_gpu_bench)
#   links  the ring over NCCL's socket transport against NVLink, with and without overlap
#   train  the reference model context parallel (1, 2, 4 GPUs), data parallel and both
#   loss   train's first part: the loss of the first steps on 1, 2 and 4 GPUs
#   gqa_loss  (issue 21) the loss of the first steps with 2 key/value heads on 1 and 2 GPUs
#   gqa_docs_loss  (issue 21) the same with document masks too (text, a document per paragraph)
#   docs_train  (issue 21) document masks with every head on every pair (rd_train's default
#          mixing) on 1 GPU and context parallel 2: loss and tokens/s. RD_TRAIN picks the
#          binary (default the pack's), TAG prefixes the run names (before/after runs),
#          CP2_ONLY=1 leaves out the one-GPU run.
# Logs and JSON go to $OUT (or build/issue19); each part prints a short summary last.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export NCCL_NVLS_ENABLE=0
tar -C .carry -xJf .carry/gpu.tar.xz
BIN="$PWD/.carry/gpu/bin"
export LD_LIBRARY_PATH="$PWD/.carry/gpu/lib:${LD_LIBRARY_PATH:-}"
export RD_TRAIN="${RD_TRAIN:-$BIN/rd_train}" RD_LAUNCH="$BIN/rd_launch"
LOGS="${OUT:-build/issue19}"
mkdir -p "$LOGS"
nvidia-smi -L

# run_test NAME SECONDS ARGS...: a test binary under a timeout, its verdict lines.
run_test() {
  local name="$1" limit="$2" rc=0
  shift 2
  timeout "$limit" "$BIN/$name" "$@" >"$LOGS/$name.log" 2>&1 || rc=$?
  echo "== $name $*: exit $rc"
  grep -E '^\[  (PASSED|FAILED|SKIPPED) |OK \]|resumed vs' "$LOGS/$name.log" | tail -n 14
}

part_tests() {
  run_test cuda_nccl_test 150 --gtest_brief=1
  run_test cuda_multi_gpu_test 300 --gtest_print_time=1
  cp "$LOGS/cuda_multi_gpu_test.log" "$LOGS/cuda_multi_gpu_test.sync.log"
  CUDA_MODULE_LOADING=EAGER RD_NCCL_THREAD_OVERLAP=1 \
    run_test cuda_multi_gpu_test 150 --gtest_print_time=1 --gtest_filter='Ranks/NcclThreads.*'
  run_test train_multiprocess_test 400 --gtest_print_time=1 --gtest_filter='*Cuda*'
  run_test ring_dilated_attention_test 200 --gtest_brief=1 --gtest_filter='*Cuda*'
  run_test rotary_test 60 --gtest_brief=1
  run_test cuda_trainer_test 200 --gtest_brief=1
}

# bench NAME FILTER [ENV...]: one cuda_multi_gpu_bench run, JSON and text kept.
bench() {
  local name="$1" filter="$2"
  shift 2
  env "$@" timeout 500 "$BIN/cuda_multi_gpu_bench" --benchmark_filter="$filter" \
    --benchmark_out="$LOGS/$name.json" --benchmark_out_format=json >"$LOGS/$name.txt" 2>&1 ||
    echo "bench $name: exit $?"
  grep -E '^(strong|mgpu|weak)' "$LOGS/$name.txt" | sed -E 's/ +/ /g' | cut -c1-220
}

part_bench() { bench strong 'strong'; }

# The exchange over sockets (between machines without InfiniBand) against NVLink, with the
# transfers overlapped (the default) and not (RD_NCCL_THREAD_SYNC: each waited for).
part_links() {
  local rows='mgpu/fwdbwd/(single|ring)/P[124]/'
  bench nvlink "$rows"
  bench nvlink_sync "$rows" RD_NCCL_THREAD_SYNC=1
  bench sockets "$rows" NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1
  bench sockets_sync "$rows" NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 RD_NCCL_THREAD_SYNC=1
}

# train NAME GPUS SEQ_LEN EXTRA...: the reference model (12 x 768) with the issue's pairs,
# bf16, recomputation on, a few steps; prints its step lines.
train() {
  local name="$1" gpus="$2" seq="$3"
  shift 3
  local args=(--flagfile=train/configs/gpu_reference.flags --seq_len="$seq"
    --segments="2048,16384,262144,$seq" --dilations=1,4,16,64 --recompute --steps="${STEPS:-6}"
    --warmup_steps=2 --log_every=1 --eval_every=0 --final_eval_batches=1
    --out_dir="$LOGS/run-$name" --resume= "$@")
  local cmd=("$RD_TRAIN" "${args[@]}")
  ((gpus > 1)) && cmd=("$RD_LAUNCH" -n "$gpus" -- "${cmd[@]}")
  timeout "${TRAIN_TIMEOUT:-420}" "${cmd[@]}" >"$LOGS/train-$name.txt" 2>&1 ||
    echo "train $name: exit $?"
  echo "== $name ($gpus GPUs, N = $seq $*)"
  tr '\r' '\n' <"$LOGS/train-$name.txt" | grep -E '^(\[(rank )?0\] )?step [0-9]+/' | tail -n 6 | cut -c1-160
  tr '\r' '\n' <"$LOGS/train-$name.txt" | grep -iE 'error|out of memory' | head -n 3
}

# Loss against one GPU for the first steps: context parallel 2 and 4, data parallel 2,
# both (global batch 2 everywhere).
part_loss() {
  local N=262144
  train one 1 "$N" --batch_size=2
  train cp2 2 "$N" --batch_size=2 --context_parallel=2
  train cp4 4 "$N" --batch_size=2 --context_parallel=4
  train dp2 2 "$N" --batch_size=1
  train dp2cp2 4 "$N" --batch_size=1 --context_parallel=2
}

# Issue 21: the same loss check with grouped-query attention. 12 heads over 4 pairs in head
# groups of 3 with 2 key/value heads (groups of 6): each key/value head is read by two pairs,
# whose backward stores, then adds, its dK/dV in bf16.
part_gqa_loss() {
  local N=262144
  train gqa-one 1 "$N" --batch_size=2 --kv_heads=2
  train gqa-cp2 2 "$N" --batch_size=2 --kv_heads=2 --context_parallel=2
  train gqa-dp2 2 "$N" --batch_size=1 --kv_heads=2
}

# Issue 21: grouped-query attention and document masks together (the repository's docs/ as
# text, a document per paragraph), whose pieces run as cuDNN calls over pieces, on 1 and 2
# GPUs: context parallel 2 and data parallel 2 against one GPU.
part_gqa_docs_loss() {
  local N=65536
  local data=(--data=text:docs --documents='separator:\n\n' --kv_heads=2
    --segments=2048,4096,8192,16384 --dilations=1,2,4,8)
  train gqad-one 1 "$N" --batch_size=2 "${data[@]}"
  train gqad-cp2 2 "$N" --batch_size=2 --context_parallel=2 "${data[@]}"
  train gqad-dp2 2 "$N" --batch_size=1 "${data[@]}"
}

# Issue 21: document masks (text, a document per paragraph) with all heads mixed, N = 256K:
# the pair over the whole sequence crosses the two ranks' blocks under context parallelism,
# so pieces run on keys from the other rank too.
part_docs_train() {
  local N=262144
  local data=(--data=text:docs --documents='separator:\n\n' --mixing=all_heads)
  [[ -n "${CP2_ONLY:-}" ]] || train "${TAG:-}docs-one" 1 "$N" --batch_size=2 "${data[@]}"
  train "${TAG:-}docs-cp2" 2 "$N" --batch_size=2 --context_parallel=2 "${data[@]}"
}

part_train() {
  part_loss
  # Throughput: 2M tokens per GPU, one GPU against context parallel 4 (8M tokens).
  train tput1 1 2097152
  train tput4 4 8388608 --context_parallel=4
  train tput4c 4 8388608 --context_parallel=4 --cp_layout=contiguous
}

# The thread ranks at P = 2 then 4 (the hang), strong scaling, and the trainer's throughput
# at 2M tokens per GPU on 1 and 4 GPUs: what fits one call of a short lease.
part_quick() {
  bash tools/gpu_diag_hang.sh cuda_multi_gpu_test 'Ranks/NcclThreads.*' 60
  BENCH_TIMEOUT=200 CUDA_MODULE_LOADING=LAZY bench strong 'strong'
  STEPS=4 TRAIN_TIMEOUT=150 train tput1 1 2097152
  STEPS=4 TRAIN_TIMEOUT=150 train tput4 4 8388608 --context_parallel=4
}

case "${1:-}" in
  quick) part_quick ;;
  tests) part_tests ;;
  bench) part_bench ;;
  links) part_links ;;
  train) part_train ;;
  loss) part_loss ;;
  gqa_loss) part_gqa_loss ;;
  gqa_docs_loss) part_gqa_docs_loss ;;
  docs_train) part_docs_train ;;
  *) echo "usage: tools/gpu_issue19.sh quick|tests|bench|links|train|loss|gqa_loss|gqa_docs_loss|docs_train" >&2; exit 2 ;;
esac
