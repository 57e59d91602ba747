#!/bin/sh
# rdplot_test.sh RDPLOT DATA_DIR: runs tools/rdplot.py on synthetic metrics files and on
# benchmark JSONs of docs/data (ring, strong scaling), and checks that PNG files appear and
# that a bad metrics line is refused by file and line. Exits 77 (ctest: skipped) when no
# python3 has matplotlib.
set -eu
rdplot="$1"
data_dir="$2"

# Debian's python3-matplotlib serves /usr/bin/python3; a python3 earlier on PATH (pyenv, a
# virtual environment) may lack it.
python=""
for candidate in python3 /usr/bin/python3; do
  if "$candidate" -c "import matplotlib" >/dev/null 2>&1; then
    python="$candidate"
    break
  fi
done
if [ -z "$python" ]; then
  echo "rdplot_test: SKIPPED: no python3 with matplotlib (./rd setup installs python3-matplotlib)"
  exit 77
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
fail() {
  echo "rdplot_test: FAILED: $*" >&2
  exit 1
}
is_png() { [ "$(head -c 8 "$1" | od -An -tx1 | tr -d ' \n')" = "89504e470d0a1a0a" ]; }

# Two task runs (accuracy and exact match) and a text run (bits per byte).
for run in short long text; do
  mkdir -p "$work/$run"
  "$python" - "$work/$run/metrics.jsonl" "$run" <<'PY'
import json, sys
with open(sys.argv[1], "w") as f:
    for step in range(0, 40, 2):
        f.write(json.dumps({"step": step, "time_s": step * 0.1, "split": "train",
                            "loss": 4.0 / (1 + step), "lr": 1e-3}) + "\n")
        if step % 10 == 0:
            scores = ({"bits_per_byte": 6.0 / (1 + step)} if sys.argv[2] == "text" else
                      {"accuracy": step / 40, "exact_match": step / 80})
            f.write(json.dumps({"step": step, "time_s": step * 0.1, "split": "eval",
                                "loss": 4.5 / (1 + step), **scores}) + "\n")
PY
done
"$python" "$rdplot" metrics "$work/short/metrics.jsonl" "$work/long/metrics.jsonl" \
  "$work/text/metrics.jsonl" -o "$work/plots" --smooth 3 || fail "metrics exited $?"
for name in loss accuracy bits_per_byte lr; do
  is_png "$work/plots/$name.png" || fail "metrics wrote no $name.png"
done
[ ! -e "$work/plots/tokens_per_s.png" ] || fail "tokens_per_s.png without tokens_per_s records"

printf '{"step": 1, "time_s": 0.5, "split": "train"}\n' >"$work/bad.jsonl"
if "$python" "$rdplot" metrics "$work/bad.jsonl" -o "$work/bad" 2>"$work/bad.err"; then
  fail "a record without loss was accepted"
fi
grep -q "bad.jsonl:1: missing loss" "$work/bad.err" || fail "unclear error: $(cat "$work/bad.err")"

"$python" "$rdplot" bench "$data_dir/ring_bench_h100_2026-11-24.json" -o "$work/bench" ||
  fail "bench exited $?"
for direction in fwd fwdbwd; do
  is_png "$work/bench/ring_tokens_${direction}_H16D128_P4.png" || fail "no ring $direction plot"
done
"$python" "$rdplot" bench "$data_dir/issue19/strong4m_h200x4_2026-11-26c_gradient_ring.json" \
  -o "$work/strong" || fail "bench (strong scaling) exited $?"
is_png "$work/strong/strong_scaling_4194304.png" || fail "no strong-scaling plot"
echo "rdplot_test: OK"
