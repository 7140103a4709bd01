"""Reload an exported checkpoint in Hugging Face transformers and compare its log-probs with ours.

`hybridmoe train/rl --export-hf DIR` writes a sharded safetensors folder; this script is the check
that the ecosystem reads it as we do: transformers' `AutoModelForCausalLM.from_pretrained(DIR)`
(the reference implementation, float32) scores the token ids, and the per-token log-probs are
compared with `hybridmoe score --hf DIR` on the same ids. It writes a JSON record and exits 1 when
the largest difference is above the tolerance.

Needs torch and transformers, which are never dependencies of the package; run it with a separate
venv (`benchmarks/reference/README.md` says how to make one):

    hybridmoe score --hf DIR --tokens T.npy --out ours.npy
    REFVENV/bin/python scripts/check_hf_reload.py --hf DIR --tokens T.npy --ours ours.npy \
        --out benchmarks/records/hf_reload.json
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

# float32 on both sides; the fixture's own parity (tests/test_hf_convert.py) is ~1e-5.
TOLERANCE = 1e-4


def reference_logprobs(hf_dir: str, tokens_BT: np.ndarray) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    model.eval()
    ids = torch.from_numpy(tokens_BT.astype(np.int64))
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    return logp.gather(-1, ids[:, 1:, None])[..., 0].numpy()


def source_commit() -> str | None:
    """The checkout's commit, "+modified" when the package differs from it (what the record's
    `hybridmoe score` side ran); None outside git."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=root).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--", "hybridmoe"], capture_output=True,
                                 text=True, check=True, cwd=root).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+modified" if changed else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf", required=True, help="the exported Hugging Face folder")
    parser.add_argument("--tokens", required=True, help="int token ids [B, T] (.npy)")
    parser.add_argument("--ours", required=True, help="`hybridmoe score` log-probs [B, T-1] (.npy)")
    parser.add_argument("--out", help="JSON record to write")
    args = parser.parse_args()
    tokens = np.load(args.tokens)
    ours = np.load(args.ours)
    ref = reference_logprobs(args.hf, tokens)
    if ref.shape != ours.shape:
        print(f"shape mismatch: transformers {ref.shape}, ours {ours.shape}", file=sys.stderr)
        return 1
    diff = np.abs(ref - ours)
    index = json.load(open(os.path.join(args.hf, "model.safetensors.index.json")))
    record = {
        "what": "an exported checkpoint reloaded in transformers: per-token log-probs vs hybridmoe score",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": source_commit(),
        "machine": platform.processor() or platform.machine(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "hf_dir_files": sorted(os.listdir(args.hf)),
        "shards": sorted(set(index["weight_map"].values())),
        "tensors": len(index["weight_map"]),
        "tokens_shape": list(tokens.shape),
        "max_abs_diff": float(diff.max()),
        "mean_abs_diff": float(diff.mean()),
        "mean_logprob": {"transformers": float(ref.mean()), "hybridmoe": float(ours.mean())},
        "tolerance": TOLERANCE,
        "passed": bool(diff.max() <= TOLERANCE),
    }
    print(f"transformers {transformers.__version__} reloads {args.hf} ({len(record['shards'])} shard(s), "
          f"{record['tensors']} tensors): max |diff| {record['max_abs_diff']:.2e}, mean "
          f"{record['mean_abs_diff']:.2e} over {diff.size} log-probs (tolerance {TOLERANCE:g})")
    if args.out:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(record, f, indent=2)
            f.write("\n")
        os.replace(tmp, args.out)
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
