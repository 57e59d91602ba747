#!/usr/bin/env python3
"""GPU time per call of a benchmark row, by kernel, from a tools/cupti_trace.cc trace.

  python3 tools/trace_per_call.py trace.csv CALLS [--top 30]

CALLS: how many times the row ran its op (cuda_dilated_attention_bench's calls_run counter,
the warm-up included), or with --last_bursts N the calls in the last N bursts of GPU work (the
benchmark's timed repetitions). Prints markdown: busy time per call, then each kernel (and copies and
sets) with its time and launches per call, the most expensive first. Two traces of two rows
printed side by side show where one row's time goes that the other's does not.
"""
import argparse
import csv
import re
from collections import defaultdict


def short_name(name):
    # The argument list goes; template arguments stay (they tell our elementwise kernels
    # apart), without the namespaces that repeat in them.
    name = re.sub(r"\)?\((?!anonymous).*$", "", name)
    name = re.sub(r"rd::kernels::cuda::|\(anonymous namespace\)::|cudnn::fusion::", "", name)
    return name[:160]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("trace")
    parser.add_argument("calls", type=float)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--last_bursts", type=int, default=0,
                        help="keep only the last N bursts of GPU work (CALLS counts their calls)")
    parser.add_argument("--burst_gap_ms", type=float, default=2.0)
    parser.add_argument("--timeline_ms", type=float, default=0,
                        help="also print the last this many ms, GPU and host, in order")
    args = parser.parse_args()
    time_ns, launches, idle_before = defaultdict(float), defaultdict(int), defaultdict(float)
    rows, api = [], []
    with open(args.trace) as f:
        for row in csv.reader(f):
            if not row or row[0] == "kind":
                continue
            if row[0] in ("runtime", "driver"):  # host calls (RD_CUPTI_API=1)
                api.append((int(row[1]), int(row[2]), row[-1]))
                continue
            name = short_name(row[-1]) if row[0] == "kernel" else row[0]
            rows.append((int(row[1]), int(row[2]), name))
    rows.sort()
    if args.last_bursts:
        # Bursts: runs of GPU work between idle gaps longer than --burst_gap_ms (the
        # benchmark's synchronizations). Only the last ones stay (not the warm-up call, with
        # its graph builds and lazy module loads), and the host calls from the first kept.
        starts = [0] + [i for i in range(1, len(rows))
                        if rows[i][0] - max(r[1] for r in rows[max(0, i - 64):i]) >
                        args.burst_gap_ms * 1e6]
        print(f"{len(starts)} bursts; keeping the last {args.last_bursts}")
        rows = rows[starts[-args.last_bursts]:]
        api = [a for a in api if a[0] >= rows[0][0] - args.burst_gap_ms * 1e6]
    if args.timeline_ms:
        print_timeline(rows, api, args.timeline_ms)
    busy, last_end = 0.0, None
    for start, end, name in rows:
        time_ns[name] += end - start
        launches[name] += 1
        busy += end - start
        if last_end is not None and start > last_end:
            idle_before[name] += start - last_end
        last_end = max(last_end or end, end)
    span = rows[-1][1] - rows[0][0] if rows else 0
    per_call = lambda ns: ns / args.calls / 1e6
    print(f"{args.calls:.0f} calls; per call: busy {per_call(busy):.3f} ms, span "
          f"{per_call(span):.3f} ms (the span includes the benchmark's own pauses)\n")
    print("| kernel | ms per call | launches per call | GPU idle before it, ms per call |")
    print("| --- | --- | --- | --- |")
    for name, ns in sorted(time_ns.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"| `{name}` | {per_call(ns):.3f} | {launches[name] / args.calls:.1f} | "
              f"{per_call(idle_before[name]):.3f} |")
    if api:
        print_host_calls(api, rows, args.calls, args.top)


def print_timeline(rows, api, window_ms):
    """The last window_ms of the trace in order: GPU work, the GPU's idle gaps over 5 us,
    and the host calls over 5 us, each with its start relative to the window's."""
    end = rows[-1][1]
    begin = end - window_ms * 1e6
    events, last_end = [], None
    for start, stop, name in rows:
        if last_end is not None and start - last_end > 5e3 and start >= begin:
            events.append((last_end, start, "GPU IDLE"))
        last_end = max(last_end or stop, stop)
        if start >= begin:
            events.append((start, stop, "gpu " + name))
    events += [(a, b, "host " + n) for a, b, n in api if a >= begin and b - a > 5e3]
    print(f"\n## The last {window_ms} ms\n")
    print("| start, us | duration, us | what |")
    print("| --- | --- | --- |")
    for start, stop, name in sorted(events):
        print(f"| {(start - begin) / 1e3:.1f} | {(stop - start) / 1e3:.1f} | {name[:110]} |")
    print()


def print_host_calls(api, rows, calls, top):
    """The host's API calls by total time, and the time each spent while the GPU sat idle."""
    idle = []  # the GPU's idle intervals, from the sorted activity rows
    last_end = None
    for start, end, _ in rows:
        if last_end is not None and start > last_end:
            idle.append((last_end, start))
        last_end = max(last_end or end, end)
    total, during_idle, count = defaultdict(float), defaultdict(float), defaultdict(int)
    api.sort()
    j = 0
    for start, end, name in api:
        total[name] += end - start
        count[name] += 1
        while j < len(idle) and idle[j][1] <= start:
            j += 1
        k = j
        while k < len(idle) and idle[k][0] < end:
            during_idle[name] += min(end, idle[k][1]) - max(start, idle[k][0])
            k += 1
    print("\n| host call | ms per call | calls per call | ms of it while the GPU idles |")
    print("| --- | --- | --- | --- |")
    for name, ns in sorted(total.items(), key=lambda kv: -kv[1])[:top]:
        print(f"| `{name}` | {ns / calls / 1e6:.3f} | {count[name] / calls:.1f} | "
              f"{during_idle[name] / calls / 1e6:.3f} |")


if __name__ == "__main__":
    main()
