"""Supervised next-token training: the run around the jitted step (data, metrics, checkpoints)."""

from __future__ import annotations

import time
from pathlib import Path

import jax
from tqdm import tqdm

from hybridmoe.config.schema import Config
from hybridmoe.parallel.host import fetch_global, is_lead_host, put_global, put_process_local
from hybridmoe.data.sources import position_record, start_position, training_source
from hybridmoe.run.guard import NonFiniteGuard
from hybridmoe.run.metrics import MetricsWriter
from hybridmoe.run.run_dir import RunError, check_paths, config_record, open_checkpoints
from hybridmoe.run.setup import build, init_state, jit_train_step


def open_run(cfg: Config, out: Path | None, resume: bool, overwrite: bool = False):
    """(setup, state, start_step, checkpoints): a fresh state, or the latest finished checkpoint of
    `out` (step 0 when a resume finds none)."""
    setup = build(cfg)
    ckpt = open_checkpoints(out, resume=resume, overwrite=overwrite)
    latest = ckpt.latest_step() if ckpt else None
    if latest is not None:  # a resume (a fresh start refuses a folder with a finished checkpoint)
        state, meta = ckpt.restore(latest, setup.abstract_state())
        saved_model = meta.get("config", {}).get("model")
        if saved_model != config_record(cfg)["model"]:
            raise RunError(f"--resume: the checkpoint in {out} was written with a different model config; "
                           "resume with the same recipe and model.* overrides")
        return setup, state, latest, ckpt
    return setup, init_state(setup, jax.random.key(cfg.train.seed)), 0, ckpt


def train(cfg: Config, out: Path | None = None, *, resume: bool = False, overwrite: bool = False,
          progress: bool = True, init_hf: Path | None = None, export_hf: Path | None = None) -> list[dict]:
    """Run cfg.train.steps optimizer steps; returns the per-step metrics.

    init_hf: start from this Hugging Face checkpoint's weights; export_hf: write the final weights
    there in the Hugging Face layout (with the checkpoint's tokenizer and generation files)."""
    from hybridmoe.run.hf_io import config_with_hf_model, export_hf_checkpoint, params_from_hf, read_hf_weights
    check_paths(out, resume=resume, overwrite=overwrite, export_hf=export_hf, init_hf=init_hf)
    if init_hf is not None:
        cfg = config_with_hf_model(cfg, init_hf)
    source = training_source(cfg)  # reads and checks the data before anything is written
    hf_tree = read_hf_weights(init_hf, out, resume)  # a corrupt file fails here, before anything is written
    setup, state, start, ckpt = open_run(cfg, out, resume, overwrite)
    if hf_tree is not None and not start:
        state = {**state, "params": params_from_hf(setup, init_hf, hf_tree)}
    position = start_position(ckpt.restore_meta(start) if start else None)
    writer = (MetricsWriter(out, resume_from_step=start)
              if out is not None and is_lead_host() else None)
    step_fn = jit_train_step(setup)
    t, history = cfg.train, []
    guard = NonFiniteGuard(t)
    meta = {"config": config_record(cfg)}
    bar = tqdm(range(start, t.steps), initial=start, total=t.steps, disable=not progress or not is_lead_host(),
               desc="train")
    try:
        with setup.context():
            for step in bar:
                rows, position = source.batch(step, position)
                put = put_process_local if source.host_local else put_global
                batch = put(rows, setup.batch_sharding(1))
                t0 = time.perf_counter()
                state, m = step_fn(state, batch)
                m = {k: float(v) for k, v in fetch_global(m).items()}
                dt = time.perf_counter() - t0
                rec = {"step": step, "loss": m["loss"], "grad_norm": m["grad_norm"], "tokens": int(m["tokens"]),
                       "loss_tokens": int(m["loss_tokens"]), "tokens_per_s": m["tokens"] / dt, "step_time_s": dt}
                if "moe_dropped" in m:  # expert buffers (moe.capacity_factor > 0) report their drops
                    rec["moe_dropped"] = int(m["moe_dropped"])
                rec["update_skipped"] = int(m["update_skipped"])
                history.append(rec)
                stop = guard.observe(step, bool(m["update_skipped"]))
                if writer is not None and (step % t.log_every == 0 or stop):
                    writer.write(step, {k: v for k, v in rec.items() if k != "step"})
                bar.set_postfix(loss=f"{m['loss']:.4f}")
                done = step + 1
                if stop is not None:
                    if ckpt is not None:
                        ckpt.save(done, state, {**meta, "data_position": position_record(position)})
                    raise stop
                if ckpt is not None and t.checkpoint_every and done % t.checkpoint_every == 0 and done < t.steps:
                    ckpt.save(done, state, {**meta, "data_position": position_record(position)})
            if ckpt is not None and t.steps > start:
                ckpt.save(t.steps, state, {**meta, "data_position": position_record(position)})
    finally:
        if ckpt is not None:
            ckpt.close()
        if writer is not None:
            writer.close()
    if export_hf is not None:
        export_hf_checkpoint(export_hf, cfg, state["params"], source_dir=init_hf)
    return history
