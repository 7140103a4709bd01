"""Reload each `--export-hf` of tests/hf_layouts.py's checkpoints in transformers, as the class its
source names (config.json `architectures`), and compare the text log-probs with `hybridmoe score`.

The layouts: text-only (Qwen3_5MoeForCausalLM), the published multimodal form
(Qwen3_5MoeForConditionalGeneration: vision tower, MTP tensors, three shards) and tied embeddings.
scripts/check_hf_exports.sh makes the sources, trains and exports each with `hybridmoe train
--init-hf SRC --export-hf OUT`, scores the exports, then runs this with the reference venv. Per
layout it records transformers' loading report (no missing or unexpected tensor is allowed but the
MTP ones, which transformers does not model) and the largest log-prob difference; exit 1 when any
is above the tolerance.

    REFVENV/bin/python scripts/check_hf_exports.py --work W --tokens T.npy --out benchmarks/records/hf_exports.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys

import numpy as np
import torch
import transformers

# float32 on both sides. Rounding grows with the log-prob's size (the tied layout's are near -34):
# our float32 lands 1.1e-6 (text) and 2.0e-6 (tied) of max(1, |logp|) from float64
# (benchmarks/records/export_float64.json), so the criterion is relative, with 5x room per side.
TOLERANCE = 1e-5  # of max(1, |logp|)
LAYOUTS = ("text", "multimodal", "tied")


def reference_logprobs(export: str, architecture: str, tokens_BT: np.ndarray, dtype=torch.float32):
    cls = getattr(transformers, architecture)
    model, info = cls.from_pretrained(export, dtype=dtype, output_loading_info=True,
                                      attn_implementation="eager", experts_implementation="eager")
    model.eval()
    ids = torch.from_numpy(tokens_BT.astype(np.int64))
    with torch.no_grad():
        logits = model(input_ids=ids).logits.to(dtype)
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    info = {k: sorted(v) for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    return logp.gather(-1, ids[:, 1:, None])[..., 0].numpy(), type(model).__name__, info


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", required=True, help="folder with sources/L, exports/L and ours_L.npy per layout")
    parser.add_argument("--tokens", required=True, help="int token ids [B, T] (.npy)")
    parser.add_argument("--out", help="JSON record to write")
    args = parser.parse_args()
    tokens = np.load(args.tokens)
    torch.set_num_threads(2)
    rows, passed = {}, True
    for layout in LAYOUTS:
        source, export = os.path.join(args.work, "sources", layout), os.path.join(args.work, "exports", layout)
        architecture = json.load(open(os.path.join(source, "config.json")))["architectures"][0]
        ref, loaded_as, info = reference_logprobs(export, architecture, tokens)
        ours = np.load(os.path.join(args.work, f"ours_{layout}.npy"))
        exact, _, _ = reference_logprobs(export, architecture, tokens, torch.float64)  # each side's rounding
        diff = np.abs(ref - ours)
        rel = diff / np.maximum(1.0, np.abs(exact))
        unexpected = [k for k in info.get("unexpected_keys", []) if not k.startswith("mtp.")]
        ok = bool(rel.max() <= TOLERANCE and not info.get("missing_keys") and not unexpected
                  and not info.get("mismatched_keys") and loaded_as == architecture)
        passed &= ok
        rows[layout] = {"source_architecture": architecture, "loaded_as": loaded_as, "loading_info": info,
                        "export_files": sorted(os.listdir(export)), "max_abs_diff": float(diff.max()),
                        "mean_abs_diff": float(diff.mean()), "max_rel_diff": float(rel.max()),
                        "mean_logprob": float(ref.mean()),
                        "float64": {"transformers_float32_max_abs": float(np.abs(ref - exact).max()),
                                    "ours_float32_max_abs": float(np.abs(ours - exact).max())},
                        "passed": ok}
        print(f"{layout:<11} {loaded_as:<36} max |diff| {diff.max():.2e} (relative {rel.max():.2e})  mean {diff.mean():.2e}  "
              f"missing {len(info.get('missing_keys', []))} unexpected {len(unexpected)}  {'ok' if ok else 'FAIL'}")
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    record = {
        "what": "exports of a text-only, a multimodal (published layout) and a tied checkpoint, trained and exported "
                "by hybridmoe, reloaded in transformers as the source's class: text log-probs vs hybridmoe score",
        "command": "scripts/check_hf_exports.sh",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "machine": platform.processor() or platform.machine(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "tokens_shape": list(tokens.shape), "tolerance_relative": TOLERANCE, "layouts": rows, "passed": passed,
    }
    if args.out:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(record, f, indent=2)
            f.write("\n")
        os.replace(tmp, args.out)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
