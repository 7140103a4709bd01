"""Reload each `--export-hf` of tests/hf_layouts.py's checkpoints in transformers, as the class its
source names (config.json `architectures`), and compare the text log-probs with `hybridmoe score`,
in float32 and in float64 on both sides.

The layouts: text-only (Qwen3_5MoeForCausalLM), the published multimodal form
(Qwen3_5MoeForConditionalGeneration: vision tower, MTP tensors, three shards) and tied embeddings.
scripts/check_hf_exports.sh makes the sources, trains and exports each with `hybridmoe train
--init-hf SRC --export-hf OUT`, scores the exports with `hybridmoe score` (float32) and
scripts/score_float64.py (float64), then runs this with the reference venv. Per layout it records
transformers' loading report (no missing or unexpected tensor is allowed but the MTP ones, which
transformers does not model) and the log-prob distances:

  float32 gap           ours float32 vs transformers float32: what a user sees, held to TOLERANCE
  same math             ours float64 vs transformers float64: held to FLOAT64_TOLERANCE; rounding is
                        out of the way here, so what is left is a difference in what is computed
  each side's rounding  ours float32 vs ours float64, transformers float32 vs transformers float64

Exit 1 when a layout fails either tolerance or its loading report.

    REFVENV/bin/python scripts/check_hf_exports.py --work W --tokens T.npy --out benchmarks/records/hf_exports.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys

import numpy as np
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

# Float32 rounding grows with the size of what is rounded: a log-prob near -34 (the tied layout's
# head is the embedding table, whose logits are large) carries more absolute error than one near -7.
# Hence a criterion relative to max(1, |logp|); benchmarks/records/hf_exports.json has each side's
# rounding per layout, which this bounds with room.
TOLERANCE = 1e-5  # of max(1, |logp|), ours float32 vs transformers float32
FLOAT64_TOLERANCE = 1e-11  # of max(1, |logp|), ours float64 vs transformers float64
LAYOUTS = ("text", "multimodal", "tied")


class _NarrowFloats(TorchDispatchMode):
    """Collects every op whose result is a floating dtype other than float64."""

    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64:
                self.seen.add(f"{func}->{t.dtype}")
        return out


@contextlib.contextmanager
def _float32_reads_float64():
    """transformers' modelling code casts to float32 on its own (norms, softmaxes, the GDN core, rotary
    angles: `torch.float32`, `torch.float`, `.float()`), so `dtype=torch.float64` alone leaves float32
    islands. Inside this block those names are float64: a measuring device, as scripts/score_float64.py
    is on our side."""
    saved = torch.float32, torch.float, torch.Tensor.float
    torch.float32 = torch.float = torch.float64
    torch.Tensor.float = torch.Tensor.double
    try:
        yield
    finally:
        torch.float32, torch.float, torch.Tensor.float = saved


def reference_logprobs(export: str, architecture: str, tokens_BT: np.ndarray, precision: str):
    """[B, T-1] log-probs of tokens_BT by transformers. precision: "float32"; "float64" (every float32 the
    modelling code casts to read as float64, checked op by op); or "float64-as-loaded" (the model loaded
    with dtype=torch.float64 and nothing else, its own float32 casts kept)."""
    dtype = torch.float32 if precision == "float32" else torch.float64
    cls = getattr(transformers, architecture)
    model, info = cls.from_pretrained(export, dtype=dtype, output_loading_info=True,
                                      attn_implementation="eager", experts_implementation="eager")
    model.eval()
    ids = torch.from_numpy(tokens_BT.astype(np.int64))
    exact = precision == "float64"
    with _float32_reads_float64() if exact else contextlib.nullcontext():
        if exact:  # the rotary frequencies were computed in float32 at construction: again, in float64
            for m in model.modules():
                if hasattr(m, "inv_freq") and hasattr(m, "rope_type") and hasattr(m, "compute_default_rope_parameters"):
                    inv_freq, _ = m.compute_default_rope_parameters(m.config, m.inv_freq.device)
                    assert m.rope_type == "default" and inv_freq.dtype == torch.float64, (m.rope_type, inv_freq.dtype)
                    m.inv_freq, m.original_inv_freq = inv_freq, inv_freq.clone()
        narrow = _NarrowFloats()
        with torch.no_grad(), narrow if exact else contextlib.nullcontext():
            logits = model(input_ids=ids).logits.to(dtype)
            logp = torch.log_softmax(logits[:, :-1], dim=-1)
    if narrow.seen:
        raise RuntimeError(f"{export}: the float64 forward still computed in narrower floats: {sorted(narrow.seen)[:8]}; "
                           "a float32 cast in transformers escapes _float32_reads_float64, so this is not a float64 figure")
    info = {k: sorted(v) for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    return logp.gather(-1, ids[:, 1:, None])[..., 0].numpy().astype(np.float64), type(model).__name__, info


def distance(a: np.ndarray, b: np.ndarray, exact: np.ndarray) -> dict:
    """max / mean |a - b|, and relative to max(1, |logp|) with logp the float64 reference `exact`."""
    diff = np.abs(a - b)
    rel = diff / np.maximum(1.0, np.abs(exact))
    return {"max_abs": float(diff.max()), "mean_abs": float(diff.mean()), "max_rel": float(rel.max()),
            "logprob_at_max_abs": float(exact.flat[int(diff.argmax())])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", required=True,
                        help="folder with sources/L, exports/L, ours_L.npy (float32) and ours64_L.npy (float64) per layout")
    parser.add_argument("--tokens", required=True, help="int token ids [B, T] (.npy)")
    parser.add_argument("--out", help="JSON record to write")
    args = parser.parse_args()
    tokens = np.load(args.tokens)
    torch.set_num_threads(2)
    rows, passed = {}, True
    for layout in LAYOUTS:
        source, export = os.path.join(args.work, "sources", layout), os.path.join(args.work, "exports", layout)
        architecture = json.load(open(os.path.join(source, "config.json")))["architectures"][0]
        theirs32, loaded_as, info = reference_logprobs(export, architecture, tokens, "float32")
        theirs64, _, _ = reference_logprobs(export, architecture, tokens, "float64")
        as_loaded64, _, _ = reference_logprobs(export, architecture, tokens, "float64-as-loaded")
        ours32, ours64 = (np.load(os.path.join(args.work, f"{name}_{layout}.npy")).astype(np.float64)
                          for name in ("ours", "ours64"))
        for name, a in (("ours", ours32), ("ours64", ours64)):
            if a.shape != theirs32.shape:
                raise ValueError(f"{name}_{layout}.npy has shape {a.shape}, transformers' log-probs {theirs32.shape}: "
                                 f"score the same token file ({args.tokens})")
        gap = distance(ours32, theirs32, theirs64)
        same_math = distance(ours64, theirs64, theirs64)
        unexpected = [k for k in info.get("unexpected_keys", []) if not k.startswith("mtp.")]
        ok = bool(gap["max_rel"] <= TOLERANCE and same_math["max_rel"] <= FLOAT64_TOLERANCE
                  and not info.get("missing_keys") and not unexpected
                  and not info.get("mismatched_keys") and loaded_as == architecture)
        passed &= ok
        rows[layout] = {"source_architecture": architecture, "loaded_as": loaded_as, "loading_info": info,
                        "export_files": sorted(os.listdir(export)), "mean_logprob_float64": float(theirs64.mean()),
                        "float32_gap": gap, "float64_ours_vs_transformers": same_math,
                        "ours_float32_vs_float64": distance(ours32, ours64, theirs64),
                        "transformers_float32_vs_float64": distance(theirs32, theirs64, theirs64),
                        "transformers_as_loaded_float64_vs_float64": distance(as_loaded64, theirs64, theirs64),
                        "passed": ok}
        print(f"{layout:<11} {loaded_as:<36} float32 gap {gap['max_abs']:.2e} (relative {gap['max_rel']:.2e})  "
              f"float64 gap {same_math['max_abs']:.2e}  ours f32-f64 {rows[layout]['ours_float32_vs_float64']['max_abs']:.2e}  "
              f"transformers f32-f64 {rows[layout]['transformers_float32_vs_float64']['max_abs']:.2e}  "
              f"missing {len(info.get('missing_keys', []))} unexpected {len(unexpected)}  {'ok' if ok else 'FAIL'}")
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                    text=True, check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        commit, dirty = None, None
    record = {
        "what": "exports of a text-only, a multimodal (published layout) and a tied checkpoint, trained and exported "
                "by hybridmoe, reloaded in transformers as the source's class: text log-probs vs hybridmoe score, "
                "each side in float32 and in float64",
        "command": "scripts/check_hf_exports.sh",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit, "uncommitted_changes": dirty,
        "machine": platform.processor() or platform.machine(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "tokens_shape": list(tokens.shape), "tolerance_relative": TOLERANCE,
        "float64_tolerance_relative": FLOAT64_TOLERANCE, "layouts": rows, "passed": passed,
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
