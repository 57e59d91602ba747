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

from kernel_profile import idle_intervals, print_host_calls, read_trace, short_name


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
    all_rows, api = read_trace(args.trace)
    rows = [(start, end, short_name(name, 160)) for start, end, name, _ in all_rows]
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
        print_host_calls(api, rows, args.calls, "call", args.top)


def print_timeline(rows, api, window_ms):
    """The last window_ms of the trace in order: GPU work, the GPU's idle gaps over 5 us,
    and the host calls over 5 us, each with its start relative to the window's."""
    end = rows[-1][1]
    begin = end - window_ms * 1e6
    events = [(a, b, "GPU IDLE") for a, b in idle_intervals(rows) if b - a > 5e3 and b >= begin]
    events += [(a, b, "gpu " + n) for a, b, n in rows if a >= begin]
    events += [(a, b, "host " + n) for a, b, n in api if a >= begin and b - a > 5e3]
    print(f"\n## The last {window_ms} ms\n")
    print("| start, us | duration, us | what |")
    print("| --- | --- | --- |")
    for start, stop, name in sorted(events):
        print(f"| {(start - begin) / 1e3:.1f} | {(stop - start) / 1e3:.1f} | {name[:110]} |")
    print()


if __name__ == "__main__":
    main()
