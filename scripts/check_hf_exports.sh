#!/usr/bin/env bash
# The three checkpoint layouts of tests/hf_layouts.py (text-only, published multimodal, tied), each
# fine-tuned on tests/fixtures/data/sft.jsonl and exported with `hybridmoe train --init-hf SRC
# --export-hf OUT`, scored by `hybridmoe score` (float32) and scripts/score_float64.py (float64),
# then reloaded in transformers as the source's class, in float32 and float64, by
# scripts/check_hf_exports.py. Writes benchmarks/records/hf_exports.json.
#   scripts/check_hf_exports.sh [REFVENV]
# REFVENV: the reference venv of benchmarks/reference/setup.sh (default /work/refvenv, that script's
# default; pass yours if you made it elsewhere). PY: the project's python (default .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
REFVENV=${1:-/work/refvenv}
PY=${PY:-.venv/bin/python}
test -x "$REFVENV/bin/python" || { echo "check_hf_exports.sh: no reference venv at $REFVENV: make one with" \
  "benchmarks/reference/setup.sh [VENV_DIR], then pass VENV_DIR here" >&2; exit 2; }
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
TOKENS=tests/fixtures/hf_tiny/tokens.npy
"$PY" tests/hf_layouts.py "$W/sources"
for L in text multimodal tied; do
  "$PY" -m hybridmoe train train.data=files data.path=tests/fixtures/data/sft.jsonl train.steps=2 \
    train.warmup_steps=0 train.batch_size=8 train.seq_len=64 --init-hf "$W/sources/$L" --export-hf "$W/exports/$L"
  "$PY" -m hybridmoe score --hf "$W/exports/$L" --tokens "$TOKENS" --out "$W/ours_$L.npy"
  "$PY" scripts/score_float64.py --hf "$W/exports/$L" --tokens "$TOKENS" --out "$W/ours64_$L.npy"
done
"$REFVENV/bin/python" scripts/check_hf_exports.py --work "$W" --tokens "$TOKENS" --out benchmarks/records/hf_exports.json
