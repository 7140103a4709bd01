"""Supervised next-token training: the run around the jitted step (data, metrics, checkpoints)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import jax

from hybridmoe.config.schema import Config
from hybridmoe.data.packing import split_micro_batches
from hybridmoe.data.sources import long_document_metrics, position_record, start_position, training_source
from hybridmoe.parallel.host import fetch_global, put_global, put_process_local
from hybridmoe.run.hf_io import params_from_hf
from hybridmoe.run.memory_fit import GIB, memory_budget_bytes
from hybridmoe.run.session import open_session, start_config
from hybridmoe.run.setup import build, init_state, jit_train_step
from hybridmoe.run.step_plan import plan_train

log = logging.getLogger(__name__)


def train(cfg: Config, out: Path | None = None, *, resume: bool = False, overwrite: bool = False,
          progress: bool = True, init_hf: Path | None = None, export_hf: Path | None = None) -> list[dict]:
    """Run cfg.train.steps optimizer steps; returns the per-step metrics.

    init_hf: start from this Hugging Face checkpoint's weights; export_hf: write the final weights
    there in the Hugging Face layout (with the checkpoint's tokenizer and generation files)."""
    cfg = start_config(cfg, out, resume=resume, overwrite=overwrite, init_hf=init_hf, export_hf=export_hf)
    source = training_source(cfg)  # reads and checks the data before anything is written
    # Before anything is written or placed on the device: train.micro_batches chosen (auto) or
    # checked against the device's free memory, on the set-up open_session then takes (build() keeps
    # it). Without a budget (a CPU, none set) nothing is refused and auto is the fewest count.
    budget = memory_budget_bytes(cfg)
    plan = plan_train(build(cfg), budget, source.fields) if budget is not None and cfg.train.steps else None
    if plan is not None:
        log.info("train.micro_batches=%s: the training step in %d micro-batch(es) (%.2f GiB per device)",
                 cfg.train.micro_batches, plan.count, plan.need / GIB)
    micro_batches = plan.count if plan is not None else cfg.train.fewest_micro_batches

    def fresh(setup, hf_tree):
        state = init_state(setup, jax.random.key(cfg.train.seed))
        return {**state, "params": params_from_hf(setup, init_hf, hf_tree)} if hf_tree is not None else state

    # A checkpoint whose file cursors are not this host count's is refused before its restore.
    session = open_session(cfg, out, resume=resume, overwrite=overwrite, init_hf=init_hf,
                           abstract_tree=lambda setup: setup.abstract_state(), fresh_tree=fresh,
                           check_saved=lambda saved: start_position(saved, source.host_local))
    position = start_position(session.saved_meta, source.host_local)
    data_counts = long_document_metrics(source)  # documents longer than train.seq_len: in the first record
    step_fn = plan.compiled if plan is not None else session.setup.kept("train_step", lambda: jit_train_step(session.setup))

    def step(state, i: int):
        nonlocal position
        rows, position = source.batch(i, position)
        rows = split_micro_batches(rows, micro_batches)
        put = put_process_local if source.host_local else put_global
        batch = put(rows, session.setup.batch_sharding(1))
        t0 = time.perf_counter()
        state, m = step_fn(state, batch)
        m = {k: float(v) for k, v in fetch_global(m).items()}
        dt = time.perf_counter() - t0
        rec = {"loss": m["loss"], "grad_norm": m["grad_norm"], "tokens": int(m["tokens"]),
               "loss_tokens": int(m["loss_tokens"]), "tokens_per_s": m["tokens"] / dt, "step_time_s": dt}
        if "moe_dropped" in m:  # expert buffers (moe.capacity_factor > 0) report their drops
            rec["moe_dropped"] = int(m["moe_dropped"])
        rec["update_skipped"] = int(m["update_skipped"])
        rec["micro_batches"] = micro_batches
        if i == 0:  # what data.long_documents did, in the run's first record (a resume's metrics equal
            rec.update(data_counts)  # the uninterrupted run's; its start-up log repeats the counts)
        return state, rec, {"loss": f"{m['loss']:.4f}"}

    t = cfg.train
    history = session.run(step, t.steps, checkpoint_every=t.checkpoint_every, log_every=t.log_every,
                          step_meta=lambda done: {"data_position": position_record(position)},
                          progress=progress, desc="train")
    session.export(export_hf, session.tree["params"])
    return history
