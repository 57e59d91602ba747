#!/usr/bin/env python3
"""SVG plots of the dilated-attention benchmarks, for docs/benchmarks.md.

Reads Google Benchmark JSON written by bench/cuda_dilated_attention_bench (parsed with
bench/report.py, the same code that makes the tables) and writes plain SVG files, no plotting
library, into an output folder:
  dilated_tokens_<fwd|fwdbwd>_<H12D64|H16D128>.svg  tokens/s against N for the fixed and the
      original variant (kAuto) and the dense-SDPA ceiling;
  dilated_paths_<fwd|fwdbwd>_H16D128.svg  tokens/s against N for the fixed variant per path
      (kAuto, kCudnn, kFlash, kMath);
  dilated_memory_fwdbwd_H16D128.svg  the allocator's peak against N for the fixed and the
      original variant (kAuto), with the issue's bound (inputs + outputs + gradients + LSE).
Both axes are logarithmic; non-causal rows are solid lines, causal rows dashed. A line ends at
its last row that ran; the note under the title says where and why (time cap, out of memory,
or no larger N registered). Several files are merged, a later file's row replacing an earlier
one of the same name; they must all come from one device.

Usage: python3 bench/plot.py build/dilated.json [more.json ...] docs/plots/
Python 3 standard library only.
"""

import argparse
import json
import math
import os
import re
import sys
import textwrap
from dataclasses import dataclass
from xml.sax.saxutils import escape, quoteattr

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.dont_write_bytecode = True  # no __pycache__ left in bench/
import report  # noqa: E402  bench/report.py: collect_rows, dilated_key, format_cell

# Canvas and layout, in pixels. The plot area's top moves down with the number of note lines.
WIDTH, HEIGHT = 640, 400
AREA_LEFT, AREA_RIGHT, AREA_BOTTOM = 84, 468, 346
LEGEND_LEFT = 484
FONT = "DejaVu Sans, Helvetica, Arial, sans-serif"
FONT_SIZE, TITLE_SIZE = 11, 13
LINE_HEIGHT = 14
CHAR_WIDTH = 6.6  # advance of an average FONT_SIZE character, to wrap text before it overflows
AXIS_MARGIN = 1.2  # the data range is widened by this factor at each end of a log axis


@dataclass(frozen=True)
class Style:
    """How one line is drawn; colour, marker and dash each keep lines apart in grayscale too."""
    label: str
    color: str
    marker: str = ""  # circle, square, triangle, diamond, or "" for none
    dash: str = ""  # SVG stroke-dasharray; "" is solid
    width: float = 2.0


# Okabe-Ito colours (readable with the common colour-vision deficiencies).
VARIANT_STYLES = {
    "fixed": Style("fixed, kAuto", "#0072B2", "circle"),
    "original": Style("original, kAuto", "#D55E00", "square"),
    "ceiling": Style("dense-SDPA ceiling (cuDNN)", "#000000", "triangle"),
}
PATH_STYLES = {
    # Wide and drawn first: kAuto mostly takes cuDNN, whose line then runs along its middle.
    "auto": Style("kAuto", "#56B4E9", "circle", width=5.0),
    "cudnn": Style("kCudnn", "#009E73", "triangle"),
    "flash": Style("kFlash", "#E69F00", "diamond"),
    "math": Style("kMath", "#CC79A7", "square"),
}
MASK_DASHES = {"dense": "", "causal": "7 4"}
MASK_NAMES = {"dense": "non-causal", "causal": "causal"}
MASK_LEGEND = [Style(MASK_NAMES[mask], "#444444", dash=dash) for mask, dash in MASK_DASHES.items()]
BOUND_STYLE = Style("memory bound", "#222222", dash="2 3", width=2.0)
RATE_TICKS = (10, (1, 2, 5))  # 10M/s, 100M/s; 20M/s, 50M/s when the range is short
BYTE_TICKS = (4, (1, 2))  # 256 MiB, 1 GiB, 4 GiB; every power of two when the range is short
DIRECTION_NAMES = {"fwd": "forward", "fwdbwd": "forward + backward"}
HEAD_CONFIGS = ("H12D64", "H16D128")


@dataclass
class Series:
    """One line: (N, value) points by N, and why it stops before the axis does (if it does)."""
    name: str  # variant or path, as in the legend
    mask: str
    style: Style
    points: list
    stop_reason: str  # "" when no row of the family is in the input


@dataclass
class Figure:
    file_name: str
    title: str
    subtitle: str
    notes: list  # sentences under the subtitle
    y_label: str
    y_format: object  # value -> tick label
    y_ticks: tuple  # (base, mantissas): ticks at powers of base, or mantissa * power if few
    x_values: list  # every N of the shape, the x ticks
    series: list
    legend: list  # Styles, None for a gap


@dataclass
class Source:
    """The merged rows of the input files, keyed by report.dilated_key."""
    device: str
    date: str
    rows: dict


# ----------------------------------------------------------------------------- input


def load_source(paths):
    """Merges the files' dilated and dense-ceiling rows; ValueError when devices differ."""
    rows, devices, dates = {}, [], []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        context = data.get("context", {})
        device = context.get("cuda_device", "unknown device")
        date = context.get("date", "unknown date")[:10]
        devices += [device] if device not in devices else []
        dates += [date] if date not in dates else []
        for row in report.collect_rows(data.get("benchmarks", [])):
            key = report.dilated_key(row.name)
            if key is not None:
                rows[key] = row
    if len(devices) > 1:
        raise ValueError(f"the files come from different devices ({', '.join(devices)}); "
                         "plot one device at a time")
    return Source(devices[0] if devices else "unknown device", ", ".join(dates), rows)


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


def make_series(source, direction, heads, mask, path, variant, field, name, style):
    """The line of one row family; field is the counter plotted ("tokens_per_s", ...)."""
    family = sorted((key[2], row) for key, row in source.rows.items()
                    if key[:2] == (direction, heads) and key[3:] == (mask, path, variant))
    points = [(n, row.values[field]) for n, row in family
              if not row.error and row.values.get(field)]
    last_n = points[-1][0] if points else 0
    first_failed = next((row for n, row in family if n > last_n), None)
    reason = stop_reason(first_failed) if family else ""  # "": the file has no such rows
    dash = style.dash or MASK_DASHES[mask]  # a reference line keeps its own dash
    styled = Style(style.label, style.color, style.marker, dash, style.width)
    return Series(name, mask, styled, points, reason)


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


# ----------------------------------------------------------------------------- figures


def subtitle(source):
    return f"{source.device}, {source.date}; bf16, batch B = 1"


def heads_text(heads):
    """H16D128 -> "H = 16, D = 128"."""
    match = re.fullmatch(r"H(\d+)D(\d+)", heads)
    return f"H = {match.group(1)}, D = {match.group(2)}" if match else heads


def tokens_figure(source, direction, heads):
    """Fixed and original (kAuto) against the dense-SDPA ceiling."""
    series = []
    for variant, style in VARIANT_STYLES.items():
        path = "cudnn" if variant == "ceiling" else "auto"
        for mask in MASK_DASHES:
            series.append(make_series(source, direction, heads, mask, path, variant,
                                      "tokens_per_s", style.label, style))
    ns = shape_ns(source, direction, heads)
    return Figure(
        f"dilated_tokens_{direction}_{heads}.svg",
        f"Dilated attention tokens/s, {DIRECTION_NAMES[direction]}, {heads_text(heads)}",
        subtitle(source), end_notes(series, ns[-1] if ns else 0),
        "tokens per second", format_rate, RATE_TICKS, ns, series[::-1],  # ceiling first, under
        list(VARIANT_STYLES.values()) + [None] + MASK_LEGEND)


def paths_figure(source, direction, heads):
    """The fixed variant through each attention path."""
    series = [make_series(source, direction, heads, mask, path, "fixed", "tokens_per_s",
                          style.label, style)
              for path, style in PATH_STYLES.items() for mask in MASK_DASHES]
    ns = shape_ns(source, direction, heads)
    return Figure(
        f"dilated_paths_{direction}_{heads}.svg",
        f"Fixed variant per path, {DIRECTION_NAMES[direction]}, {heads_text(heads)}",
        subtitle(source), end_notes(series, ns[-1] if ns else 0),
        "tokens per second", format_rate, RATE_TICKS, ns, series,
        list(PATH_STYLES.values()) + [None] + MASK_LEGEND)


def memory_figure(source, direction, heads):
    """Allocator peak of fixed and original (kAuto) against the issue's memory bound."""
    series = [make_series(source, direction, heads, mask, "auto", variant, "peak_bytes",
                          VARIANT_STYLES[variant].label, VARIANT_STYLES[variant])
              for variant in ("original", "fixed") for mask in MASK_DASHES]
    ns = shape_ns(source, direction, heads)
    notes = ["Peak: the allocator's high-water mark in one call (inputs included); bound: "
             "inputs + outputs + their gradients + LSE."]
    notes += ratio_note(source, direction, heads, ("fixed", "original"))
    notes += end_notes(series, ns[-1] if ns else 0)
    # The bound is drawn last: the fixed variant's peak lies almost on it.
    series.append(make_series(source, direction, heads, "dense", "auto", "fixed", "bound_bytes",
                              "bound", BOUND_STYLE))
    return Figure(
        f"dilated_memory_{direction}_{heads}.svg",
        f"Peak memory, {DIRECTION_NAMES[direction]}, {heads_text(heads)}",
        subtitle(source), notes, "allocator peak", format_bytes, BYTE_TICKS, ns, series,
        [VARIANT_STYLES["fixed"], VARIANT_STYLES["original"], BOUND_STYLE, None] + MASK_LEGEND)


def all_figures(source):
    figures = [tokens_figure(source, d, h) for d in DIRECTION_NAMES for h in HEAD_CONFIGS]
    figures += [paths_figure(source, d, "H16D128") for d in DIRECTION_NAMES]
    figures.append(memory_figure(source, "fwdbwd", "H16D128"))
    return figures


# ----------------------------------------------------------------------------- scales, ticks


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


def format_bytes(value):
    """2**28 -> 256 MiB, 2**34 -> 16 GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= scale:
            return f"{value / scale:g} {unit}"
    return f"{value:g} B"


class LogScale:
    """Maps [lo, hi] logarithmically onto pixels [px_lo, px_hi] (px_hi < px_lo for y)."""

    def __init__(self, lo, hi, px_lo, px_hi):
        self.lo, self.hi, self.px_lo, self.px_hi = lo, hi, px_lo, px_hi

    def __call__(self, value):
        fraction = math.log(value / self.lo) / math.log(self.hi / self.lo)
        return self.px_lo + fraction * (self.px_hi - self.px_lo)

    def contains(self, value):
        return self.lo <= value <= self.hi


def padded_scale(values, px_lo, px_hi):
    """A log scale over values, widened by AXIS_MARGIN at both ends."""
    return LogScale(min(values) / AXIS_MARGIN, max(values) * AXIS_MARGIN, px_lo, px_hi)


def log_ticks(scale, base, mantissas):
    """Every mantissa * base**k inside the scale's range."""
    first = math.floor(math.log(scale.lo, base))
    last = math.ceil(math.log(scale.hi, base))
    return [m * base**k for k in range(first, last + 1) for m in mantissas
            if scale.contains(m * base**k)]


def y_ticks(scale, base, mantissas):
    """Powers of base if there are five; else mantissa * power; else every integer * power."""
    for steps in ((1,), mantissas):
        ticks = log_ticks(scale, base, steps)
        if len(ticks) >= 5:
            return ticks
    return log_ticks(scale, base, range(1, base))


# ----------------------------------------------------------------------------- SVG pieces


def text(x, y, content, size=FONT_SIZE, anchor="start", weight="normal", extra=""):
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" '
            f'font-weight="{weight}"{extra}>{escape(content)}</text>')


def header_lines(figure):
    """Title, subtitle and wrapped notes; returns (SVG elements, y below them)."""
    elements = [text(12, 22, figure.title, TITLE_SIZE, weight="bold"),
                text(12, 39, figure.subtitle)]
    y = 39
    for note in figure.notes:
        for note_line in textwrap.wrap(note, int((WIDTH - 24) / CHAR_WIDTH)):
            y += LINE_HEIGHT
            elements.append(text(12, y, note_line, extra=' fill="#444444"'))
    return elements, y + 16


def axes(x_scale, y_scale, figure):
    """Frame, grid lines, tick labels and axis titles."""
    top, bottom = y_scale.px_hi, y_scale.px_lo
    elements = [f'<rect x="{AREA_LEFT}" y="{top:.1f}" width="{AREA_RIGHT - AREA_LEFT}" '
                f'height="{bottom - top:.1f}" fill="none" stroke="#000000"/>']
    for n in figure.x_values:
        px = x_scale(n)
        elements.append(f'<line x1="{px:.1f}" y1="{top:.1f}" x2="{px:.1f}" y2="{bottom:.1f}" '
                        'stroke="#dddddd"/>')
        elements.append(text(px, bottom + 15, format_n(n), anchor="middle"))
    for value in y_ticks(y_scale, *figure.y_ticks):
        py = y_scale(value)
        elements.append(f'<line x1="{AREA_LEFT}" y1="{py:.1f}" x2="{AREA_RIGHT}" y2="{py:.1f}" '
                        'stroke="#dddddd"/>')
        elements.append(text(AREA_LEFT - 6, py + 4, figure.y_format(value), anchor="end"))
    elements.append(text((AREA_LEFT + AREA_RIGHT) / 2, bottom + 34,
                         "sequence length N (tokens, log scale)", anchor="middle"))
    middle = (top + bottom) / 2
    elements.append(text(16, middle, f"{figure.y_label} (log scale)", anchor="middle",
                         extra=f' transform="rotate(-90 16 {middle:.1f})"'))
    return elements


def marker(shape, x, y, color):
    """An open marker (white fill), so that markers of lines on top of each other stay visible."""
    paint = f'fill="#ffffff" stroke="{color}" stroke-width="1.6"'
    if shape == "circle":
        return f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3.6" {paint}/>'
    if shape == "square":
        return f'<rect x="{x - 3.3:.1f}" y="{y - 3.3:.1f}" width="6.6" height="6.6" {paint}/>'
    corners = {"triangle": [(0, -4.6), (4.2, 3.2), (-4.2, 3.2)],
               "diamond": [(0, -4.8), (4.2, 0), (0, 4.8), (-4.2, 0)]}.get(shape)
    if corners is None:
        return ""
    points = " ".join(f"{x + dx:.1f},{y + dy:.1f}" for dx, dy in corners)
    return f'<polygon points="{points}" {paint}/>'


def polyline(points, style):
    """The stroke through pixel points, dashed as the style says."""
    coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
    dash = f' stroke-dasharray="{style.dash}"' if style.dash else ""
    return (f'<polyline points="{coords}" fill="none" stroke="{style.color}" '
            f'stroke-width="{style.width}" stroke-linejoin="round"{dash}/>')


def line(series, x_scale, y_scale):
    """A data line with a marker at each measured point (a lone point shows as its marker)."""
    pixels = [(x_scale(n), y_scale(v)) for n, v in series.points]
    elements = [polyline(pixels, series.style)] if len(pixels) > 1 else []
    elements += [marker(series.style.marker, x, y, series.style.color) for x, y in pixels]
    return elements


def legend(entries, top):
    """Line samples with their labels to the right of the plot area; None leaves a gap."""
    elements, y = [], top + 6
    max_chars = int((WIDTH - LEGEND_LEFT - 36) / CHAR_WIDTH)
    for style in entries:
        if style is None:
            y += LINE_HEIGHT / 2
            continue
        sample = [(LEGEND_LEFT, y), (LEGEND_LEFT + 28, y)]
        elements.append(polyline(sample, style))
        elements.append(marker(style.marker, LEGEND_LEFT + 14, y, style.color))
        label_lines = textwrap.wrap(style.label, max_chars)
        for i, label_line in enumerate(label_lines):
            elements.append(text(LEGEND_LEFT + 34, y + 4 + i * LINE_HEIGHT, label_line))
        y += LINE_HEIGHT * len(label_lines) + 4
    return elements


def render(figure):
    """The whole SVG document of one figure."""
    elements, area_top = header_lines(figure)
    values = [v for s in figure.series for _, v in s.points]
    x_scale = padded_scale(figure.x_values, AREA_LEFT, AREA_RIGHT)
    y_scale = padded_scale(values, AREA_BOTTOM, area_top)
    elements += axes(x_scale, y_scale, figure)
    for series in figure.series:
        elements += line(series, x_scale, y_scale)
    drawn = {s.style.label for s in figure.series if s.points} | set(MASK_NAMES.values())
    elements += legend([e for e in figure.legend if e is None or e.label in drawn], area_top)
    body = "\n".join(e for e in elements if e)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
            f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family={quoteattr(FONT)}>\n'
            f'<title>{escape(figure.title)}</title>\n'
            f'<rect width="{WIDTH}" height="{HEIGHT}" fill="#ffffff"/>\n{body}\n</svg>\n')


# ----------------------------------------------------------------------------- main


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="Google Benchmark JSON output files")
    parser.add_argument("out_dir", help="folder for the SVG files (created if missing)")
    args = parser.parse_args(argv)
    try:
        source = load_source(args.files)
    except (OSError, json.JSONDecodeError, ValueError) as error:
        print(f"plot.py: {error}", file=sys.stderr)
        return 2
    os.makedirs(args.out_dir, exist_ok=True)
    written = 0
    for figure in all_figures(source):
        if not any(s.points for s in figure.series):
            print(f"plot.py: no rows for {figure.file_name}; skipped", file=sys.stderr)
            continue
        path = os.path.join(args.out_dir, figure.file_name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(render(figure))
        print(path)
        written += 1
    return 0 if written else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
