#!/usr/bin/env python3
"""rdplot_bench_test.py RDPLOT: the scaling figures tools/rdplot.py draws from
bench/cuda_multi_gpu_bench's rows. Strong (strong/, strong_causal/): one figure per N, a line
per layout (non-causal, causal contiguous, causal zigzag) holding the rows' efficiency
counters against P, the ideal 100% line, a row that failed left out and named in the notes.
Weak (weak/P<p>/N<P x 1M>): one figure, a line by work (work_efficiency) and one by time
(efficiency). The synthetic JSON holds random efficiencies, so a value taken from the wrong
row shows. Where matplotlib is installed it also draws them and reads the legend and point
labels back."""
import json
import os
import random
import sys
import tempfile

import rdplot_testing  # tests/rdplot_testing.py, beside this file

LAYOUTS = {"none": "strong", "contiguous": "strong_causal/contiguous",
           "zigzag": "strong_causal/zigzag"}
LABELS = ["non-causal", "causal contiguous", "causal zigzag", "ideal (100%)"]
NS = (1048576, 4194304)
FAILED = ("zigzag", 4, 1048576)  # this row reports an error instead of counters
WEAK_LABELS = ["by work: attended pairs/s per GPU", "by time: T(1 GPU, 1M) / T(P, P x 1M)",
               "ideal (100%)"]
WEAK_FAILED = 8  # this weak row reports an error




def entry(layout, p, n, efficiency, seconds):
    """One iteration row as Google Benchmark writes it (suffixes included)."""
    row = {"name": f"{LAYOUTS[layout]}/P{p}/N{n}/iterations:1/manual_time",
           "run_name": f"{LAYOUTS[layout]}/P{p}/N{n}/iterations:1/manual_time",
           "run_type": "iteration", "iterations": 1, "real_time": seconds * 1e3,
           "time_unit": "ms", "efficiency": efficiency, "seconds": seconds,
           "tokens_per_s": n / seconds, "peak_over_baseline": 1.0 / p, "bytes_sent": 1e6 * p}
    if layout != "none":
        row["work_imbalance"] = 1.0 if layout == "zigzag" else 1.0 + 0.05 * p
    return row


def synthetic(rng):
    """(benchmark JSON, the efficiency each line should draw): {(layout, N): [(P, eff)]}."""
    entries, expected = [], {}
    for n in NS:
        for layout in LAYOUTS:
            for p in (1, 2, 4):
                if (layout, p, n) == FAILED:
                    entries.append({"name": f"{LAYOUTS[layout]}/P{p}/N{n}/iterations:1/"
                                    "manual_time", "run_type": "iteration",
                                    "error_occurred": True, "error_message": "out of memory"})
                    continue
                eff = 1.0 if p == 1 else rng.uniform(0.4, 1.02)
                entries.append(entry(layout, p, n, eff, 0.3 / (p * eff)))
                expected.setdefault((layout, n), []).append((p, eff))
    # Two repetitions of one row: the line draws their median, and an aggregate row (which
    # Google Benchmark adds with --benchmark_repetitions) does not count as a third.
    first = next(e for e in entries if e["name"].startswith("strong/P2/N4194304/"))
    entries += [dict(first, efficiency=first["efficiency"] + 0.02),
                dict(first, run_type="aggregate", aggregate_name="stddev", efficiency=0.001)]
    expected["none", 4194304][1] = (2, first["efficiency"] + 0.01)
    context = {"cuda_device": "NVIDIA Test GPU", "date": "2026-11-27T10:00:00+00:00"}
    return {"context": context, "benchmarks": entries}, expected


def weak_synthetic(rng):
    """(benchmark JSON of weak rows, {counter: [(P, value)]} the lines should draw)."""
    entries, expected = [], {"work_efficiency": [], "efficiency": []}
    for p in (1, 2, 4, WEAK_FAILED):
        name = f"weak/P{p}/N{p * 1048576}/iterations:1/manual_time"
        if p == WEAK_FAILED:
            entries.append({"name": name, "run_type": "iteration", "error_occurred": True,
                            "error_message": "needs 8 GPUs, 4 visible"})
            continue
        work, time = (1.0, 1.0) if p == 1 else (rng.uniform(0.7, 1.0), rng.uniform(0.3, 0.7))
        entries.append({"name": name, "run_type": "iteration", "iterations": 1,
                        "efficiency": time, "work_efficiency": work, "seconds": 0.5 / time})
        expected["work_efficiency"].append((p, work))
        expected["efficiency"].append((p, time))
    context = {"cuda_device": "NVIDIA Test GPU", "date": "2026-11-27T10:00:00+00:00"}
    return {"context": context, "benchmarks": entries}, expected


def check_weak(rdplot, rng):
    data, expected = weak_synthetic(rng)
    figure = rdplot.weak_figure(data["context"], data["benchmarks"])
    check(figure.file_name == "weak_scaling.png", f"weak file {figure.file_name}")
    labels = [s.name for s in figure.series]
    check(labels == WEAK_LABELS, f"weak labels {labels}")
    check(figure.x_values == [1, 2, 4, 8], f"weak x {figure.x_values}")
    for counter, series in zip(("work_efficiency", "efficiency"), figure.series):
        want, got = expected[counter], series.points
        check(len(got) == len(want) and all(p == q and close(a, b)
                                            for (p, a), (q, b) in zip(got, want)),
              f"weak {counter}: points {got}, want {want}")
    notes = " ".join(figure.notes)
    check("P = 4: N = 4M" in notes and "Did not run: P = 8 (needs 8 GPUs, 4 visible)" in notes,
          f"weak notes {notes!r}")
    return data, figure, expected


def check(condition, message):
    if not condition:
        print(f"rdplot_bench_test: FAILED: {message}", file=sys.stderr)
        sys.exit(1)


def close(a, b):
    return abs(a - b) < 1e-9


def check_figures(rdplot, data, expected):
    figures = rdplot.strong_figures(data["context"], data["benchmarks"])
    names = [f.file_name for f in figures]
    check(names == [f"strong_scaling_{n}.png" for n in NS], f"figures {names}")
    for n, figure in zip(NS, figures):
        labels = [s.name for s in figure.series]
        check(labels == LABELS, f"N = {n}: labels {labels}")
        check(figure.x_values == [1, 2, 4], f"N = {n}: x {figure.x_values}")
        check(figure.series[-1].points == [(1, 1.0), (2, 1.0), (4, 1.0)], "ideal line")
        for layout, series in zip(LAYOUTS, figure.series):
            want, got = expected[layout, n], series.points
            check(len(got) == len(want) and all(p == q and close(a, b)
                                                for (p, a), (q, b) in zip(got, want)),
                  f"N = {n}, {layout}: points {got}, want {want}")
        check("NVIDIA Test GPU, 2026-11-27" in figure.subtitle and "H = 16, D = 128"
              in figure.subtitle and "forward + backward" in figure.subtitle,
              f"subtitle {figure.subtitle!r}")
    notes = " ".join(figures[0].notes)
    check("Did not run: causal zigzag at P = 4 (out of memory)" in notes, f"notes {notes!r}")
    check("Did not run" not in " ".join(figures[1].notes), "a 4M row reported as failed")
    check("contiguous 1.200" in " ".join(figures[1].notes), f"imbalance {figures[1].notes}")
    return figures


def check_drawing(rdplot, figure, expected, n):
    """Legend entries and the percentages written beside the points (P > 1)."""
    fig = rdplot.render(figure)
    axes = fig.axes[0]
    legend = [t.get_text() for t in axes.get_legend().get_texts()]
    check(legend == LABELS, f"legend {legend}")
    written = sorted(t.get_text() for t in axes.texts)
    want = sorted(f"{eff * 100:.1f}%" for layout in LAYOUTS for p, eff in expected[layout, n]
                  if p > 1)
    check(written == want, f"point labels {written}, want {want}")
    check(axes.get_ylim()[0] == 0.0 and axes.get_ylim()[1] >= 1.05, f"y {axes.get_ylim()}")
    rdplot.plt.close(fig)


def main():
    rdplot_testing.run_where_matplotlib_is()
    rdplot = rdplot_testing.load_rdplot(sys.argv[1])
    data, expected = synthetic(random.Random(19))
    figures = check_figures(rdplot, data, expected)
    weak_data, weak, weak_expected = check_weak(rdplot, random.Random(20))

    if rdplot.plt is None:
        print("rdplot_bench_test: OK (matplotlib missing: the drawing itself not checked)")
        return
    for n, figure in zip(NS, figures):
        check_drawing(rdplot, figure, expected, n)
    fig = rdplot.render(weak)
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    check(legend == WEAK_LABELS, f"weak legend {legend}")
    written = sorted(t.get_text() for t in fig.axes[0].texts)
    want = sorted(f"{v * 100:.1f}%" for points in weak_expected.values() for p, v in points
                  if p > 1)
    check(written == want, f"weak point labels {written}, want {want}")
    rdplot.plt.close(fig)
    with tempfile.TemporaryDirectory() as work:
        path = os.path.join(work, "strong.json")
        with open(path, "w") as f:
            json.dump(data, f)
        with open(os.path.join(work, "weak.json"), "w") as f:
            json.dump(weak_data, f)
        out = os.path.join(work, "plots")
        check(rdplot.main(["bench", path, os.path.join(work, "weak.json"), "-o", out]) == 0,
              "exit code")
        for n in NS:
            png = os.path.join(out, f"strong_scaling_{n}.png")
            check(os.path.exists(png), f"no {os.path.basename(png)}")
            with open(png, "rb") as f:
                check(f.read(8) == b"\x89PNG\r\n\x1a\n", f"{png} is no PNG")
        check(sorted(os.listdir(out)) == [f"strong_scaling_{n}.png" for n in NS]
              + ["weak_scaling.png"], f"files {os.listdir(out)}")
    print("rdplot_bench_test: OK")


if __name__ == "__main__":
    main()
