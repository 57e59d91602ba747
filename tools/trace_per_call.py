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
from collections import defaultdict

from kernel_profile import (busy_time, idle_gaps, idle_intervals, print_host_calls, read_trace,
                            short_name)

kWidth = 160  # characters of a kernel's name kept


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
    rows, api = read_trace(args.trace)  # rows: (start, end, name, bytes), sorted
    if args.last_bursts:
        # Bursts: runs of GPU work between idle gaps longer than --burst_gap_ms (the
        # benchmark's synchronizations). Only the last ones stay (not the warm-up call, with
        # its graph builds and lazy module loads), and the host calls from the first kept.
        burst_starts = [rows[0][0]] + [b for a, b in idle_intervals(rows)
                                       if b - a > args.burst_gap_ms * 1e6]
        print(f"{len(burst_starts)} bursts; keeping the last {args.last_bursts}")
        first = burst_starts[-args.last_bursts]
        rows = [r for r in rows if r[0] >= first]
        api = [a for a in api if a[0] >= first - args.burst_gap_ms * 1e6]
    if args.timeline_ms:
        print_timeline(rows, api, args.timeline_ms)
    time_ns, launches = defaultdict(float), defaultdict(int)
    for start, end, name, _ in rows:
        time_ns[short_name(name, kWidth)] += end - start
        launches[short_name(name, kWidth)] += 1
    idle_before = {name: ns for name, ns, _ in idle_gaps(rows, len(rows), kWidth)}
    span = rows[-1][1] - rows[0][0] if rows else 0
    per_call = lambda ns: ns / args.calls / 1e6
    print(f"{args.calls:.0f} calls; per call: busy {per_call(busy_time((s, e) for s, e, _, _ in rows)):.3f} ms, span "
          f"{per_call(span):.3f} ms (the span includes the benchmark's own pauses)\n")
    print("| kernel | ms per call | launches per call | GPU idle before it, ms per call |")
    print("| --- | --- | --- | --- |")
    for name, ns in sorted(time_ns.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"| `{name}` | {per_call(ns):.3f} | {launches[name] / args.calls:.1f} | "
              f"{per_call(idle_before.get(name, 0)):.3f} |")
    if api:
        print_host_calls(api, rows, args.calls, "call", args.top)


def print_timeline(rows, api, window_ms):
    """The last window_ms of the trace in order: GPU work, the GPU's idle gaps over 5 us,
    and the host calls over 5 us, each with its start relative to the window's."""
    end = rows[-1][1]
    begin = end - window_ms * 1e6
    events = [(a, b, "GPU IDLE") for a, b in idle_intervals(rows) if b - a > 5e3 and b >= begin]
    events += [(a, b, "gpu " + short_name(n, kWidth)) for a, b, n, _ in rows if a >= begin]
    events += [(a, b, "host " + n) for a, b, n in api if a >= begin and b - a > 5e3]
    print(f"\n## The last {window_ms} ms\n")
    print("| start, us | duration, us | what |")
    print("| --- | --- | --- |")
    for start, stop, name in sorted(events):
        print(f"| {(start - begin) / 1e3:.1f} | {(stop - start) / 1e3:.1f} | {name[:110]} |")
    print()


if __name__ == "__main__":
    main()
