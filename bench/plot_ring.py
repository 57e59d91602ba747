#!/usr/bin/env python3
"""SVG plots of the sequence-parallel benchmark (bench/cuda_ring_attention_bench), for
docs/benchmarks.md: tokens/s against N for P ranks with each strategy and for the
single-device call on the same inputs, forward and forward + backward. Draws with
bench/plot.py's SVG code (Python 3 standard library only).

Usage: python3 bench/plot_ring.py ring_bench.json docs/plots/
"""

import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.dont_write_bytecode = True
import plot  # noqa: E402  bench/plot.py: Figure, Series, Style, render, format_rate

STRATEGY_STYLES = {
    "single": plot.Style("one device", "#000000", "triangle"),
    "ring": plot.Style("ring", "#0072B2", "circle"),
    "all_gather": plot.Style("all-gather", "#D55E00", "square"),
    "auto": plot.Style("auto", "#009E73", "diamond", dash="7 4"),
}
ROW = re.compile(r"ring/(fwd|fwdbwd)/(\w+)/P(\d+)/(H\d+D\d+)/N(\d+)")


def figures(data):
    """One figure per direction: a line per strategy and one for the single device."""
    context = data.get("context", {})
    subtitle = (f"{context.get('cuda_device', 'unknown device')}, "
                f"{context.get('date', '')[:10]}; bf16, B = 1")
    points = {}  # (direction, strategy) -> {N: tokens/s}
    ranks = heads = ""
    for row in data.get("benchmarks", []):
        match = ROW.match(row.get("name", ""))
        if not match or "tokens_per_s" not in row:
            continue
        direction, strategy, ranks, heads, n = match.groups()
        n = int(n)
        points.setdefault((direction, strategy), {})[n] = row["tokens_per_s"]
        points.setdefault((direction, "single"), {})[n] = n / row["single_s"]
    result = []
    for direction, name in plot.DIRECTION_NAMES.items():
        series = [plot.Series(style.label, "dense", style,
                              sorted(points.get((direction, key), {}).items()), "")
                  for key, style in STRATEGY_STYLES.items()]
        ns = sorted({n for s in series for n, _ in s.points})
        result.append(plot.Figure(
            f"ring_tokens_{direction}_{heads}_P{ranks}.svg",
            f"Sequence-parallel tokens/s, {name}, P = {ranks} on one GPU",
            subtitle, [f"{heads}; pairs (2048, 1), (16384, 4), (262144, 16), (1048576, 64)."],
            "tokens per second", plot.format_rate, plot.RATE_TICKS, ns, series,
            list(STRATEGY_STYLES.values())))
    return result


def main(argv):
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        data = json.load(f)
    os.makedirs(argv[1], exist_ok=True)
    for figure in figures(data):
        if not any(s.points for s in figure.series):
            continue
        path = os.path.join(argv[1], figure.file_name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(plot.render(figure))
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
