#!/usr/bin/env bash
# The three checkpoint layouts of tests/hf_layouts.py (text-only, published multimodal, tied), each
# fine-tuned on tests/fixtures/data/sft.jsonl and exported with `hybridmoe train --init-hf SRC
# --export-hf OUT`, scored by `hybridmoe score`, then reloaded in transformers as the source's class
# by scripts/check_hf_exports.py. Writes benchmarks/records/hf_exports.json.
#   scripts/check_hf_exports.sh [REFVENV]      (default /work/refvenv; PY= the project's python)
set -euo pipefail
cd "$(dirname "$0")/.."
REFVENV=${1:-/work/refvenv}
PY=${PY:-.venv/bin/python}
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
TOKENS=tests/fixtures/hf_tiny/tokens.npy
"$PY" tests/hf_layouts.py "$W/sources"
for L in text multimodal tied; do
  "$PY" -m hybridmoe train train.data=files data.path=tests/fixtures/data/sft.jsonl train.steps=2 \
    train.warmup_steps=0 train.batch_size=8 train.seq_len=64 --init-hf "$W/sources/$L" --export-hf "$W/exports/$L"
  "$PY" -m hybridmoe score --hf "$W/exports/$L" --tokens "$TOKENS" --out "$W/ours_$L.npy"
done
"$REFVENV/bin/python" scripts/check_hf_exports.py --work "$W" --tokens "$TOKENS" --out benchmarks/records/hf_exports.json
