#!/usr/bin/env python3
"""Benchmark of PyTorch's own context parallelism, the baseline of issue 12: ring attention
over F.scaled_dot_product_attention (torch.distributed.tensor.experimental.context_parallel),
forward and forward+backward, bf16, batch 1, q/k/v [1, H, N, D]. With one process it times
plain SDPA on the whole sequence on one GPU instead (no CP). Written against torch 2.11.

  NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc_per_node=P tools/torch_cp_bench.py \
      --seq_len 131072 --heads 16 --head_dim 128 --out results.jsonl \
      [--causal] [--iters 3] [--rotate allgather|alltoall] [--backend flash|cudnn|efficient|auto]

Rank 0 appends one JSON object a line to --out per direction ("fwd", "fwdbwd") and prints
it readably. With P > 1 a self-check first compares CP with plain SDPA at N = 4096 * P
(--check_len) and exits 1 if the relative error exceeds 2e-2. --device cpu (gloo) only
exercises the script, with P = 1 (PyTorch's ring SDPA has no CPU kernel), e.g.
torchrun --nproc_per_node=1 tools/torch_cp_bench.py --device cpu --seq_len 256.
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental._attention import (
    _cp_options, context_parallel, context_parallel_unshard, set_rotate_method)
from torch.nn.attention import SDPBackend, sdpa_kernel

# NVLink SHARP (NVLS) off unless the caller says otherwise; NCCL reads it when the process
# group starts, in main().
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

BACKENDS = {
    "flash": [SDPBackend.FLASH_ATTENTION],
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION],
    "auto": [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
             SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
}
MAX_REL_ERROR = 2e-2
BWD_OVER_FWD_FLOPS = 2.5  # backward: 5 N x N x D matmuls (S again, dV, dP, dQ, dK) to 2


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq_len", type=int, default=131072)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head_dim", type=int, default=128)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--rotate", choices=["allgather", "alltoall"], default="allgather")
    p.add_argument("--backend", choices=sorted(BACKENDS), default="flash")
    p.add_argument("--check_len", type=int, default=0, help="self-check N (0: 4096 * P)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results.jsonl")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    return p.parse_args()


def setup(args):
    """Starts the process group (NCCL on GPUs, gloo on CPU); returns this rank's device."""
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


def make_inputs(seq_len, args, device):
    """q, k, v, grad_out [1, H, N, D] bf16, the same on every rank (one seed)."""
    gen = torch.Generator(device=device).manual_seed(args.seed)
    shape = (1, args.heads, seq_len, args.head_dim)
    return [torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)
            for _ in range(4)]


def attention(q, k, v, causal):
    # F.scaled_dot_product_attention is looked up at call time on purpose: inside
    # context_parallel() PyTorch replaces that attribute with its ring version.
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def run_fwd(q, k, v, grad_out, causal):
    with torch.no_grad():
        attention(q, k, v, causal)


def run_fwdbwd(q, k, v, grad_out, causal):
    for t in (q, k, v):
        t.grad = None
    attention(q, k, v, causal).backward(grad_out)


DIRECTIONS = {"fwd": run_fwd, "fwdbwd": run_fwdbwd}


def max_over_ranks(values, device):
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def time_calls(fn, inputs, args, device):
    """Seconds per call of fn (one warm-up call, then args.iters calls, host clock around
    synchronized work) and this rank's allocator peak over them."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    fn(*inputs, args.causal)
    sync(device)
    start = time.perf_counter()
    for _ in range(args.iters):
        fn(*inputs, args.causal)
    sync(device)
    seconds = (time.perf_counter() - start) / args.iters
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return seconds, peak


def measure_all(inputs, args, device):
    """{direction: (oom, seconds, peak_bytes)}, each the maximum over ranks."""
    for t in inputs[:3]:
        t.requires_grad_()
    results = {}
    for direction, fn in DIRECTIONS.items():
        oom, seconds, peak = 0.0, 0.0, 0.0
        try:
            seconds, peak = time_calls(fn, inputs, args, device)
        except torch.cuda.OutOfMemoryError:
            # An OOM on some ranks only can still leave the others waiting in a collective.
            oom = 1.0
        for t in inputs[:3]:
            t.grad = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
        results[direction] = max_over_ranks([oom, seconds, peak], device)
    return results


def take_shards(buffers):
    """context_parallel() shrinks each buffer with resize_(), which keeps the full-length
    storage allocated: copy each shard out and free that storage, so that the peak memory
    counts the shards only (the buffers are never read again: no_restore_buffers)."""
    shards = [t.clone() for t in buffers]
    for t in buffers:
        t.untyped_storage().resize_(0)
    return shards


def relative_error(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def check_against_sdpa(mesh, world, args, device):
    """Compares CP's output and dq, dk, dv (gathered back in sequence order) at a small N
    with plain SDPA on the full tensors on this device; prints the relative errors and
    returns whether all are below MAX_REL_ERROR, the same answer on every rank."""
    n = args.check_len or 4096 * world
    q, k, v, grad_out = make_inputs(n, args, device)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention(*ref, args.causal)
    out.backward(grad_out)
    want = [out, ref[0].grad, ref[1].grad, ref[2].grad]
    buffers = [q, k, v, grad_out]  # must not require grad: they are resized in place
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2, 2],
                          no_restore_buffers=set(buffers)):
        for t in (q, k, v):
            t.requires_grad_()
        cp_out = attention(q, k, v, args.causal)
        cp_out.backward(grad_out)
        # Inside the context: unshard undoes the load-balancing order only while it is on.
        got = context_parallel_unshard(mesh, [cp_out.detach(), q.grad, k.grad, v.grad],
                                       [2, 2, 2, 2])
    errors = max_over_ranks([relative_error(g, w) for g, w in zip(got, want)], device)
    ok = max(errors) < MAX_REL_ERROR
    if dist.get_rank() == 0:
        named = ", ".join(f"{name} {e:.2e}" for name, e in zip(["out", "dq", "dk", "dv"], errors))
        print(f"self-check N={n}, CP vs SDPA relative error: {named} "
              f"({'ok' if ok else 'FAILED'}, bound {MAX_REL_ERROR})")
    return ok


def benchmark(mesh, world, args, device):
    """Times both directions: plain SDPA on the whole sequence when world == 1, else CP."""
    inputs = make_inputs(args.seq_len, args, device)
    if world == 1:
        return measure_all(inputs, args, device)
    with context_parallel(mesh, buffers=inputs, buffer_seq_dims=[2, 2, 2, 2],
                          no_restore_buffers=set(inputs)):
        return measure_all(take_shards(inputs), args, device)


def record(direction, result, world, args, device):
    oom, seconds, peak = result
    rec = {"impl": "torch_cp" if world > 1 else "torch_sdpa", "world_size": world,
           "seq_len": args.seq_len, "heads": args.heads, "head_dim": args.head_dim,
           "causal": args.causal, "rotate": args.rotate if world > 1 else None,
           "backend": args.backend, "direction": direction, "iters": args.iters,
           "torch_version": torch.__version__,
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    if oom:
        rec["error"] = "out of memory"
        return rec
    # Attention FLOPs, B = 1: two N x N x D matmuls per head forward (2 FLOPs a
    # multiply-add), half of them when causal; the backward counts 2.5 times the forward.
    fwd_flops = 4 * args.seq_len ** 2 * args.heads * args.head_dim / (2 if args.causal else 1)
    flops = fwd_flops * (1 if direction == "fwd" else 1 + BWD_OVER_FWD_FLOPS)
    rec.update(seconds=seconds, tokens_per_s=args.seq_len / seconds,
               tflops_per_gpu=flops / seconds / world / 1e12, peak_bytes=int(peak))
    return rec


def describe(rec):
    head = (f"{rec['impl']} P={rec['world_size']} N={rec['seq_len']} H={rec['heads']} "
            f"D={rec['head_dim']} causal={rec['causal']} rotate={rec['rotate']} "
            f"{rec['direction']}: ")
    if "error" in rec:
        return head + rec["error"]
    return head + (f"{rec['seconds'] * 1e3:.2f} ms, {rec['tokens_per_s'] / 1e3:.1f}k tokens/s, "
                   f"{rec['tflops_per_gpu']:.1f} TFLOP/s per GPU, "
                   f"peak {rec['peak_bytes'] / 2**30:.2f} GiB")


def main():
    args = parse_args()
    device = setup(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.seq_len % (2 * world):
        sys.exit(f"--seq_len {args.seq_len} must be a multiple of 2 * P = {2 * world}")
    mesh = init_device_mesh(device.type, (world,))
    set_rotate_method(args.rotate)
    # PyTorch's default causal load balancing (enable_load_balance=True) is "head-tail":
    # context_parallel() cuts the sequence into 2P chunks and gives rank r chunks r and
    # 2P-1-r, so each rank holds an equal share of the unmasked causal work;
    # context_parallel_unshard() restores the order. Ring attention refuses that layout
    # when not causal, so it is switched off there, as PyTorch's own tests do.
    _cp_options.enable_load_balance = args.causal
    with sdpa_kernel(BACKENDS[args.backend]):
        ok = world == 1 or check_against_sdpa(mesh, world, args, device)
        results = benchmark(mesh, world, args, device) if ok else {}
    if rank == 0:
        with open(args.out, "a") as f:
            for direction, result in results.items():
                rec = record(direction, result, world, args, device)
                print(describe(rec))
                f.write(json.dumps(rec) + "\n")
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
