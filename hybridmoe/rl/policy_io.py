"""A policy to sample from, loaded from a Hugging Face folder (--hf DIR) or a run's latest
checkpoint (--run DIR), and batched generation of text from it (`hybridmoe generate` / `eval`)."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from hybridmoe.config.schema import Config
from hybridmoe.recipe.validate import check_requirements
from hybridmoe.data.sources import config_tokenizer
from hybridmoe.data.tokenizer import Tokenizer
from hybridmoe.parallel.host import fetch_global, put_global
from hybridmoe.parallel.rules import mesh_axes_of
from hybridmoe.rl.sampler import SamplingOptions, left_pad_prompts, make_generate
from hybridmoe.run.setup import RunSetup, build


class PolicyError(ValueError):
    """A --run folder that holds no usable checkpoint; the message names it and the fix."""


@dataclasses.dataclass
class Policy:
    cfg: Config
    setup: RunSetup
    params: object
    tokenizer: Tokenizer


def run_config(run_dir: Path) -> tuple[Config, int, dict]:
    """(config, step, metadata) of a run's latest complete checkpoint, read without starting JAX
    (the mesh's CPU device count must be set before JAX starts)."""
    steps_dir = Path(run_dir) / "checkpoints"
    steps = sorted(int(p.name) for p in steps_dir.iterdir() if p.name.isdigit()) if steps_dir.is_dir() else []
    if not steps:
        raise PolicyError(f"--run {run_dir}: no checkpoint under {steps_dir}; give the --out folder of a "
                          "`train` or `rl` run that saved one")
    meta_path = steps_dir / str(steps[-1]) / "meta" / "metadata"
    try:
        meta = json.loads(meta_path.read_text())
        cfg = Config.model_validate(meta["config"])
    except (OSError, ValueError, KeyError) as e:
        raise PolicyError(f"{meta_path}: not this program's run metadata ({e})") from None
    check_requirements(cfg)
    return cfg, steps[-1], meta


def load_policy(cfg: Config, *, hf_dir: Path | None = None, run_dir: Path | None = None) -> Policy:
    setup = build(cfg)
    if hf_dir is not None:
        from hybridmoe.run.hf_io import params_from_hf
        params = params_from_hf(setup, Path(hf_dir))
    else:
        from hybridmoe.model.params import abstract_params
        from hybridmoe.run.checkpoint import Checkpoints
        _, step, meta = run_config(run_dir)
        abstract = setup.abstract_state()
        if "phase" in meta:  # an rl run: {"train": state, "ref_params"?}
            abstract = {"train": abstract}
            if cfg.rl.beta > 0:
                abstract["ref_params"] = abstract_params(setup.specs, setup.param_shardings)
        ckpt = Checkpoints(Path(run_dir) / "checkpoints")
        try:
            state, _ = ckpt.restore(step, abstract)
        finally:
            ckpt.close()
        params = (state["train"] if "phase" in meta else state)["params"]
    return Policy(cfg, setup, params, config_tokenizer(cfg))


def prompt_ids(policy: Policy, prompts: list[str]) -> list[list[int]]:
    tok = policy.tokenizer
    out = []
    for i, text in enumerate(prompts):
        ids = ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(text)
        if not ids:
            raise ValueError(f"prompt {i} ({text[:40]!r}) encodes to no tokens")
        out.append(ids)
    return out


def generate_texts(policy: Policy, prompts: list[str], *, max_new_tokens: int, temperature: float, top_p: float,
                   batch_size: int, seed: int = 0) -> tuple[list[dict], dict]:
    """Completions of `prompts` in batches of `batch_size` rows (one compile: every batch is padded
    to the same rows and prompt length). Returns per-prompt records (text, token ids, length,
    truncated) and timing: the sampler is compiled first and timed apart (compile_s), so
    tokens_per_s counts the generation of every batch and no compile."""
    tok, cfg = policy.tokenizer, policy.cfg
    ids = prompt_ids(policy, prompts)
    prompt_len = max(len(x) for x in ids)
    if prompt_len + max_new_tokens > cfg.model.max_seq_len:
        raise ValueError(f"the longest prompt ({prompt_len} tokens) + --max-new-tokens {max_new_tokens} exceeds "
                         f"model.max_seq_len={cfg.model.max_seq_len}")
    setup = policy.setup
    rows_sh = setup.batch_sharding(0)
    axes = rows_sh.spec[0]
    shards = math.prod(setup.mesh.shape[a] for a in mesh_axes_of(axes))
    rows = -(-batch_size // shards) * shards  # the batch splits over the mesh's batch shards
    opts = SamplingOptions(max_new_tokens, temperature, top_p, tok.eos_id, tok.pad_id, stop_ids=tok.stop_ids)
    generate = make_generate(cfg, opts, in_shardings=(setup.param_shardings, rows_sh, rows_sh, rows_sh,
                                                      NamedSharding(setup.mesh, PartitionSpec())))
    key = jax.random.key(seed)
    records, times, counts = [], [], []
    with setup.context():
        batches = []
        for start in range(0, len(ids), rows):
            chunk = ids[start:start + rows]
            batches.append((start, chunk, put_global(
                left_pad_prompts(chunk + [chunk[-1]] * (rows - len(chunk)), prompt_len, tok.pad_id), rows_sh)))
        t0 = time.perf_counter()
        compiled = generate.lower(policy.params, *batches[0][2], key).compile()
        compile_s = time.perf_counter() - t0
        for start, chunk, batch in batches:
            key, sub = jax.random.split(key)
            t0 = time.perf_counter()
            out = fetch_global(compiled(policy.params, *batch, sub))
            times.append(time.perf_counter() - t0)
            counts.append(int(np.asarray(out["lengths"])[:len(chunk)].sum()))
            for i in range(len(chunk)):
                n = int(out["lengths"][i])
                completion = [int(t) for t in np.asarray(out["completion"][i][:n])]
                records.append({"prompt": prompts[start + i], "completion": tok.decode(completion), "tokens": n,
                                "truncated": bool(out["truncated"][i]), "prompt_ids": list(map(int, chunk[i])),
                                "completion_ids": completion})
    return records, {"batches": len(times), "rows_per_batch": rows, "seconds": sum(times), "compile_s": compile_s,
                     "new_tokens": sum(counts), "tokens_per_s": sum(counts) / sum(times)}
