#!/usr/bin/env python3
"""rdplot_metrics_test.py RDPLOT: which figures tools/rdplot.py draws from rd_train metrics and
how their lines are labelled: the accuracy figure holds held-out exact match (the headline of
tasks with answers) and answer-token accuracy, each named; text runs get bits per byte.
Where matplotlib is installed it also draws them and reads the legends back."""
import json
import os
import sys
import tempfile

import rdplot_testing  # tests/rdplot_testing.py, beside this file




def task_records():
    out = []
    for step in range(0, 40, 10):
        out.append({"step": step, "time_s": step * 0.1, "split": "train", "loss": 4.0 / (1 + step)})
        out.append({"step": step, "time_s": step * 0.1, "split": "eval", "loss": 4.5 / (1 + step),
                    "perplexity": 2.0, "accuracy": step / 40, "exact_match": step / 80})
    return out


def text_records():
    out = []
    for step in range(0, 40, 10):
        out.append({"step": step, "time_s": step * 0.1, "split": "train", "loss": 3.0 / (1 + step)})
        out.append({"step": step, "time_s": step * 0.1, "split": "eval", "loss": 3.5 / (1 + step),
                    "perplexity": 2.0, "bits_per_byte": 5.0 / (1 + step)})
    return out


def check(condition, message):
    if not condition:
        print(f"rdplot_metrics_test: FAILED: {message}", file=sys.stderr)
        sys.exit(1)


def main():
    rdplot_testing.run_where_matplotlib_is()
    rdplot = rdplot_testing.load_rdplot(sys.argv[1])
    task, text = rdplot.Run("task", task_records()), rdplot.Run("text", text_records())

    figures = {f.stem: f for f in rdplot.metrics_figures([task, text])}
    check(list(figures) == ["loss", "accuracy", "bits_per_byte"], f"figures {list(figures)}")
    accuracy = figures["accuracy"]
    keys = [s.key for s in accuracy.series]
    check(keys == ["exact_match", "accuracy"], f"accuracy figure draws {keys}")
    labels = [s.label for s in accuracy.series]
    check("exact match" in labels[0] and labels[1] == "answer-token accuracy", f"labels {labels}")
    check([s.key for s in figures["bits_per_byte"].series] == ["bits_per_byte"], "bits per byte")

    # A task run alone has no bits per byte; an older file without exact_match draws the
    # answer-token accuracy alone, still named as such.
    check("bits_per_byte" not in [f.stem for f in rdplot.metrics_figures([task])], "bpb for a task")
    old = rdplot.Run("old", [{k: v for k, v in r.items() if k != "exact_match"} for r in task.records])
    old_accuracy = [f for f in rdplot.metrics_figures([old]) if f.stem == "accuracy"][0]
    check([s.label for s in old_accuracy.series] == ["answer-token accuracy"], "old accuracy")

    if rdplot.plt is None:
        print("rdplot_metrics_test: OK (matplotlib missing: the drawing itself not checked)")
        return
    fig = rdplot.metrics_figure([task, text], accuracy, 1)
    legend = [t.get_text() for axes in fig.axes if axes.get_legend() for t in axes.get_legend().get_texts()]
    check("task: exact match (every answer token right) (eval)" in legend, f"legend {legend}")
    check("task: answer-token accuracy (eval)" in legend, f"legend {legend}")
    rdplot.plt.close(fig)
    with tempfile.TemporaryDirectory() as work:
        paths = []
        for run in (task, text):
            os.makedirs(os.path.join(work, run.name))
            paths.append(os.path.join(work, run.name, "metrics.jsonl"))
            with open(paths[-1], "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in run.records)
        check(rdplot.main(["metrics", *paths, "-o", os.path.join(work, "plots")]) == 0, "exit code")
        for stem in ("loss", "accuracy", "bits_per_byte"):
            check(os.path.exists(os.path.join(work, "plots", f"{stem}.png")), f"no {stem}.png")
    print("rdplot_metrics_test: OK")


if __name__ == "__main__":
    main()
