#!/usr/bin/env python3
"""Where a training step's GPU time goes, from a tools/cupti_trace.cc trace.

  python3 tools/kernel_profile.py trace.csv [--steps 3] [--top 25]

A step ends with the optimizer's fused AdamW kernels (the last of each run of them); the
last --steps complete steps are averaged. Prints markdown: the step time, the time the GPU
was busy and idle (idle = waiting on the host: launches, syncs, allocation), the time per
kernel category, the most expensive kernels, and the kernels the GPU sat idle before; with
a trace recorded under RD_CUPTI_API=1, also the host's CUDA calls and how long each ran
while the GPU sat idle.
"""
import argparse
import csv
import re
import sys
from collections import defaultdict

# (category, pattern over the demangled kernel name); the first match wins, so the
# attention patterns come before the GEMM ones (cuDNN's SDPA kernels also say sm90).
CATEGORIES = [
    ("attention: cuDNN SDPA", r"sdpa|fmha|cudnn"),
    ("attention: ours (flash)", r"flash|grad_q_kernel|grad_kv_kernel|delta_kernel|add_dq_kernel"),
    ("attention: softmax path", r"softmax"),
    ("GEMM epilogue (ours)", r"gemm_epilogue"),
    ("GEMM (cuBLASLt)", r"gemm|nvjet|xmma|cutlass|cublas|sm\d\d_"),
    ("norms", r"norm_"),
    ("rotary", r"rotary"),
    ("SwiGLU", r"swiglu"),
    ("cross-entropy", r"cross_entropy"),
    ("optimizer (AdamW, multi-tensor)", r"adamw|multi_tensor|scale_kernel<|sum_squares_kernel"),
    ("reductions", r"reduce_|column_partials|cumsum"),
    ("elementwise / copies", r"grid_stride_kernel|elementwise|copy|strided"),
    ("memcpy", r"^memcpy"),
    ("memset", r"^memset"),
]


def category(name):
    for label, pattern in CATEGORIES:
        if re.search(pattern, name):
            return label
    return "other"


def short_name(name, width=150):
    """The kernel's name without namespaces or its parameter list, template arguments kept
    to three levels: enough to tell grid_stride_kernel<VectorBody<8, BinaryFn<kMul>, ...>> apart."""
    name = re.sub(r"\(anonymous namespace\)::|rd::kernels::cuda::|rd::kernels::|rd::|cutlass::", "", name)
    name = re.sub(r"^void ", "", name)
    depth, out = 0, []
    for ch in name:
        if ch == "(" and depth == 0:
            break  # the parameter list
        if ch == "<":
            depth += 1
            if depth <= 3:
                out.append("<")
            elif depth == 4:
                out.append("…")
            continue
        if ch == ">":
            depth -= 1
            if depth <= 2:
                out.append(">")
            continue
        if depth <= 3:
            out.append(ch)
    text = re.sub(r"\s+", " ", "".join(out))
    return text if len(text) <= width else text[: width - 1] + "…"


def read_trace(path):
    """The GPU's activities as sorted (start, end, name, bytes), and the host's CUDA calls
    (kinds runtime and driver, recorded under RD_CUPTI_API=1) as sorted (start, end, name)."""
    rows, host_calls = [], []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            if r["kind"] in ("runtime", "driver"):
                host_calls.append((int(r["start_ns"]), int(r["end_ns"]), r["name"]))
                continue
            name = r["name"] if r["kind"] == "kernel" else r["name"].split(" kind")[0]
            rows.append((int(r["start_ns"]), int(r["end_ns"]), name, int(r["bytes"])))
    rows.sort()
    host_calls.sort()
    return rows, host_calls


def idle_intervals(rows):
    """The intervals in which no activity of `rows` (sorted by start) runs."""
    idle, busy_until = [], None
    for start, end, *_ in rows:
        if busy_until is not None and start > busy_until:
            idle.append((busy_until, start))
        busy_until = end if busy_until is None else max(busy_until, end)
    return idle


def print_host_calls(host_calls, rows, divisor, unit, top):
    """The host's CUDA calls by total time per `unit` (total / divisor), with the part of
    each spent while the GPU sat idle: a call that blocks or runs long while the GPU waits is
    what the host was doing instead of queueing work."""
    idle = idle_intervals(rows)
    total, during_idle, count = defaultdict(float), defaultdict(float), defaultdict(int)
    first = 0
    for start, end, name in host_calls:
        total[name] += end - start
        count[name] += 1
        while first < len(idle) and idle[first][1] <= start:
            first += 1
        k = first
        while k < len(idle) and idle[k][0] < end:
            during_idle[name] += min(end, idle[k][1]) - max(start, idle[k][0])
            k += 1
    print(f"\n| host call (top {top}) | ms per {unit} | calls per {unit} | ms of it while the GPU idles |")
    print("| --- | ---: | ---: | ---: |")
    for name, ns in sorted(total.items(), key=lambda kv: -kv[1])[:top]:
        print(f"| `{name}` | {ns / divisor / 1e6:.3f} | {count[name] / divisor:.1f} | "
              f"{during_idle[name] / divisor / 1e6:.3f} |")


def step_ends(rows):
    """The end time of the last AdamW kernel of each run of them: one per optimizer step."""
    ends, in_run, last_end = [], False, None
    for start, end, name, _ in rows:
        is_adamw = "adamw" in name
        if is_adamw:
            in_run, last_end = True, end
        elif in_run:
            ends.append(last_end)
            in_run = False
    if in_run:
        ends.append(last_end)
    return ends


def busy_time(intervals):
    """The union of [start, end) intervals (kernels on other streams may overlap)."""
    total, cur_start, cur_end = 0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def idle_gaps(window, top, width=90):
    """Where the GPU waits: each gap in the busy timeline charged to the kernel that ends it
    (the work the host was late to queue), as (name, total ns, count), largest first."""
    gaps = defaultdict(lambda: [0, 0])
    busy_until = None
    for start, end, name, _ in window:  # sorted by start
        if busy_until is not None and start > busy_until:
            totals = gaps[short_name(name, width)]
            totals[0] += start - busy_until
            totals[1] += 1
        busy_until = end if busy_until is None else max(busy_until, end)
    return sorted(((n, t[0], t[1]) for n, t in gaps.items()), key=lambda g: -g[1])[:top]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--steps", type=int, default=3, help="complete steps to average (the last ones)")
    parser.add_argument("--top", type=int, default=25, help="kernels to list")
    parser.add_argument("--step_flops", type=float, default=0.0,
                        help="model FLOPs of one step (rd_train's count), for MFU lines")
    parser.add_argument("--peak_tflops", type=float, default=989.0)
    args = parser.parse_args()

    rows, host_calls = read_trace(args.trace)
    ends = step_ends(rows)
    if len(ends) < 2:
        sys.exit(f"kernel_profile: {args.trace} holds {len(ends)} optimizer steps; need at least 2")
    steps = min(args.steps, len(ends) - 1)
    window_start, window_end = ends[-steps - 1], ends[-1]
    window = [r for r in rows if r[0] >= window_start and r[1] <= window_end]
    span = (window_end - window_start) / steps
    busy = busy_time([(s, e) for s, e, _, _ in window]) / steps

    by_category = defaultdict(lambda: [0, 0])
    by_kernel = defaultdict(lambda: [0, 0])
    for start, end, name, _ in window:
        for totals in (by_category[category(name)], by_kernel[short_name(name)]):
            totals[0] += end - start
            totals[1] += 1

    ms = 1e-6
    print(f"Trace {args.trace}: the last {steps} of {len(ends)} steps.\n")
    print("| | ms per step | share of the step |")
    print("| --- | ---: | ---: |")
    print(f"| step (optimizer to optimizer) | {span * ms:.2f} | 100% |")
    print(f"| GPU busy | {busy * ms:.2f} | {100 * busy / span:.1f}% |")
    print(f"| GPU idle (waiting on the host) | {(span - busy) * ms:.2f} | {100 * (span - busy) / span:.1f}% |")
    if args.step_flops > 0:
        mfu = args.step_flops / (span * 1e-9) / (args.peak_tflops * 1e12)
        print(f"| MFU at this step time | | {100 * mfu:.1f}% |")
    print("\n| category | ms per step | share of the step | launches per step |")
    print("| --- | ---: | ---: | ---: |")
    for label, (ns, count) in sorted(by_category.items(), key=lambda kv: -kv[1][0]):
        print(f"| {label} | {ns / steps * ms:.2f} | {100 * ns / steps / span:.1f}% | {count / steps:.0f} |")
    print(f"\n| kernel (top {args.top}) | ms per step | share | launches per step | µs each |")
    print("| --- | ---: | ---: | ---: | ---: |")
    ranked = sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[: args.top]
    for name, (ns, count) in ranked:
        print(f"| `{name}` | {ns / steps * ms:.2f} | {100 * ns / steps / span:.1f}% | "
              f"{count / steps:.0f} | {ns / count / 1e3:.1f} |")
    print("\n| GPU idle before (top 10 kernels the GPU waited for) | ms per step | gaps per step |")
    print("| --- | ---: | ---: |")
    for name, ns, count in idle_gaps(window, 10):
        print(f"| `{name}` | {ns / steps * ms:.3f} | {count / steps:.0f} |")
    window_calls = [c for c in host_calls if window_start <= c[0] < window_end]
    if window_calls:
        print_host_calls(window_calls, window, steps, "step", args.top)


if __name__ == "__main__":
    main()
