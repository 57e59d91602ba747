#!/usr/bin/env python3
"""Markdown tables for docs/benchmarks.md from Google Benchmark JSON output.

Reads one or more files written with --benchmark_out=<file> --benchmark_out_format=json (or
--benchmark_format=json on stdout) by bench/cuda_ops_bench and prints, for each file, the
device and date from its context and one table per group of rows (ceiling, gemm,
elementwise, reduce, rowwise, fused, optim): time per call, throughput (GB/s, or TFLOP/s for
GEMM), the same run's ceiling, the ratio of the two, the issue's target and PASS/FAIL.

Counters it reads (set by cuda_ops_bench): bytes_per_second, flops, ceiling, ratio, target.

Rows of bench/cuda_dilated_attention_bench (groups dilated/fixed, dilated/original,
dense_ceiling, hilbert, mhda, target) get attention tables instead: time per call, tokens/s,
TFLOP/s, allocator peak, peak minus the bytes held before the call, the issue's memory bound
and peak / bound, from the counters tokens_per_s, tflops, peak_bytes, held_bytes,
peak_delta_bytes, bound_bytes, mem_ratio; target rows add ratio, target and target_max
(1: the ratio must be at most the target, else at least). Before them come two summaries:
original against fixed against the dense-SDPA ceiling (kAuto), and tokens/s per path.
With --benchmark_repetitions=N each figure is the median over the repetitions (computed from
the per-repetition rows, or taken from the "median" aggregate when only aggregates were
written) and the spread column gives (max - min) / median of the time, or the coefficient of
variation when only aggregates are there.

Usage: python3 bench/report.py cuda_ops.json [more.json ...] [--fail-on-miss] > tables.md
Python 3 standard library only.
"""

import argparse
import json
import re
import statistics
import sys

# Suffixes Google Benchmark appends to a registered name.
_SUFFIX = re.compile(
    r"^(manual_time|real_time|process_time|repeats:\d+|threads:\d+|iterations:\d+|"
    r"min_time:[0-9.e+-]+s?|min_warmup_time:[0-9.e+-]+s?)$")

_GROUP_TITLES = {
    "ceiling": "Ceilings measured in this run",
    "gemm": "GEMM: library against a bare cuBLASLt call",
    "elementwise": "Elementwise ops and dtype conversion",
    "reduce": "Reductions",
    "rowwise": "softmax and layer_norm, forward and backward",
    "fused": "Other fused ops (informational)",
    "optim": "Optimizer (informational)",
    "target": "Issue targets",
    "dilated/fixed": "Dilated attention, fixed variant (segment-local)",
    "dilated/original": "Dilated attention, original variant (global dilation, O(N^2))",
    "dense_ceiling": "Dense-SDPA ceiling: the same work as a packed batch through cuDNN",
    "hilbert": "use_hilbert on and off",
    "mhda": "MultiheadDilatedAttention (informational)",
}
# Groups whose rows carry attention counters (tokens_per_s, memory) rather than bandwidth.
_ATTENTION_GROUPS = ("target", "dilated/fixed", "dilated/original", "dense_ceiling", "hilbert",
                     "mhda")
_GROUP_ORDER = list(_GROUP_TITLES)

# Issue 3's targets, used only for rows written without a "target" counter (older output).
_FALLBACK_TARGETS = [
    (re.compile(r"^gemm/matmul/bf16/8192x8192x8192$"), 0.90),
    (re.compile(r"^(elementwise|reduce)/"), 0.80),
    (re.compile(r"^rowwise/(softmax|layer_norm)_(fwd|bwd)/"), 0.70),
]

_NUMERIC = ("real_time", "bytes_per_second", "flops", "ceiling", "ratio", "target", "target_max",
            "tokens_per_s", "tflops", "peak_bytes", "held_bytes", "peak_delta_bytes",
            "bound_bytes", "mem_ratio")

_TIME_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}


def base_name(entry):
    """The registered name: run_name (or name) without Google Benchmark's suffixes."""
    name = entry.get("run_name") or entry.get("name", "")
    parts = name.split("/")
    while len(parts) > 1 and _SUFFIX.match(parts[-1]):
        parts.pop()
    return "/".join(parts)


def group_of(name):
    parts = name.split("/")
    if parts[0] == "dilated" and len(parts) > 1:
        return "/".join(parts[:2])
    return parts[0]


class Row:
    """One benchmark's figures, the median over its repetitions."""

    def __init__(self, name):
        self.name = name
        self.label = ""
        self.values = {}  # numeric field -> value
        self.time_unit = "us"
        self.repetitions = 0
        self.spread = None  # relative spread of the time, or None
        self.spread_kind = ""  # "range" or "cv"
        self.error = None

    def target(self):
        target = self.values.get("target")
        if target:
            return target
        if "target" in self.values:  # written as 0: informational
            return None
        for pattern, value in _FALLBACK_TARGETS:
            if pattern.search(self.name):
                return value
        return None

    def is_gemm(self):
        return bool(self.values.get("flops"))

    def seconds(self):
        time = self.values.get("real_time")
        if time is None:
            return None
        return time * _TIME_UNIT_SECONDS.get(self.time_unit, 1e-9)

    def throughput(self):
        return self.values.get("flops") if self.is_gemm() else self.values.get("bytes_per_second")

    def verdict(self):
        target, ratio = self.target(), self.values.get("ratio")
        if self.error:
            return "SKIPPED"
        if target is None or ratio is None:
            return "-"
        if self.at_most():
            return "PASS" if ratio <= target else "FAIL"
        return "PASS" if ratio >= target else "FAIL"

    def is_targeted(self):
        """Has a target; a skipped row of the "target" group counts too (as a miss)."""
        return self.target() is not None or (bool(self.error) and
                                              group_of(self.name) == "target")

    def at_most(self):
        """Whether the ratio must stay at or below the target (memory, time ratios)."""
        return bool(self.values.get("target_max"))

    def is_attention(self):
        return group_of(self.name) in _ATTENTION_GROUPS


def collect_rows(benchmarks):
    """Groups the JSON entries by benchmark and reduces each group to one Row."""
    iterations, aggregates, order = {}, {}, []
    for entry in benchmarks:
        name = base_name(entry)
        if name not in iterations:
            iterations[name], aggregates[name] = [], {}
            order.append(name)
        if entry.get("run_type") == "aggregate":
            aggregates[name][entry.get("aggregate_name", "")] = entry
        else:
            iterations[name].append(entry)
    rows = []
    for name in order:
        rows.append(make_row(name, iterations[name], aggregates[name]))
    return rows


def make_row(name, runs, aggregates):
    row = Row(name)
    source = runs or list(aggregates.values())
    if not source:
        return row
    first = source[0]
    row.label = first.get("label", "")
    row.time_unit = first.get("time_unit", "ns")
    errors = [e for e in source if e.get("error_occurred")]
    if errors:
        row.error = errors[0].get("error_message", "error")
        return row
    if runs:
        row.repetitions = len(runs)
        for field in _NUMERIC:
            values = [r[field] for r in runs if isinstance(r.get(field), (int, float))]
            if values:
                row.values[field] = statistics.median(values)
        times = [r["real_time"] for r in runs if isinstance(r.get("real_time"), (int, float))]
        if len(times) > 1 and statistics.median(times) > 0:
            row.spread = (max(times) - min(times)) / statistics.median(times)
            row.spread_kind = "range"
    else:
        chosen = aggregates.get("median") or aggregates.get("mean") or first
        row.repetitions = int(chosen.get("repetitions", 0) or 0)
        for field in _NUMERIC:
            if isinstance(chosen.get(field), (int, float)):
                row.values[field] = chosen[field]
        cv = aggregates.get("cv")
        if cv and isinstance(cv.get("real_time"), (int, float)):
            # The cv aggregate of a time is reported as a plain fraction.
            row.spread = cv["real_time"]
            row.spread_kind = "cv"
    return row


def format_time(seconds):
    if seconds is None:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    if seconds < 1.0:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds:.3f} s"


def format_rate(value, gemm):
    if value is None:
        return "-"
    if gemm:
        return f"{value / 1e12:.1f} TFLOP/s"
    return f"{value / 1e9:.0f} GB/s"


def format_ratio(value):
    return "-" if value is None else f"{value:.3f}"


def escape(text):
    return str(text).replace("|", "\\|")


def print_context(context, path, out):
    device = context.get("cuda_device", "unknown device")
    out.write(f"## {escape(device)}, {context.get('date', 'unknown date')}\n\n")
    facts = [
        ("source", path),
        ("host", context.get("host_name")),
        ("compute capability", context.get("cuda_compute_capability")),
        ("SMs", context.get("cuda_sm_count")),
        ("memory (GiB)", context.get("cuda_memory_gib")),
        ("L2 (MiB)", context.get("cuda_l2_mib")),
        ("driver", context.get("cuda_driver")),
        ("CUDA runtime", context.get("cuda_runtime")),
        ("cuBLASLt", context.get("cublaslt_version")),
        ("cuDNN", context.get("cudnn_version")),
        ("command", context.get("command")),
        ("Google Benchmark library build", context.get("library_build_type")),
    ]
    out.write(", ".join(f"{k}: {escape(v)}" for k, v in facts if v not in (None, "")) + "\n\n")


def format_bytes(value):
    return "-" if value is None else f"{value / 2**30:.2f} GiB"


def format_tokens(value):
    if value is None:
        return "-"
    if value >= 1e9:
        return f"{value / 1e9:.2f} G/s"
    if value >= 1e6:
        return f"{value / 1e6:.2f} M/s"
    return f"{value / 1e3:.1f} k/s"


def format_target(row):
    target = row.target()
    if target is None:
        return "-"
    return f"{'≤' if row.at_most() else '≥'} {target:.2f}"


def print_attention_group(group, rows, out):
    """One table of dilated-attention rows: speed, memory and, on target rows, the verdict."""
    out.write(f"### {escape(_GROUP_TITLES.get(group, group))}\n\n")
    out.write("| benchmark | path / note | time | tokens/s | TFLOP/s | peak | peak − held | "
              "bound | peak / bound | ratio | target | result |\n")
    out.write("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |\n")
    for row in rows:
        if row.error:
            out.write(f"| {escape(row.name)} | {escape(row.label)} | - | - | - | - | - | - | - | "
                      f"- | {format_target(row)} | SKIPPED: {escape(row.error)} |\n")
            continue
        v = row.values
        tflops = v.get("tflops")
        out.write(
            f"| {escape(row.name)} | {escape(row.label)} | {format_time(row.seconds())} | "
            f"{format_tokens(v.get('tokens_per_s'))} | "
            f"{'-' if tflops is None else f'{tflops:.1f}'} | "
            f"{format_bytes(v.get('peak_bytes'))} | {format_bytes(v.get('peak_delta_bytes'))} | "
            f"{format_bytes(v.get('bound_bytes'))} | {format_ratio(v.get('mem_ratio'))} | "
            f"{format_ratio(v.get('ratio'))} | {format_target(row)} | {row.verdict()} |\n")
    out.write("\n")


def dilated_key(name):
    """(direction, heads, N, mask, path, variant) of a dilated/ or dense_ceiling/ row, or None.

    dilated/<variant>/<dir>/<HxDy>/N<n>/<mask>/<path>; dense_ceiling/<dir>/<HxDy>/N<n>/<mask>/
    <path> (variant "ceiling")."""
    parts = name.split("/")
    if parts[0] == "dilated" and len(parts) == 7:
        variant, direction, heads, n, mask, path = parts[1:]
    elif parts[0] == "dense_ceiling" and len(parts) == 6:
        variant = "ceiling"
        direction, heads, n, mask, path = parts[1:]
    else:
        return None
    if not n.startswith("N") or not n[1:].isdigit():
        return None
    return direction, heads, int(n[1:]), mask, path, variant


def format_cell(row):
    if row is None:
        return "-"
    if row.error:
        return "time cap" if row.error.startswith("time cap") else (
            "OOM" if row.error.startswith("out of memory") else "skipped")
    return format_tokens(row.values.get("tokens_per_s"))


def speedup(a, b):
    """a's tokens/s over b's, when both ran."""
    if a is None or b is None or a.error or b.error:
        return "-"
    ta, tb = a.values.get("tokens_per_s"), b.values.get("tokens_per_s")
    return "-" if not ta or not tb else f"{ta / tb:.2f}x"


def print_dilated_summaries(rows, out):
    """Pivot tables over the dilated and ceiling rows: variants (kAuto) and paths."""
    keyed = {}
    for row in rows:
        key = dilated_key(row.name)
        if key is not None:
            keyed[key] = row
    if not keyed:
        return
    shapes = sorted({k[:4] for k in keyed}, key=lambda k: (k[0], k[1], k[3], k[2]))
    out.write("### Summary: original vs fixed vs the dense-SDPA ceiling (kAuto, tokens/s)\n\n")
    out.write("| direction | heads | N | mask | fixed | original | fixed / original | ceiling | "
              "fixed / ceiling | fixed peak | original peak |\n")
    out.write("| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n")
    for shape in shapes:
        fixed = keyed.get(shape + ("auto", "fixed"))
        original = keyed.get(shape + ("auto", "original"))
        ceiling = keyed.get(shape + ("cudnn", "ceiling"))
        if fixed is None and original is None:
            continue
        peak = lambda r: "-" if r is None or r.error else format_bytes(r.values.get("peak_bytes"))
        direction, heads, n, mask = shape
        out.write(f"| {direction} | {heads} | {n} | {mask} | {format_cell(fixed)} | "
                  f"{format_cell(original)} | {speedup(fixed, original)} | "
                  f"{format_cell(ceiling)} | {speedup(fixed, ceiling)} | {peak(fixed)} | "
                  f"{peak(original)} |\n")
    out.write("\n")
    paths = ("auto", "cudnn", "flash", "math")
    for variant in ("fixed", "original"):
        present = [s for s in shapes if any(s + (p, variant) in keyed for p in paths)]
        if not present:
            continue
        out.write(f"### Summary: {variant} variant per path (tokens/s; path taken in the "
                  "detailed table)\n\n")
        out.write("| direction | heads | N | mask | " + " | ".join(paths) + " |\n")
        out.write("| --- | --- | ---: | --- |" + " ---: |" * len(paths) + "\n")
        for shape in present:
            cells = " | ".join(format_cell(keyed.get(shape + (p, variant))) for p in paths)
            direction, heads, n, mask = shape
            out.write(f"| {direction} | {heads} | {n} | {mask} | {cells} |\n")
        out.write("\n")


def print_group(group, rows, out):
    if group in _ATTENTION_GROUPS:
        print_attention_group(group, rows, out)
        return
    title = _GROUP_TITLES.get(group, group)
    targets = sorted({t for t in (r.target() for r in rows) if t is not None})
    if targets:
        title += " (target: ratio ≥ " + ", ".join(f"{t:.2f}" for t in targets) + ")"
    out.write(f"### {escape(title)}\n\n")
    out.write("| benchmark | shape | time | throughput | ceiling | ratio | target | result | "
              "spread |\n")
    out.write("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |\n")
    for row in rows:
        if row.error:
            out.write(f"| {escape(row.name)} | {escape(row.label)} | - | - | - | - | - | "
                      f"SKIPPED: {escape(row.error)} | - |\n")
            continue
        gemm = row.is_gemm()
        target = row.target()
        spread = "-" if row.spread is None else f"{row.spread * 100:.1f}%"
        out.write(
            f"| {escape(row.name)} | {escape(row.label)} | {format_time(row.seconds())} | "
            f"{format_rate(row.throughput(), gemm)} | "
            f"{format_rate(row.values.get('ceiling'), gemm)} | "
            f"{format_ratio(row.values.get('ratio'))} | "
            f"{'-' if target is None else f'{target:.2f}'} | {row.verdict()} | {spread} |\n")
    out.write("\n")


def report(path, data, out):
    """Prints one file's section; returns (targeted rows, rows that missed or were skipped)."""
    print_context(data.get("context", {}), path, out)
    rows = collect_rows(data.get("benchmarks", []))
    groups = {}
    for row in rows:
        groups.setdefault(group_of(row.name), []).append(row)
    ordered = [g for g in _GROUP_ORDER if g in groups]
    ordered += [g for g in groups if g not in _GROUP_ORDER]
    targeted = [r for r in rows if r.is_targeted()]
    passed = [r for r in targeted if r.verdict() == "PASS"]
    misses = [r for r in targeted if r.verdict() != "PASS"]
    out.write(f"Targets met: {len(passed)} of {len(targeted)} rows")
    per_group = []
    for group in ordered:
        group_targeted = [r for r in groups[group] if r.is_targeted()]
        if group_targeted:
            ok = sum(r.verdict() == "PASS" for r in group_targeted)
            per_group.append(f"{group} {ok}/{len(group_targeted)}")
    if per_group:
        out.write(" (" + ", ".join(per_group) + ")")
    out.write(".")
    repetitions = max((r.repetitions for r in rows), default=0)
    if repetitions > 1:
        out.write(f" Figures are medians of {repetitions} repetitions.")
    if any(not r.is_attention() for r in rows):
        out.write(" Ratios compare with ceilings measured in the same run: the device-to-device "
                  "copy bandwidth (bytes read + written), or for GEMM a bare cublasLtMatmul of "
                  "the same shape with the heuristic's first algorithm and a 32 MiB workspace.")
    if any(r.is_attention() for r in rows):
        out.write(" Attention rows: B = 1, bf16; time per call from CUDA events; peak is the "
                  "caching allocator's high-water mark during one call (held inputs included); "
                  "bound = inputs + outputs (+ their gradients for fwdbwd) + LSE.")
    out.write("\n\n")
    print_dilated_summaries(rows, out)
    for group in ordered:
        print_group(group, groups[group], out)
    return len(targeted), len(misses)


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="Google Benchmark JSON output files")
    parser.add_argument("--fail-on-miss", action="store_true",
                        help="exit with status 1 when a targeted row misses or was skipped")
    args = parser.parse_args(argv)
    out = sys.stdout
    total_misses = 0
    for path in args.files:
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as error:
            print(f"report.py: cannot read {path}: {error}", file=sys.stderr)
            return 2
        _, misses = report(path, data, out)
        total_misses += misses
    return 1 if args.fail_on_miss and total_misses else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
