"""The MoE block's static plan and small figures pinned by hand (model/moe.py): each GroupedPlan
field read from its own config key, the decode step's row count rule at its edges, and the
capacity buffer's rows. Config objects and tiny eager arrays only."""

from __future__ import annotations

from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np

from hybridmoe.config.schema import KernelsConfig, ModelConfig, MoEConfig
from hybridmoe.model import moe as moe_mod


def _plan(moe=None, gmm=None, interpret=False, fp8=None, platform="cpu"):
    m = ModelConfig(num_experts=6, num_experts_per_tok=2)
    kernels = KernelsConfig.model_validate({"gmm": gmm or {}, "interpret": interpret})
    quant = None if fp8 is None else SimpleNamespace(fp8_gmm=fp8)
    return moe_mod.GroupedPlan.of(m, MoEConfig.model_validate(moe or {}), kernels, quant, platform=platform)


def test_grouped_plan_reads_each_field_from_its_own_key():
    plan = _plan(moe={"capacity_factor": 1.5, "token_chunks": 3, "wi_fused_swiglu": True, "gather_backward": True},
                 gmm={"backend": "pallas_tpu", "xla_tile_rows": 64, "wi_fwd_rhs_buffer_count": 3,
                      "epilogue": "match_unfused"},
                 interpret=True, fp8=True)
    assert plan.num_experts == 6 and plan.capacity_factor == 1.5 and plan.token_chunks == 3
    assert plan.wi_fused_swiglu and not plan.wo_fused_dswiglu and not plan.router_grad_from_wo_input
    assert plan.gather_backward and plan.interpret and plan.fp8
    assert (plan.backend, plan.xla_tile_rows, plan.rhs_buffer_count, plan.epilogue) == ("pallas_tpu", 64, 3, "match_unfused")
    other = _plan(moe={"wo_fused_dswiglu": True, "router_grad_from_wo_input": True}, fp8=False)
    assert other.wo_fused_dswiglu and other.router_grad_from_wo_input and not other.wi_fused_swiglu
    assert not other.fp8 and not other.interpret and not other.gather_backward
    assert not _plan().fp8  # no quant config


def test_grouped_plan_resolves_the_xla_impl_on_the_platform():
    assert _plan(platform="cpu").xla_impl == "row_tiles"
    assert _plan(platform="tpu").xla_impl == "ragged_dot"
    assert _plan(gmm={"xla_impl": "ragged_dot"}, platform="cpu").xla_impl == "ragged_dot"
    assert _plan(gmm={"xla_impl": "row_tiles"}, platform="tpu").xla_impl == "row_tiles"


def test_grouped_plan_tiles_by_tiling_mode():
    assert _plan().tiles is None and _plan().tile_n_per_half is None   # heuristic: the kernels' defaults
    auto = _plan(gmm={"tiling": "auto", "vmem_limit_mib": 24.0}).tiles
    assert auto.wi_fwd.from_table and auto.wi_fwd.vmem_limit_mib == 24.0 and auto.wo_drhs.from_table
    assert _plan(gmm={"tiling": "auto", "wi_fwd_tile_n_per_half": 256}).tile_n_per_half is None  # explicit only
    explicit = _plan(gmm={"tiling": "explicit", "tm": 64, "tk": 256, "tn": 512, "wi_fwd_tile_n_per_half": 256})
    assert explicit.tile_n_per_half == 256
    assert (explicit.tiles.wo_fwd.tm, explicit.tiles.wo_fwd.tk, explicit.tiles.wo_fwd.tn) == (64, 256, 512)
    assert _plan(gmm={"tiling": "explicit"}).tile_n_per_half is None  # 0: unset


def test_is_default_counts_one_token_chunk_as_no_lever():
    assert _plan(moe={"token_chunks": 1}, platform="tpu").is_default
    assert not _plan(moe={"token_chunks": 2}, platform="tpu").is_default
    assert _plan(platform="cpu").runs_row_tiles and not _plan(platform="tpu").runs_row_tiles
    # a lever leaves the default program, row tiles included
    assert not _plan(moe={"token_chunks": 2}, platform="cpu").runs_row_tiles


def test_every_expert_is_cheaper_at_its_edges():
    # 3 tokens, k 2, 4 experts, tiles of 4 rows: ceil(6 / 4) + 4 = 6 tiles = 24 rows against 3 x 4 = 12
    assert moe_mod.every_expert_is_cheaper(3, 2, 4, 4)
    # 6 tokens, k 1, 4 experts, tiles of 2: ceil(6 / 2) + 4 = 7 tiles = 14 rows against 24
    assert not moe_mod.every_expert_is_cheaper(6, 1, 4, 2)
    # 5 tokens, k 3, 8 experts, tiles of 4: ceil(15 / 4) = 4 (not 3) + 8 = 12 tiles = 48 rows against 40
    assert moe_mod.every_expert_is_cheaper(5, 3, 8, 4)
    # 6 tokens, k 3, 8 experts, tiles of 4: ceil(18 / 4) = 5 + 8 = 13 tiles = 52 rows against 48
    assert moe_mod.every_expert_is_cheaper(6, 3, 8, 4)
    # 7 tokens: ceil(21 / 4) = 6 + 8 = 14 tiles = 56 rows against 56: the tie goes to every expert
    assert moe_mod.every_expert_is_cheaper(7, 3, 8, 4)
    assert not moe_mod.every_expert_is_cheaper(8, 3, 8, 4)  # ceil(24 / 4) + 8 = 14 tiles = 56 against 64


def test_capacity_keeps_a_row_only_below_the_buffer():
    pos = jnp.array([0, 1, 2, 3])
    assert np.asarray(moe_mod.within_capacity(pos, 2)).tolist() == [True, True, False, False]
    assert np.asarray(moe_mod.within_capacity(pos, 0)).tolist() == [False] * 4
    # a factor over the even share of 1 row: never below one row
    assert moe_mod.capacity_rows(3, 8, 0.5) == 1
    assert moe_mod.capacity_rows(24, 8, 0.5) == 2    # 0.5 x 3 = 1.5 -> 2
    assert moe_mod.capacity_rows(20, 8, 0.5) == 2    # 0.5 x 2.5 = 1.25 -> 2: up, not to the nearest


# ---------------------------------------------------------------------------------------------
# which program runs: grouped_experts' token chunks and moe_local's dispatch


def test_token_chunks_run_only_where_they_divide_the_tokens(monkeypatch):
    ran = []
    monkeypatch.setattr(moe_mod, "_grouped_rows", lambda x, *a: ran.append(("one", x.shape[0])) or (x, 0))
    monkeypatch.setattr(moe_mod, "token_chunked_experts", lambda x, *a: ran.append(("chunks", x.shape[0])) or (x, 0))
    x, idx = jnp.zeros((6, 2)), jnp.zeros((6, 2), jnp.int32)
    for chunks in (1, 2, 3, 4, 6):
        moe_mod.grouped_experts(x, None, idx, None, None, moe_mod.GroupedPlan(num_experts=4, token_chunks=chunks))
    # 1: one piece; 2, 3 and 6 divide 6 tokens; 4 does not (a decode step's few rows): one piece
    assert ran == [("one", 6), ("chunks", 6), ("chunks", 6), ("one", 6), ("chunks", 6)]


def _stub_programs(monkeypatch):
    ran = []
    for name in ("dense_experts", "every_expert_rows", "sparse_experts"):
        monkeypatch.setattr(moe_mod, name, lambda x, *a, name=name, **kw: ran.append(name) or jnp.zeros_like(x))
    monkeypatch.setattr(moe_mod, "tiled_experts", lambda x, *a, **kw: ran.append(("tiled", a[-1])) or jnp.zeros_like(x))
    monkeypatch.setattr(moe_mod, "grouped_experts", lambda x, *a, **kw: ran.append("grouped") or (jnp.zeros_like(x), 7))
    return ran


def _moe_local(tokens, moe=None, gmm=None, decode_step=False, return_dropped=False):
    m = ModelConfig(d_model=4, num_experts=8, num_experts_per_tok=2, shared_expert_intermediate_size=0)
    p = {"router": jnp.zeros((4, 8)), "wi": None, "wo": None}
    kernels = KernelsConfig.model_validate({"gmm": {"xla_impl": "row_tiles", "xla_tile_rows": 8, **(gmm or {})}})
    return moe_mod.moe_local(p, jnp.zeros((tokens, 4)), m, MoEConfig.model_validate(moe or {}), kernels,
                             decode_step=decode_step, return_dropped=return_dropped)


def test_moe_local_runs_the_program_its_keys_and_the_step_ask_for(monkeypatch):
    ran = _stub_programs(monkeypatch)
    _moe_local(4, moe={"impl": "dense"})
    # a decode step of 3 tokens: ceil(3 x 2 / 8) + 8 = 9 tiles of 8 = 72 rows against 3 x 8 = 24: every expert
    _moe_local(3, decode_step=True)
    # 16 tokens: ceil(32 / 8) + 8 = 12 tiles = 96 rows against 128: row tiles of 8 rows
    _moe_local(16, decode_step=True)
    _moe_local(3)                                   # not a decode step: row tiles
    _moe_local(3, gmm={"xla_impl": "ragged_dot"})   # the default program on ragged_dot
    _, dropped = _moe_local(3, moe={"capacity_factor": 1.0}, return_dropped=True)  # a lever: grouped
    assert ran == ["dense_experts", "every_expert_rows", ("tiled", 8), ("tiled", 8), "sparse_experts", "grouped"]
    assert dropped == 7
    # the default program reports no drops
    assert int(_moe_local(3, return_dropped=True)[1]) == 0
