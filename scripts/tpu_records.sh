#!/usr/bin/env bash
# The chip's records, stage by stage, on a TPU host set up by scripts/tpu_setup.sh (docs/tpu.md):
#
#   scripts/tpu_records.sh stamp                        # where the git history is: the commit the copy is of
#   scripts/tpu_records.sh [--copy-to DIR] tests calibrate tiles kernels-one-chip kernels-cell step rl   # on the TPU host
#
#   stamp      write .source-commit (for a copy of the tree sent to a host without its history)
#   tests      benchmarks/tpu_tests.py    -> benchmarks/records/tpu_tests.json
#   tests-fp8  the same, the tests of the fp8 weights' kernels only (merged into the record)
#   tests-gdn  the same, the tests of the GDN kernels only (whole sequence and context-parallel ranks)
#   calibrate  hybridmoe calibrate        -> hybridmoe/analysis/chip_calibration.json (+ records/tpu_calibration.json)
#   tiles      hybridmoe tune-gmm (the one-chip recipe's grouped matmuls) -> hybridmoe/kernels/gmm/tile_table.json
#              (+ records/tpu_gmm_tiles.json)
#   tiles-missing  the same for the shapes the table's section has no entry for (+ tpu_gmm_tiles_missing.json)
#   kernels-one-chip, kernels-cell
#              benchmarks/tpu_kernels.py --geometry G -> benchmarks/records/tpu_kernels.json (merged; each
#              stops starting cases after 330 s, so each fits a 10-minute call)
#   kernels-cell-moe  the cell's gmm and moe_mlp cases only (their aligned arms among them)
#   kernels-gdn  the GDN core's cases at both geometries (its settings arms among them)
#   kernels-gdn-profile  the GDN core's cell cases (whole sequence and a context-parallel rank), each program
#              also under JAX's profiler: its 8 heaviest device ops by name (tpu_kernels.py --profile-ops)
#   kernels-gdn-cp  the core as a context-parallel rank runs it, at the cell's shard: pass 1 and the local
#              state cotangent as Mosaic kernels (gdn.cp_terms_in_kernel) against chunk terms by XLA
#   kernels-fp8  the cell's MoE MLP on fp8 codes (gather8's dequantization as an op before the kernels)
#   kernels-missing  the cases of both geometries the record has no figures for (at any commit)
#   gmm-uneven benchmarks/tpu_gmm_uneven.py -> benchmarks/records/tpu_gmm_uneven.json: the MoE layer's six
#              grouped matmuls at the cell's shapes and uneven groups, their tiles searched there
#   gmm-uneven-again  the same, one search round from the tiles the record found (after a kernel change)
#   gmm-aligned  the same kernels at the record's tiles, and on moe.group_align_rows' layout (64, 128)
#   moe-combine  benchmarks/tpu_moe_combine.py -> benchmarks/records/tpu_moe_combine.json: the MoE combine
#              slot by slot against the [T k, D] gather viewed as [T, k, D], at the cell's and one chip's shapes
#   gmm-prefetch  benchmarks/tpu_gmm_prefetch.py -> benchmarks/records/tpu_gmm_prefetch.json: the forward and
#              input-gradient grouped matmuls with their weight fetched a group ahead, and the weight gradient
#              written a group behind, against the grid-pipelined kernels at the cell's shapes
#   gmm-prefetch-table  the same, each kernel's fastest tiles into the tile table (kernels/gmm/tile_table.json)
#   step       benchmarks/tpu_step.py     -> benchmarks/records/tpu_step.json
#   step-default  the same, its default arm alone
#   step-gdn   the default (the GDN core at chunks of 128) beside chunks of 64 (arm gdn_chunk64), in one round
#   kernels-gdn-cell  the GDN core's whole-sequence cell case alone (every settings arm)
#   step-aligned  the default, the Pallas grouped matmuls at the table's tiles, and those on
#              moe.group_align_rows' layout
#   step-holdout  its default arm at other shapes -> tpu_step_seq4096.json, tpu_step_layers8_experts8.json
#   peer-full, peer-minimal  benchmarks/peer_maxtext.py -> benchmarks/records/tpu_peer.json: MaxText's own step
#              at the one-chip shape (remat full or minimal) beside ours; a later run merges into the record
#   rl         benchmarks/tpu_rl.py       -> benchmarks/records/tpu_rl.json (+ docs/tpu_rl_learn.png): the
#              16 x 8 x 512 GRPO batch of the one-chip recipe, then the learning run (chip-learn); each
#              part stopped past its share and recorded as cut, both within 480 s; rl-batch, rl-learn: one part
#
# The kernel and step stages keep JAX's compiled programs in .tpu-cache/ (ignored by git): a warm
# host's next call compiles nothing it compiled before.
#
#   scripts/tpu_records.sh place DIR                    # back here: each returned file to its place
#
# Stages run in the order given; a failing stage stops the rest (its record, if any, is written).
# --copy-to DIR (first): after each stage, and every 2 s while one runs, copy what the stages have written or changed (the records,
# the calibration and tile tables; a file left as it was is not copied) into DIR, flat (no folders: an accelerator host's output folder may return only
# files near its top), so a call cut short still hands back every finished stage's files. `place`
# puts such a folder's files where they belong in this checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .tpu-env ] && source .tpu-env
export PYTHONUNBUFFERED=1
copy_to=""
if [ "${1:-}" = "--copy-to" ]; then
  copy_to="$2"
  shift 2
  mkdir -p "$copy_to"
fi
# Where each file a stage writes lives in the checkout (a copy is flat: its name alone).
# The globs are expanded at each copy, so a record a stage makes for the first time is found.
produced_now() {
  local f
  for f in benchmarks/records/tpu_*.json hybridmoe/analysis/chip_calibration.json \
           hybridmoe/kernels/gmm/tile_table.json docs/tpu_rl_learn.png; do
    [ -f "$f" ] && echo "$f"
  done
  return 0
}
# What the stages change is what goes back: a file as it was when this call began (a record made on an
# earlier day, committed) is left out, since the host returns only a few files.
declare -A before=()
while read -r f; do before[$f]=$(cksum < "$f"); done < <(produced_now)
copy_results() {
  [ -n "$copy_to" ] || return 0
  while read -r f; do
    [ "${before[$f]:-}" = "$(cksum < "$f")" ] && continue
    cp "$f" "$copy_to/"
  done < <(produced_now)
  return 0
}
if [ "${1:-}" = "place" ]; then
  from=${2:?place DIR: the folder of returned files}
  for f in "$from"/*.json "$from"/*.png; do
    [ -e "$f" ] || continue
    name=$(basename "$f")
    case $name in
      chip_calibration.json) dest=hybridmoe/analysis/ ;;
      tile_table.json) dest=hybridmoe/kernels/gmm/ ;;
      tpu_*.json) dest=benchmarks/records/ ;;
      tpu_rl_learn.png) dest=docs/ ;;
      *) echo "place: $name is no file a stage writes; left where it is" >&2; continue ;;
    esac
    cp "$f" "$dest$name" && echo "placed $dest$name"
  done
  # The stamp named the tree that was sent; left here it would name every later record made here.
  rm -f .source-commit
  exit 0
fi
# Also every 2 s while the stages run: a process that has written its record may still be
# shutting the TPU runtime down (seconds, MaxText's more) when the call's time runs out.
watcher=""
if [ -n "$copy_to" ]; then
  (while sleep 2; do copy_results; done) &
  watcher=$!
fi
trap '[ -z "$watcher" ] || kill "$watcher" 2>/dev/null; copy_results' EXIT
for stage in "$@"; do
  copy_results
  echo "== $stage ($(date -u +%H:%M:%S))"
  case $stage in
    stamp) python3 -c '
import sys
from pathlib import Path
from hybridmoe.tools.record import write_commit_stamp
try:
    print(write_commit_stamp(Path(".")))
except ValueError as e:
    sys.exit(f"tpu_records: {e}")' ;;
    tests) python3 benchmarks/tpu_tests.py ;;
    tests-fp8) python3 benchmarks/tpu_tests.py -k fp8 ;;
    tests-gdn) python3 benchmarks/tpu_tests.py -k gdn ;;
    calibrate) python3 -m hybridmoe calibrate --out benchmarks/records/tpu_calibration.json ;;
    tiles) python3 -m hybridmoe tune-gmm recipe=qwen3.5-35b-a3b-v5e-1 --budget-s 420 --out benchmarks/records/tpu_gmm_tiles.json ;;
    tiles-missing) python3 -m hybridmoe tune-gmm recipe=qwen3.5-35b-a3b-v5e-1 --missing --budget-s 420 \
      --out benchmarks/records/tpu_gmm_tiles_missing.json ;;
    kernels-one-chip) python3 benchmarks/tpu_kernels.py --geometry one_chip --compile-cache .tpu-cache ;;
    kernels-cell) python3 benchmarks/tpu_kernels.py --geometry cell --compile-cache .tpu-cache ;;
    kernels-cell-moe) python3 benchmarks/tpu_kernels.py --geometry cell --compile-cache .tpu-cache --only gmm_cell,moe_mlp_cell ;;
    kernels-gdn) python3 benchmarks/tpu_kernels.py --compile-cache .tpu-cache --only gdn_cell,gdn_one_chip ;;
    kernels-gdn-cell) python3 benchmarks/tpu_kernels.py --compile-cache .tpu-cache --only gdn_cell ;;
    kernels-fp8) python3 benchmarks/tpu_kernels.py --compile-cache .tpu-cache --only moe_mlp_fp8_cell ;;
    kernels-gdn-profile) python3 benchmarks/tpu_kernels.py --compile-cache .tpu-cache --only gdn_cell,gdn_cp_cell \
      --profile-ops 8 --case-share-s 270 ;;
    kernels-gdn-cp) python3 benchmarks/tpu_kernels.py --compile-cache .tpu-cache --only gdn_cp_cell ;;
    kernels-missing) python3 benchmarks/tpu_kernels.py --missing --compile-cache .tpu-cache ;;
    gmm-uneven) python3 benchmarks/tpu_gmm_uneven.py --compile-cache .tpu-cache ;;
    gmm-uneven-again) python3 benchmarks/tpu_gmm_uneven.py --compile-cache .tpu-cache --start record --rounds 1 ;;
    gmm-aligned) python3 benchmarks/tpu_gmm_uneven.py --compile-cache .tpu-cache --start record --rounds 0 --aligned 64,128 ;;
    moe-combine) python3 benchmarks/tpu_moe_combine.py ;;
    gmm-prefetch) python3 benchmarks/tpu_gmm_prefetch.py ;;
    gmm-prefetch-table) python3 benchmarks/tpu_gmm_prefetch.py --write-table ;;
    step) python3 benchmarks/tpu_step.py --compile-cache .tpu-cache ;;
    step-default) python3 benchmarks/tpu_step.py --compile-cache .tpu-cache --only default ;;
    step-gdn) python3 benchmarks/tpu_step.py --compile-cache .tpu-cache \
      --only default,gdn_chunk64 ;;
    step-aligned) python3 benchmarks/tpu_step.py --compile-cache .tpu-cache --only default,pallas_gmm_auto,pallas_gmm_auto_aligned --profile 1 ;;
    step-holdout)
      # The calibrated model on shapes it was not calibrated or checked on: the default arm of the
      # one-chip recipe at half the sequence, and at twice the layers with half the experts, four of
      # them per token (about the same memory), each in its own record.
      python3 benchmarks/tpu_step.py --compile-cache .tpu-cache --only default --profile 1 \
        --out benchmarks/records/tpu_step_seq4096.json train.seq_len=4096
      python3 benchmarks/tpu_step.py --compile-cache .tpu-cache --only default --profile 1 \
        --out benchmarks/records/tpu_step_layers8_experts8.json model.num_layers=8 model.num_experts=8 \
        model.num_experts_per_tok=4 ;;
    peer-full|peer-minimal)
      # MaxText's step beside ours (benchmarks/peer_maxtext.py), one MaxText remat policy per call: the
      # wheels carried in .maxtext-wheels/ (scripts/maxtext_wheels.sh fetch, on a host with a registry).
      [ -d .maxtext-site/maxtext ] || scripts/maxtext_wheels.sh install
      # The folder first on the path from the start, as the chip's records were made: the host's own
      # antlr4 and huggingface-hub would shadow the versions MaxText's imports need.
      PYTHONPATH=$PWD/.maxtext-site${PYTHONPATH:+:$PYTHONPATH} python3 benchmarks/peer_maxtext.py \
        --maxtext-site .maxtext-site --compile-cache .tpu-cache --maxtext-remat "${stage#peer-}" ;;
    rl) python3 benchmarks/tpu_rl.py ;;
    rl-batch) python3 benchmarks/tpu_rl.py --part batch ;;
    rl-learn) python3 benchmarks/tpu_rl.py --part learn ;;
    *) echo "tpu_records: unknown stage $stage (stamp, tests, tests-fp8, tests-gdn, calibrate, tiles, tiles-missing, kernels-one-chip, kernels-cell, kernels-cell-moe, kernels-gdn, kernels-gdn-cell, kernels-gdn-profile, kernels-gdn-cp, kernels-fp8, kernels-missing, gmm-uneven, gmm-uneven-again, gmm-aligned, moe-combine, step, step-default, step-gdn, step-aligned, step-holdout, peer-full, peer-minimal, rl, rl-batch, rl-learn)" >&2; exit 2 ;;
  esac
done
