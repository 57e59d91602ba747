#!/usr/bin/env python3
"""PNG plots with matplotlib: training metrics of rd_train runs, and the benchmark plots of
docs/benchmarks.md.

  rdplot.py metrics RUN/metrics.jsonl [more.jsonl ...] -o OUT_DIR [--smooth K]
      Each file holds one JSON object a line with at least "step", "time_s", "split"
      ("train" or "eval") and "loss"; "exact_match", "accuracy", "bits_per_byte", "lr" and
      "tokens_per_s" are optional. Writes loss.png and, where any record has them,
      accuracy.png (held-out exact match, the headline of tasks with answers, and
      answer-token accuracy), bits_per_byte.png (held-out bits per byte of text runs),
      lr.png and tokens_per_s.png: each against steps (left) and wall time (right), every
      run one colour (named after the file's folder), train solid, eval dashed with
      markers; where a figure holds two metrics the second is dotted with other markers.
      --smooth K draws train curves as a moving average over K records.

  rdplot.py bench BENCH.json [more.json ...] -o OUT_DIR
      Google Benchmark JSON of bench/cuda_dilated_attention_bench (dilated/..., dense_ceiling/
      rows, read through bench/report.py), of bench/cuda_ring_attention_bench (ring/... rows)
      and of bench/cuda_multi_gpu_bench (strong/..., strong_causal/... and weak/... rows).
      Writes:
        dilated_tokens_<fwd|fwdbwd>_<H12D64|H16D128>.png  tokens/s against N: fixed and
            original variant (kAuto) and the dense-SDPA ceiling;
        dilated_paths_<fwd|fwdbwd>_H16D128.png  the fixed variant per path;
        dilated_memory_fwdbwd_H16D128.png  allocator peak against the issue's bound;
        ring_tokens_<fwd|fwdbwd>_<HxDy>_P<p>.png  each strategy and the single device;
        strong_scaling_<N>.png  parallel efficiency against GPUs (1, 2, 4): non-causal,
            causal contiguous and causal zigzag, against the ideal 100%;
        weak_scaling.png  N = P x 1M: efficiency by work (attended pairs/s per GPU) and by
            time against GPUs, against the ideal 100%.
      Both axes logarithmic (strong scaling: GPUs log 2, efficiency linear); non-causal solid,
      causal dashed. A line ends at its last row that ran; the note under the title says where
      and why. Dilated rows of several files merge (a later row replacing an earlier one of the
      same name); they must come from one device. Ring and strong-scaling rows are drawn per
      file, as each file is one run on one device and date: two files holding the same
      figure write the same PNG (the later one is left, with a warning), so plot one run per
      output folder.

Needs matplotlib (Debian: python3-matplotlib, installed by ./rd setup).
"""

import argparse
import json
import math
import os
import re
import statistics
import sys
import textwrap
from dataclasses import dataclass, field

sys.dont_write_bytecode = True  # no __pycache__ left in the source tree
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import report  # noqa: E402  bench/report.py: collect_rows, dilated_key, format_cell

try:
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib import ticker
except ImportError:  # reported by main(), so that --help still works
    plt = None

FIG_SIZE = (8.0, 5.0)  # inches
METRICS_FIG_SIZE = (11.0, 4.2)
DPI = 110
NOTE_WIDTH = 110  # characters per note line under a title
PNG_METADATA = {"Software": None}  # no version string: regenerated plots stay byte-stable

# Okabe-Ito colours (readable with the common colour-vision deficiencies), then more.
PALETTE = ["#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000",
           "#F0E442", "#999999"]


# ============================================================================ metrics

REQUIRED_FIELDS = ("step", "time_s", "split", "loss")


@dataclass(frozen=True)
class Series:
    """One metric of a metrics figure: its record key and the words of its legend entry."""
    key: str
    label: str


@dataclass(frozen=True)
class MetricsFigure:
    """One PNG of `cmd_metrics`: file stem, y-axis label, the metrics it draws."""
    stem: str
    y_label: str
    series: tuple


# Every figure rd_train's records can fill, in order; one is drawn where any record has one
# of its keys. rd_train writes "accuracy" (answer tokens right) and "exact_match" (samples
# with every answer token right, the headline of tasks with answers) in evaluations of
# tasks, and "bits_per_byte" in evaluations of byte-level text.
METRICS_FIGURES = (
    MetricsFigure("loss", "loss", (Series("loss", "loss"),)),
    MetricsFigure("accuracy", "held-out accuracy",
                  (Series("exact_match", "exact match (every answer token right)"),
                   Series("accuracy", "answer-token accuracy"))),
    MetricsFigure("bits_per_byte", "held-out bits per byte",
                  (Series("bits_per_byte", "bits per byte"),)),
    MetricsFigure("lr", "learning rate", (Series("lr", "learning rate"),)),
    MetricsFigure("tokens_per_s", "tokens per second", (Series("tokens_per_s", "tokens per second"),)),
)
SPLITS = {"train": dict(linestyle="-", marker=None), "eval": dict(linestyle="--", marker="o")}
# The second metric of a figure (answer-token accuracy beside exact match).
SECOND_SERIES = {"train": dict(linestyle=":", marker=None), "eval": dict(linestyle=":", marker="s")}


@dataclass
class Run:
    name: str
    records: list  # dicts, in file order


def load_run(path):
    """The records of one metrics file; ValueError naming file and line when one is bad."""
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not JSON ({error.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{number}: not a JSON object")
            missing = [key for key in REQUIRED_FIELDS if key not in record]
            if missing:
                raise ValueError(f"{path}:{number}: missing {', '.join(missing)}")
            if record["split"] not in SPLITS:
                raise ValueError(f"{path}:{number}: split {record['split']!r} is not "
                                 f"{' or '.join(SPLITS)}")
            records.append(record)
    if not records:
        raise ValueError(f"{path}: no records")
    return records


def run_names(paths):
    """The folder of each file, made unique with the file's name where folders repeat."""
    folders = [os.path.basename(os.path.dirname(os.path.abspath(p))) for p in paths]
    names = []
    for path, folder in zip(paths, folders):
        stem = os.path.splitext(os.path.basename(path))[0]
        names.append(folder if folders.count(folder) == 1 else f"{folder}/{stem}")
    return names


def moving_average(values, window):
    """Mean of the last `window` values at each point (fewer at the start)."""
    if window <= 1:
        return values
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def metrics_figures(runs):
    """The MetricsFigures the runs' records fill, each with only the series present."""
    present = {key for run in runs for r in run.records for key in r}
    figures = []
    for figure in METRICS_FIGURES:
        series = tuple(s for s in figure.series if s.key in present)
        if series:
            figures.append(MetricsFigure(figure.stem, figure.y_label, series))
    return figures


def series_label(run, series, split, figure):
    """"run (eval)" where the figure draws one metric, "run: metric (eval)" where several."""
    if len(figure.series) == 1:
        return f"{run.name} ({split})"
    return f"{run.name}: {series.label} ({split})"


def metrics_figure(runs, figure, smooth):
    """One figure: its metrics against steps on the left, against wall time on the right."""
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=METRICS_FIG_SIZE, dpi=DPI)
    for index, run in enumerate(runs):
        color = PALETTE[index % len(PALETTE)]
        for number, series in enumerate(figure.series):
            for split, style in (SPLITS if number == 0 else SECOND_SERIES).items():
                points = [r for r in run.records
                          if r["split"] == split and isinstance(r.get(series.key), (int, float))]
                if not points:
                    continue
                values = [r[series.key] for r in points]
                if split == "train":
                    values = moving_average(values, smooth)
                for axes, x_key in ((by_step, "step"), (by_time, "time_s")):
                    axes.plot([r[x_key] for r in points], values, color=color,
                              label=series_label(run, series, split, figure), markersize=4,
                              **style)
    for axes, x_label in ((by_step, "step"), (by_time, "wall time (s)")):
        axes.set_xlabel(x_label)
        axes.set_ylabel(figure.y_label)
        axes.grid(True, color="#dddddd")
    by_time.legend(fontsize="small", loc="best")
    title = figure.y_label
    if len(figure.series) > 1:
        title += ": " + ", ".join(s.label for s in figure.series)
    if smooth > 1:
        title += f" (train: moving average over {smooth} records)"
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def cmd_metrics(args):
    runs = [Run(name, load_run(path)) for name, path in zip(run_names(args.files), args.files)]
    os.makedirs(args.out_dir, exist_ok=True)
    for figure in metrics_figures(runs):
        fig = metrics_figure(runs, figure, args.smooth)
        save(fig, os.path.join(args.out_dir, f"{figure.stem}.png"))
    return 0


# ============================================================================ bench


@dataclass(frozen=True)
class Style:
    """How one line is drawn; colour, marker and dash each keep lines apart in grayscale too."""
    label: str
    color: str
    marker: str = ""  # a matplotlib marker, "" for none
    dash: str = "-"
    width: float = 2.0


VARIANT_STYLES = {
    "fixed": Style("fixed, kAuto", "#0072B2", "o"),
    "original": Style("original, kAuto", "#D55E00", "s"),
    "ceiling": Style("dense-SDPA ceiling (cuDNN)", "#000000", "^"),
}
PATH_STYLES = {
    # Wide and drawn first: kAuto mostly takes cuDNN, whose line then runs along its middle.
    "auto": Style("kAuto", "#56B4E9", "o", width=5.0),
    "cudnn": Style("kCudnn", "#009E73", "^"),
    "flash": Style("kFlash", "#E69F00", "D"),
    "math": Style("kMath", "#CC79A7", "s"),
}
STRATEGY_STYLES = {
    "single": Style("one device", "#000000", "^"),
    "ring": Style("ring", "#0072B2", "o"),
    "all_gather": Style("all-gather", "#D55E00", "s"),
    "auto": Style("auto", "#009E73", "D", dash="--"),
}
MASK_DASHES = {"dense": "-", "causal": "--"}
MASK_NAMES = {"dense": "non-causal", "causal": "causal"}
BOUND_STYLE = Style("memory bound", "#222222", dash=":")
DIRECTION_NAMES = {"fwd": "forward", "fwdbwd": "forward + backward"}
HEAD_CONFIGS = ("H12D64", "H16D128")
RING_ROW = re.compile(r"ring/(fwd|fwdbwd)/(\w+)/P(\d+)/(H\d+D\d+)/N(\d+)")
# strong/P<p>/N<n> (non-causal) and strong_causal/<layout>/P<p>/N<n>, without Google
# Benchmark's suffixes (report.base_name strips /iterations:1/manual_time).
STRONG_ROW = re.compile(r"strong(?:_causal/(contiguous|zigzag))?/P(\d+)/N(\d+)$")
STRONG_STYLES = {  # keyed by layout; "none" is the non-causal strong/ row
    "none": Style("non-causal", "#0072B2", "o"),
    "contiguous": Style("causal contiguous", "#D55E00", "s", dash="--"),
    "zigzag": Style("causal zigzag", "#009E73", "D", dash="--"),
}
IDEAL_STYLE = Style("ideal (100%)", "#222222", dash=":", width=1.5)
# weak/P<p>/N<n>: P GPUs at N = P x 1M. Two efficiencies per row: by time, and by work
# (attended pairs per second per GPU), which is the fair one when a pair spans the sequence.
WEAK_ROW = re.compile(r"weak/P(\d+)/N(\d+)$")
WEAK_STYLES = {  # keyed by the row's counter
    "work_efficiency": Style("by work: attended pairs/s per GPU", "#0072B2", "o"),
    "efficiency": Style("by time: T(1 GPU, 1M) / T(P, P x 1M)", "#D55E00", "s", dash="--"),
}
# What bench/cuda_multi_gpu_bench runs in its strong rows (its header comment): the JSON
# holds none of it, so the subtitle states it here.
STRONG_CONFIG = ("bf16, B = 1, H = 16, D = 128, pairs (2048,1), (16384,4), (262144,16), (N,64), "
                 "forward + backward")


@dataclass
class Series:
    """One line: (N, value) points by N, and why it stops before the axis does (if it does)."""
    name: str  # as in the legend
    mask: str
    style: Style
    points: list
    stop_reason: str = ""  # "" when no row of the family is in the input


@dataclass
class Figure:
    file_name: str
    title: str
    subtitle: str
    notes: list  # sentences under the subtitle
    y_label: str
    y_format: object  # value -> tick label
    x_values: list  # every N of the shape, the x ticks
    series: list
    legend_masks: bool = True  # add the solid / dashed key
    x_axis: str = "n"  # "n": N on log axes (render_log_axes); "gpus": see render_gpu_axes


@dataclass
class Source:
    """Merged dilated rows (keyed by report.dilated_key) and the raw ring rows."""
    device: str = "unknown device"
    date: str = "unknown date"
    rows: dict = field(default_factory=dict)
    ring: list = field(default_factory=list)  # (context, benchmark entries) per file
    strong: list = field(default_factory=list)  # the same, files with strong-scaling rows
    weak: list = field(default_factory=list)  # the same, files with weak-scaling rows


def load_bench(paths):
    """Reads the files; ValueError when the dilated rows come from different devices."""
    source, devices, dates = Source(), [], []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        context = data.get("context", {})
        entries = data.get("benchmarks", [])
        if any(RING_ROW.match(e.get("name", "")) for e in entries):
            source.ring.append((context, entries))
        if any(STRONG_ROW.match(report.base_name(e)) for e in entries):
            source.strong.append((context, entries))
        if any(WEAK_ROW.match(report.base_name(e)) for e in entries):
            source.weak.append((context, entries))
        dilated = {}
        for row in report.collect_rows(entries):
            key = report.dilated_key(row.name)
            if key is not None:
                dilated[key] = row
        if dilated:
            device = context.get("cuda_device", "unknown device")
            date = context.get("date", "unknown date")[:10]
            devices += [device] if device not in devices else []
            dates += [date] if date not in dates else []
            source.rows.update(dilated)
    if len(devices) > 1:
        raise ValueError(f"the dilated rows come from different devices ({', '.join(devices)});"
                         " plot one device at a time")
    if devices:
        source.device, source.date = devices[0], ", ".join(dates)
    return source


# ---------------------------------------------------------------------------- formats


def format_n(n):
    """8192 -> 8K, 1048576 -> 1M (binary multiples, as the benchmark's N are)."""
    for unit, scale in (("M", 2**20), ("K", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def format_rate(value):
    """1e7 -> 10M/s; decimal prefixes, as report.py's tokens/s."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:g}{unit}/s"
    return f"{value:g}/s"


def format_percent(value):
    """0.935 -> 93.5%, 1.0 -> 100%."""
    return f"{round(value * 100, 1):g}%"


def format_bytes(value):
    """2**28 -> 256 MiB, 2**34 -> 16 GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= scale:
            return f"{value / scale:g} {unit}"
    return f"{value:g} B"


# ---------------------------------------------------------------------------- dilated figures


def shape_ns(source, direction, heads):
    """Every N with a row (run or not) for this direction and head config."""
    return sorted({key[2] for key in source.rows if key[:2] == (direction, heads)})


def stop_reason(row):
    """Why a row did not run, in a few words."""
    if row is None:
        return "no larger N registered"
    cell = report.format_cell(row)  # "time cap", "OOM" or "skipped"
    cap = re.search(r"> ([0-9.]+) s", row.error)
    if cell == "time cap":
        return f"a call would pass the {cap.group(1) + ' s ' if cap else ''}time cap"
    return {"OOM": "out of memory"}.get(cell, f"skipped: {row.error}")


def make_series(source, direction, heads, mask, path, variant, counter, style):
    """The line of one row family; counter is the value plotted ("tokens_per_s", ...)."""
    family = sorted((key[2], row) for key, row in source.rows.items()
                    if key[:2] == (direction, heads) and key[3:] == (mask, path, variant))
    points = [(n, row.values[counter]) for n, row in family
              if not row.error and row.values.get(counter)]
    last_n = points[-1][0] if points else 0
    first_failed = next((row for n, row in family if n > last_n), None)
    reason = stop_reason(first_failed) if family else ""
    dash = style.dash if style.dash != "-" else MASK_DASHES[mask]  # a reference keeps its own
    styled = Style(style.label, style.color, style.marker, dash, style.width)
    return Series(style.label, mask, styled, points, reason)


def end_notes(series, n_max):
    """One sentence per line name that stops before n_max: after which N per mask, and why."""
    by_name = {}  # name -> reason -> last N (0: none ran) -> masks
    for s in series:
        last_n = s.points[-1][0] if s.points else 0
        if last_n < n_max and s.stop_reason:
            by_reason = by_name.setdefault(s.name, {})
            by_reason.setdefault(s.stop_reason, {}).setdefault(last_n, []).append(
                MASK_NAMES[s.mask])
    notes = []
    for name, by_reason in by_name.items():
        stops = [", ".join(f"{' and '.join(masks)} "
                           f"{'after ' + format_n(n) if n else 'at every N'}"
                           for n, masks in ends.items()) + f" ({reason})"
                 for reason, ends in by_reason.items()]
        notes.append(f"{name} stops: {'; '.join(stops)}.")
    return notes


def ratio_note(source, direction, heads, variants):
    """The range of peak / bound (counter mem_ratio) of each variant's kAuto rows."""
    parts = []
    for variant in variants:
        ratios = [row.values["mem_ratio"] for key, row in source.rows.items()
                  if key[:2] == (direction, heads) and key[4:] == ("auto", variant)
                  and not row.error and row.values.get("mem_ratio")]
        if ratios:
            parts.append(f"{variant} {min(ratios):.2f} to {max(ratios):.2f}")
    return [f"Peak / bound: {', '.join(parts)}."] if parts else []


def heads_text(heads):
    """H16D128 -> "H = 16, D = 128"."""
    match = re.fullmatch(r"H(\d+)D(\d+)", heads)
    return f"H = {match.group(1)}, D = {match.group(2)}" if match else heads


def dilated_subtitle(source):
    return f"{source.device}, {source.date}; bf16, batch B = 1"


def tokens_figure(source, direction, heads):
    """Fixed and original (kAuto) against the dense-SDPA ceiling."""
    series = [make_series(source, direction, heads, mask,
                          "cudnn" if variant == "ceiling" else "auto", variant, "tokens_per_s",
                          style)
              for variant, style in VARIANT_STYLES.items() for mask in MASK_DASHES]
    ns = shape_ns(source, direction, heads)
    return Figure(
        f"dilated_tokens_{direction}_{heads}.png",
        f"Dilated attention tokens/s, {DIRECTION_NAMES[direction]}, {heads_text(heads)}",
        dilated_subtitle(source), end_notes(series, ns[-1] if ns else 0),
        "tokens per second", format_rate, ns, series[::-1])  # the ceiling first, underneath


def paths_figure(source, direction, heads):
    """The fixed variant through each attention path."""
    series = [make_series(source, direction, heads, mask, path, "fixed", "tokens_per_s", style)
              for path, style in PATH_STYLES.items() for mask in MASK_DASHES]
    ns = shape_ns(source, direction, heads)
    return Figure(
        f"dilated_paths_{direction}_{heads}.png",
        f"Fixed variant per path, {DIRECTION_NAMES[direction]}, {heads_text(heads)}",
        dilated_subtitle(source), end_notes(series, ns[-1] if ns else 0),
        "tokens per second", format_rate, ns, series)


def memory_figure(source, direction, heads):
    """Allocator peak of fixed and original (kAuto) against the issue's memory bound."""
    series = [make_series(source, direction, heads, mask, "auto", variant, "peak_bytes",
                          VARIANT_STYLES[variant])
              for variant in ("original", "fixed") for mask in MASK_DASHES]
    ns = shape_ns(source, direction, heads)
    notes = ["Peak: the allocator's high-water mark in one call (inputs included); bound: "
             "inputs + outputs + their gradients + LSE."]
    notes += ratio_note(source, direction, heads, ("fixed", "original"))
    notes += end_notes(series, ns[-1] if ns else 0)
    # The bound is drawn last: the fixed variant's peak lies almost on it.
    series.append(make_series(source, direction, heads, "dense", "auto", "fixed", "bound_bytes",
                              BOUND_STYLE))
    return Figure(
        f"dilated_memory_{direction}_{heads}.png",
        f"Peak memory, {DIRECTION_NAMES[direction]}, {heads_text(heads)}",
        dilated_subtitle(source), notes, "allocator peak", format_bytes, ns, series)


def ring_figures(context, entries):
    """One figure per direction: a line per strategy and one for the single device."""
    subtitle = (f"{context.get('cuda_device', 'unknown device')}, "
                f"{context.get('date', '')[:10]}; bf16, B = 1")
    points = {}  # (direction, strategy) -> {N: tokens/s}
    ranks = heads = ""
    for row in entries:
        match = RING_ROW.match(row.get("name", ""))
        if not match or "tokens_per_s" not in row:
            continue
        direction, strategy, ranks, heads, n = match.groups()
        n = int(n)
        points.setdefault((direction, strategy), {})[n] = row["tokens_per_s"]
        points.setdefault((direction, "single"), {})[n] = n / row["single_s"]
    figures = []
    for direction, name in DIRECTION_NAMES.items():
        series = [Series(style.label, "dense", style,
                         sorted(points.get((direction, key), {}).items()))
                  for key, style in STRATEGY_STYLES.items()]
        ns = sorted({n for s in series for n, _ in s.points})
        figures.append(Figure(
            f"ring_tokens_{direction}_{heads}_P{ranks}.png",
            f"Sequence-parallel tokens/s, {name}, P = {ranks} on one GPU",
            subtitle, [f"{heads}; pairs (2048, 1), (16384, 4), (262144, 16), (1048576, 64)."],
            "tokens per second", format_rate, ns, series, legend_masks=False))
    return figures


# ---------------------------------------------------------------------------- strong scaling


def median_counters(entries):
    """Each numeric counter of a row's repetitions, their median."""
    keys = {k for e in entries for k, v in e.items() if isinstance(v, (int, float))}
    return {k: statistics.median(e[k] for e in entries if isinstance(e.get(k), (int, float)))
            for k in keys}


def matching_rows(entries, pattern):
    """The rows whose name matches `pattern`, keyed by its groups: each row's counters (the
    median of its repetitions), or the error message (a str) of a row that did not run (out
    of memory, too few GPUs visible)."""
    groups = {}
    for entry in entries:
        match = pattern.match(report.base_name(entry))
        # Iterations only: the mean / median / stddev aggregates of --benchmark_repetitions
        # would count as more repetitions, and a stddev is no efficiency.
        if match and entry.get("run_type") != "aggregate":
            groups.setdefault(match.groups(), []).append(entry)
    rows = {}
    for key, group in groups.items():
        failed = [e for e in group if e.get("error_occurred")]
        rows[key] = failed[0].get("error_message", "error") if failed else median_counters(group)
    return rows


def strong_rows(entries):
    """(layout, P, N) -> the row's counters ("none" the non-causal layout) or its error."""
    return {(layout or "none", int(p), int(n)): row
            for (layout, p, n), row in matching_rows(entries, STRONG_ROW).items()}


def strong_series(rows, n):
    """The lines of one N: (P, efficiency) per layout, then the ideal 100% over every P."""
    series = []
    for layout, style in STRONG_STYLES.items():
        points = sorted((p, row["efficiency"]) for (lay, p, n_), row in rows.items()
                        if (lay, n_) == (layout, n) and isinstance(row, dict)
                        and "efficiency" in row)
        series.append(Series(style.label, "dense" if layout == "none" else "causal", style,
                             points))
    ps = sorted({p for (_, p, n_) in rows if n_ == n})
    series.append(Series(IDEAL_STYLE.label, "dense", IDEAL_STYLE, [(p, 1.0) for p in ps]))
    return series


def baseline_note(ran):
    """How efficiency is measured, and the time per call it is measured against."""
    # Each line's baseline P0 is its fewest GPUs that ran (more than 1 where N runs out of
    # memory on one): the benchmark's efficiency counter is against it.
    base = {lay: min(p for l_, p in ran if l_ == lay) for lay in STRONG_STYLES
            if any(l_ == lay for l_, _ in ran)}
    same = len(set(base.values())) == 1
    times = [f"{STRONG_STYLES[lay].label} {ran[lay, p0]['seconds'] * 1e3:.1f} ms"
             + ("" if same else f" (P0 = {p0})")
             for lay, p0 in base.items() if "seconds" in ran[lay, p0]]
    where = f" (P0 = {next(iter(base.values()))})" if same and base else ""
    return (f"Efficiency = T(P0) x P0 / (T(P) x P), P0 the fewest GPUs that hold N; "
            f"T(P0) per call{where}: {', '.join(times)}.")


def largest_p_note(ran):
    """Per-rank memory and the plan's work imbalance at the most GPUs, where measured."""
    p_max = max((p for _, p in ran), default=0)
    at_max = {lay: ran[lay, p_max] for lay in STRONG_STYLES if (lay, p_max) in ran}
    peaks = [f"{STRONG_STYLES[lay].label} {row['peak_over_baseline']:.3f}"
             for lay, row in at_max.items() if "peak_over_baseline" in row]
    imbalance = [f"{lay} {row['work_imbalance']:.3f}"
                 for lay, row in at_max.items() if "work_imbalance" in row]
    parts = ([f"per-rank peak memory / P0's: {', '.join(peaks)}"] if peaks else []) + (
        [f"work imbalance (largest / mean attended pairs per rank): {', '.join(imbalance)}"]
        if imbalance else [])
    return [f"At P = {p_max}, {'; '.join(parts)}."] if parts else []


def strong_notes(rows, n):
    """The notes of one N: baseline, the largest P's memory and imbalance, rows that failed."""
    ran = {(lay, p): row for (lay, p, n_), row in rows.items()
           if n_ == n and isinstance(row, dict)}
    notes = ([baseline_note(ran)] if ran else []) + largest_p_note(ran)
    failed = [f"{STRONG_STYLES[lay].label} at P = {p} ({row})"
              for (lay, p, n_), row in sorted(rows.items()) if n_ == n and isinstance(row, str)]
    if failed:
        notes.append("Did not run: " + "; ".join(failed) + ".")
    return notes


def strong_figures(context, entries):
    """One figure per N of one file's strong rows: efficiency against GPUs per layout."""
    rows = strong_rows(entries)
    subtitle = (f"{context.get('cuda_device', 'unknown device')}, "
                f"{context.get('date', 'unknown date')[:10]}; {STRONG_CONFIG}")
    figures = []
    for n in sorted({n for (_, _, n) in rows}):
        series = strong_series(rows, n)
        figures.append(Figure(
            f"strong_scaling_{n}.png", f"Strong scaling of one call, N = {format_n(n)}",
            subtitle, strong_notes(rows, n), "parallel efficiency", format_percent,
            [p for p, _ in series[-1].points], series, legend_masks=False, x_axis="gpus"))
    return figures


# ---------------------------------------------------------------------------- weak scaling


def weak_figure(context, entries):
    """Weak scaling, N = P x 1M: efficiency by work and by time against GPUs, ideal 100%."""
    rows = {int(p): (int(n), row) for (p, n), row in matching_rows(entries, WEAK_ROW).items()}
    ran = {p: row for p, (_, row) in rows.items() if isinstance(row, dict)}
    series = [Series(style.label, "dense", style,
                     sorted((p, row[counter]) for p, row in ran.items() if counter in row))
              for counter, style in WEAK_STYLES.items()]
    ps = sorted(rows)
    series.append(Series(IDEAL_STYLE.label, "dense", IDEAL_STYLE, [(p, 1.0) for p in ps]))
    sizes = ", ".join(f"P = {p}: N = {format_n(rows[p][0])}" for p in ps)
    notes = [f"Each GPU holds 1M positions ({sizes}). The pair (N, 64) spans the whole "
             "sequence, so a rank's work grows with N: equal time is not the ideal, equal "
             "attended pairs per second per GPU is (the plan's count, "
             "nn::attended_pairs_per_rank)."]
    failed = [f"P = {p} ({row})" for p, (_, row) in sorted(rows.items()) if isinstance(row, str)]
    if failed:
        notes.append("Did not run: " + "; ".join(failed) + ".")
    subtitle = (f"{context.get('cuda_device', 'unknown device')}, "
                f"{context.get('date', 'unknown date')[:10]}; {STRONG_CONFIG}")
    return Figure("weak_scaling.png", "Weak scaling, N = P x 1M", subtitle, notes, "efficiency",
                  format_percent, ps, series, legend_masks=False, x_axis="gpus")


def all_figures(source):
    figures = []
    if source.rows:
        figures += [tokens_figure(source, d, h) for d in DIRECTION_NAMES for h in HEAD_CONFIGS]
        figures += [paths_figure(source, d, "H16D128") for d in DIRECTION_NAMES]
        figures.append(memory_figure(source, "fwdbwd", "H16D128"))
    for context, entries in source.ring:
        figures += ring_figures(context, entries)
    for context, entries in source.strong:
        figures += strong_figures(context, entries)
    for context, entries in source.weak:
        figures.append(weak_figure(context, entries))
    return figures


# ---------------------------------------------------------------------------- drawing


def log_ticks(lo, hi, mantissas):
    """Every mantissa * 10**k (or 2**k for bytes) inside [lo, hi]."""
    return [m * 10**k for k in range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1)
            for m in mantissas if lo <= m * 10**k <= hi]


def byte_ticks(lo, hi):
    """Powers of 4 (256 MiB, 1 GiB, 4 GiB), or of 2 when that gives fewer than 4 ticks."""
    for base in (4, 2):
        ticks = [base**k for k in range(math.floor(math.log(lo, base)),
                                        math.ceil(math.log(hi, base)) + 1) if lo <= base**k <= hi]
        if len(ticks) >= 4:
            return ticks
    return ticks


def y_ticks(figure, lo, hi):
    if figure.y_format is format_bytes:
        return byte_ticks(lo, hi)
    for mantissas in ((1,), (1, 2, 5), range(1, 10)):
        ticks = log_ticks(lo, hi, mantissas)
        if len(ticks) >= 5:
            return ticks
    return ticks


def draw_lines(axes, series):
    for s in series:
        if not s.points:
            continue
        xs, ys = zip(*s.points)
        axes.plot(xs, ys, color=s.style.color, linestyle=s.style.dash, linewidth=s.style.width,
                  marker=s.style.marker or None, markersize=6, markerfacecolor="white",
                  markeredgewidth=1.5, label=s.style.label)


def render_log_axes(axes, figure):
    """N against the value, both logarithmic, ticks at every N and at round values."""
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xticks(figure.x_values, [format_n(n) for n in figure.x_values])
    axes.xaxis.set_minor_locator(ticker.NullLocator())
    values = [v for s in figure.series for _, v in s.points]
    lo, hi = min(values) / 1.2, max(values) * 1.2
    axes.set_ylim(lo, hi)
    axes.set_yticks(y_ticks(figure, lo, hi), [figure.y_format(v) for v in y_ticks(figure, lo, hi)])
    axes.yaxis.set_minor_locator(ticker.NullLocator())
    axes.set_xlabel("sequence length N (tokens, log scale)")
    axes.set_ylabel(f"{figure.y_label} (log scale)")


def render_gpu_axes(axes, figure):
    """GPUs (1, 2, 4) evenly spaced (log 2) against a fraction drawn from 0 to 105%, or a
    little past the highest point (run-to-run noise can put one over 100%)."""
    axes.set_xscale("log", base=2)
    axes.set_xticks(figure.x_values, [str(p) for p in figure.x_values])
    axes.xaxis.set_minor_locator(ticker.NullLocator())
    # Room on the right for the value labels of the last column.
    axes.set_xlim(figure.x_values[0] / 1.25, figure.x_values[-1] * 1.45)
    top = max([1.05] + [v + 0.03 for s in figure.series for _, v in s.points])
    axes.set_ylim(0.0, top)
    ticks = [i / 10 for i in range(11)]
    axes.set_yticks(ticks, [figure.y_format(v) for v in ticks])
    axes.set_xlabel("GPUs P (log scale)")
    axes.set_ylabel(figure.y_label)


def spread_labels(values, gap):
    """Label heights for values at one x: each value's own height, pushed apart (upwards,
    from the lowest) until neighbours are at least gap apart, so that no two overlap."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    heights = list(values)
    for before, index in zip(order, order[1:]):
        heights[index] = max(heights[index], heights[before] + gap)
    return heights


def label_points(axes, figure):
    """Each measured efficiency beside its point, in its line's colour (the ideal line and
    each line's baseline, 100% by definition, stay unlabelled)."""
    measured = [s for s in figure.series if s.style is not IDEAL_STYLE]
    gap = 0.045 * axes.get_ylim()[1]  # about one line of small text on FIG_SIZE
    for x in figure.x_values:
        column = [(s, v) for s in measured for p, v in s.points[1:] if p == x]
        heights = spread_labels([v for _, v in column], gap)
        for (s, v), height in zip(column, heights):
            # On white: a label beside a middle column lies over its line's next segment.
            axes.annotate(f"{v * 100:.1f}%", (x, v), xytext=(x * 1.07, height),
                          textcoords="data", va="center", fontsize="small", color=s.style.color,
                          bbox=dict(facecolor="white", edgecolor="none", alpha=0.85, pad=1.0))


def render_legend(axes, figure):
    """One legend entry per label (a label has a solid and a dashed line), then the mask key."""
    handles, labels = {}, []
    for handle, label in zip(*axes.get_legend_handles_labels()):
        if label not in handles:
            handles[label] = handle
            labels.append(label)
    entries = [handles[label] for label in labels]
    if figure.legend_masks:
        for mask, dash in MASK_DASHES.items():
            entries.append(matplotlib.lines.Line2D([], [], color="#444444", linestyle=dash,
                                                   label=MASK_NAMES[mask]))
            labels.append(MASK_NAMES[mask])
    axes.legend(entries, labels, loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize="small",
                frameon=False)


def render(figure):
    """The matplotlib figure of one Figure."""
    fig, axes = plt.subplots(figsize=FIG_SIZE, dpi=DPI)
    draw_lines(axes, figure.series)
    if figure.x_axis == "gpus":
        render_gpu_axes(axes, figure)
        label_points(axes, figure)
    else:
        render_log_axes(axes, figure)
    axes.grid(True, color="#dddddd")
    render_legend(axes, figure)
    # Subtitle and notes wrapped alike: a long subtitle (strong scaling's configuration) would
    # run past the figure's right edge.
    lines = [line for text in [figure.subtitle, *figure.notes]
             for line in textwrap.wrap(text, NOTE_WIDTH)]
    axes.set_title("\n".join(lines), fontsize="small", loc="left", color="#444444")
    fig.suptitle(figure.title, x=0.02, ha="left", fontweight="bold")
    fig.tight_layout()
    return fig


def save(fig, path):
    fig.savefig(path, metadata=PNG_METADATA)
    plt.close(fig)
    print(path)


def cmd_bench(args):
    source = load_bench(args.files)
    os.makedirs(args.out_dir, exist_ok=True)
    written = set()
    for figure in all_figures(source):
        if not any(s.points for s in figure.series):
            print(f"rdplot: no rows for {figure.file_name}; skipped", file=sys.stderr)
            continue
        if figure.file_name in written:  # ring or strong rows of two files: the later one wins
            print(f"rdplot: {figure.file_name} drawn again from a later file, replacing the "
                  "earlier one (plot one run per folder to keep both)", file=sys.stderr)
        save(render(figure), os.path.join(args.out_dir, figure.file_name))
        written.add(figure.file_name)
    if not written:
        print("rdplot: no dilated/, dense_ceiling/, ring/ or strong rows in the input",
              file=sys.stderr)
    return 0 if written else 1


# ============================================================================ main


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:]))
    commands = parser.add_subparsers(dest="command", required=True)
    metrics = commands.add_parser("metrics", help="loss and accuracy of training runs")
    metrics.add_argument("files", nargs="+", help="metrics JSONL files, one per run")
    metrics.add_argument("-o", "--out-dir", required=True, help="folder for the PNG files")
    metrics.add_argument("--smooth", type=int, default=1,
                         help="moving average over this many train records (default 1: none)")
    bench = commands.add_parser("bench", help="benchmark plots of docs/benchmarks.md")
    bench.add_argument("files", nargs="+", help="Google Benchmark JSON files")
    bench.add_argument("-o", "--out-dir", required=True, help="folder for the PNG files")
    args = parser.parse_args(argv)
    if plt is None:
        print("rdplot: needs matplotlib (Debian: apt-get install python3-matplotlib, or run "
              "./rd setup)", file=sys.stderr)
        return 3
    try:
        return cmd_metrics(args) if args.command == "metrics" else cmd_bench(args)
    except (OSError, json.JSONDecodeError, ValueError) as error:
        print(f"rdplot: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
