"""The Mosaic TPU grouped-matmul kernels compile for a real TPU target from this CPU host: each
kernel alone, the fused pair and its weight pipeline, the training step with the fused levers as
`hybridmoe inspect --target` compiles it, the xla backend over more groups than TPU's ragged_dot
takes (tests/tpu_target.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from hybridmoe.kernels import gmm as K
from hybridmoe.kernels.gmm.tiling import Tiling

from tests.tpu_target import TOPOLOGY, compile_abstract, spec

pytestmark = pytest.mark.tpu_compile

M, D, F, E, TN = 512, 256, 256, 4, 128
TILING = Tiling(tm=128, tk=128, tn=128)


@pytest.mark.parametrize("transpose", [False, True])
def test_gmm_compiles(device, transpose):
    x = spec((M, D), jnp.bfloat16, device)
    w = spec((E, F, D) if transpose else (E, D, F), jnp.bfloat16, device)
    gs = spec((E,), jnp.int32, device)

    def loss(x, w, gs):
        y = K.gmm(x, w, gs, transpose_rhs=transpose, backend="pallas_tpu", tiling=TILING)
        return jnp.sum(y.astype(jnp.float32))

    compile_abstract(jax.grad(loss, (0, 1)), x, w, gs)  # gmm, gmm_t and tgmm


def test_accumulating_weight_gradient_compiles_in_place(device):
    # moe.token_chunks' backward: the weight gradient added into a carried [G, K, N] by the tgmm
    # kernel. Mosaic takes the accumulator's block, and the compiled kernel call writes its output
    # into the accumulator operand (the loop's carry) instead of a buffer of its own.
    x = spec((M, D), jnp.bfloat16, device)
    g = spec((4, M, F), jnp.bfloat16, device)
    gs = spec((E,), jnp.int32, device)

    def summed(x, g, gs):
        def trip(acc, g_MF):
            return K.tgmm(x, g_MF, gs, backend="pallas_tpu", tiling=TILING, acc=acc), None

        return jax.lax.scan(trip, jnp.zeros((E, D, F), jnp.bfloat16), g)[0]

    calls = [line for line in compile_abstract(summed, x, g, gs).hlo_text.splitlines()
             if "custom-call(" in line and "tgmm" in line.split("=")[0]]
    assert len(calls) == 1 and "output_to_operand_aliasing={{}: (7, {})}" in calls[0], calls


@pytest.mark.parametrize("depth", [0, 2])
def test_fused_pair_compiles(device, depth):
    x = spec((M, D), jnp.bfloat16, device)
    wi = spec((E, D, 2 * F), jnp.bfloat16, device)
    wo = spec((E, F, D), jnp.bfloat16, device)
    s = spec((M,), jnp.float32, device)
    gs = spec((E,), jnp.int32, device)
    # One K tile (tk = D) so the weight depth applies.
    tiling = Tiling(tm=128, tk=D, tn=128, rhs_buffer_count=depth)

    def loss(x, wi, wo, s, gs):
        h, pre = K.wi_fused_swiglu(x, wi, gs, return_preact=True, tile_n_per_half=TN,
                              backend="pallas_tpu", tiling=tiling,
                              rhs_buffer_count=depth)
        y = K.wo_fused_dswiglu(h, wo, gs, preact=pre, preact_tile_n_per_half=TN, row_scale=s,
                          backend="pallas_tpu", tiling=tiling)
        return jnp.sum(y.astype(jnp.float32))

    compiled = compile_abstract(jax.grad(loss, (0, 1, 2, 3)), x, wi, wo, s, gs)
    text = compiled.hlo_text
    assert "wi_fused_swiglu_fwd" in text and "wo_fused_dswiglu_dlhs" in text
    assert ("wi_fused_swiglu_fwd_rhsbuf2" in text) == (depth == 2)


def test_vmem_overflow_is_caught(device):
    """The upstream tile at the limit `auto` gives it (its need is past auto's 48 MiB cap) overflows
    VMEM: the compile-only target does catch on-chip memory errors (figures:
    benchmarks/records/gmm_vmem.json)."""
    x = spec((1024, 4096), jnp.bfloat16, device)
    wi = spec((2, 4096, 4096), jnp.bfloat16, device)
    gs = spec((2,), jnp.int32, device)
    tiling = Tiling(tm=512, tk=4096, tn=1024)

    def fwd(x, wi, gs):
        return K.wi_fused_swiglu(x, wi, gs, return_preact=True, tile_n_per_half=1024,
                            backend="pallas_tpu", tiling=tiling)

    with pytest.raises(Exception, match="(?i)vmem"):
        compile_abstract(fwd, x, wi, gs)
    roomy = Tiling(tm=512, tk=4096, tn=1024, vmem_limit_mib=57.6)
    compile_abstract(lambda x, wi, gs: K.wi_fused_swiglu(x, wi, gs, return_preact=True, tile_n_per_half=1024,
                                            backend="pallas_tpu", tiling=roomy), x, wi, gs)


# The weight depth decides the fit (benchmarks/records/gmm_vmem.json): at this tile Mosaic's default
# (2 buffers in JAX 0.10.2) needs more than the 57.6 MiB scoped limit, one buffer fits.
DECIDING = dict(tm=256, tk=4096, tn=2048)


def _fused_forward(device, depth, tm, tk, tn, limit_mib=57.6):
    x = spec((1024, tk), jnp.bfloat16, device)
    wi = spec((2, tk, 2 * tn), jnp.bfloat16, device)  # one N tile per half
    gs = spec((2,), jnp.int32, device)
    tiling = Tiling(tm=tm, tk=tk, tn=tn, vmem_limit_mib=limit_mib)
    return compile_abstract(lambda x, wi, gs: K.wi_fused_swiglu(x, wi, gs, return_preact=True, tile_n_per_half=tn,
                                                   backend="pallas_tpu", tiling=tiling,
                                                   rhs_buffer_count=depth), x, wi, gs)


def test_wi_fwd_rhs_buffer_count_decides_the_fit(device):
    with pytest.raises(Exception, match="(?i)vmem"):
        _fused_forward(device, 0, **DECIDING)
    with pytest.raises(Exception, match="(?i)vmem"):
        _fused_forward(device, 2, **DECIDING)
    assert "wi_fused_swiglu_fwd_rhsbuf1" in _fused_forward(device, 1, **DECIDING).hlo_text


ONE_LAYER_STEP = ["mesh.cpu_devices=0", "model.layer_pattern=[attention]", "model.num_layers=1", "model.d_model=128",
                  "model.moe_intermediate_size=128", "kernels.gmm.backend=pallas_tpu", "kernels.gmm.tiling=explicit",
                  "moe.wi_fused_swiglu=true", "moe.wo_fused_dswiglu=true"]


@pytest.fixture(scope="module")
def one_layer_step(device):
    """(config, compiled step, facts) of the training step `inspect --target tpu7x:2x2x1` compiles: one attention
    layer with its MoE on the fused Mosaic kernels (tiny's four layers took 29 s to compile here,
    this 7.5 s)."""
    from hybridmoe.tools import train_program as tp
    from hybridmoe.recipe import load_config

    cfg = load_config("tiny", ONE_LAYER_STEP, platform="tpu")
    step = tp.compile_step(cfg, tp.tpu_target(TOPOLOGY), with_residuals=False)
    return cfg, step, tp.step_facts(step)


def test_inspect_compiles_the_training_step_for_a_tpu_target(one_layer_step):
    """`hybridmoe inspect --target tpu7x:2x2x1`'s path: the validator accepts the Pallas TPU
    kernels for a TPU target, the whole training step (fused levers on Mosaic kernels) compiles
    for the topology's 8 devices, and the memory facts come against the v7x's 96 GiB per device."""
    _, _, facts = one_layer_step
    mem = facts["memory"]
    assert facts["devices"] == 8 and mem["hbm"] == 96 * 2**30 and mem["fits"] is True
    assert 0 < mem["argument"] < mem["total"] and facts["flops"] > 0
    assert any(r["kind"] == "all-gather" for r in facts["collectives"])


def test_memory_only_reads_what_the_whole_compile_reports(one_layer_step, monkeypatch):
    """`inspect --memory-only`: the compile read at its buffer assignment while code generation goes
    on in its thread gives the whole compile's default memory space, peak buffers (each with its
    category), itemised peak, collectives and step estimate, and no memory analysis."""
    from hybridmoe.analysis.program import COMPILE_THREAD
    import threading

    from hybridmoe.analysis import compiled_facts
    from hybridmoe.tools import train_program as tp

    monkeypatch.setattr(compiled_facts, "_folder", None)  # the read itself, not the facts a rerun keeps
    cfg, whole_step, full = one_layer_step
    step = tp.compile_step(cfg, tp.tpu_target(TOPOLOGY), with_residuals=False, memory_only=True)
    going_on = [t for t in threading.enumerate() if t.name == COMPILE_THREAD]
    for t in going_on:  # a compile thread alive at the interpreter's exit aborts it (cli.entry exits at once)
        t.join()
    assert step.program.memory.get("memory_only") is True and going_on, \
        "the compile finished before its buffer assignment was read"
    facts = tp.step_facts(step)
    mem, whole = facts["memory"], full["memory"]
    assert mem["default_space"] == whole["default_space"] and mem["argument"] == whole["argument"]
    assert mem["temp"] is None and mem["total"] is None and mem["fits"] is True and facts["flops"] is None
    for key in ("peak_buffers", "collectives"):
        assert facts[key] == full[key], key
    peak, whole_peak = facts["peak_by_category"], full["peak_by_category"]
    assert peak["categories"] == whole_peak["categories"] and peak["heap_share"] == whole_peak["heap_share"]
    assert peak["share"] is None and peak["heap_gaps"] is None
    from hybridmoe.analysis.step_estimate import estimate_step

    assert estimate_step(step, "tpu7x") == estimate_step(whole_step, "tpu7x")


def test_inspect_memory_only_writes_its_record_and_exits(one_layer_step, tmp_path):
    """The command, in a process of its own: `hybridmoe inspect --memory-only` prints the memory
    table, writes its record (the whole compile's default space, no memory analysis) and exits 0
    (that a compile still going on ends with the process: tests/test_inspect_memory.py)."""
    import json
    import subprocess
    import sys

    _, _, full = one_layer_step
    out = tmp_path / "memory_only.json"
    done = subprocess.run([sys.executable, "-m", "hybridmoe", "inspect", "recipe=tiny", *ONE_LAYER_STEP,
                           "--target", TOPOLOGY, "--memory-only", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out.read_text())
    mem = record["programs"]["base"]["memory"]
    assert record["memory_only"] is True and mem["memory_only"] is True and mem["temp"] is None
    assert mem["default_space"] == full["memory"]["default_space"]
    assert "default space (XLA report)" in done.stdout


def test_grouped_matmul_auto_is_the_traced_programs_platforms(device):
    """kernels.gmm.xla_impl=auto decides by the platform of the program being traced, not this host's:
    under a mesh of compile-only TPU devices it is ragged_dot (row tiles there gathered a weight copy
    per tile: 44 GiB a layer at the 397B cell), on the host's CPU devices row tiles."""
    import numpy as np
    from jax.sharding import Mesh

    from hybridmoe.kernels.gmm.ops import xla_impl_for
    from hybridmoe.tools.train_program import tpu_target

    with jax.set_mesh(Mesh(np.asarray(tpu_target(TOPOLOGY).devices), ("x",))):
        assert xla_impl_for("auto") == "ragged_dot"
    with jax.set_mesh(Mesh(np.asarray(jax.devices()), ("x",))):
        assert xla_impl_for("auto") == "row_tiles"


@pytest.mark.parametrize("num_local, offset", [(512, 0), (256, 256)])
def test_xla_grouped_matmul_over_more_groups_than_tpu_ragged_dot_takes(device, num_local, offset):
    """The pinned libtpu refuses jax.lax.ragged_dot over more than 256 groups; the xla backend
    runs Qwen3.5-397B's 512 experts (all local, and 256 local of 512 with the zero group) in
    chunks that compile, forward and both gradients (and the default path's ragged_dot)."""
    import numpy as np
    from jax.sharding import Mesh

    from hybridmoe.kernels.gmm import xla

    E = 512
    x, w, gs = spec((1024, 256), jnp.bfloat16, device), spec((num_local, 256, 128), jnp.bfloat16, device), \
        spec((E,), jnp.int32, device)

    def loss(x, w, gs):
        y = K.gmm(x, w, gs, group_offset=offset) if offset or num_local < E else K.ragged_dot(x, w, gs)
        return jnp.sum(y.astype(jnp.float32))

    with jax.set_mesh(Mesh(np.asarray([device]), ("x",))):
        assert len(xla.ragged_group_chunks(num_local, num_local < E)) == 3 - (num_local < E)
        compile_abstract(jax.grad(loss, (0, 1)), x, w, gs)


def test_the_step_estimate_counts_a_ragged_dot_weight_gradient_by_its_rows_not_every_group(device):
    """XLA's TPU form of ragged_dot's weight gradient is a batched dot over all G groups of operands
    each masked row by row (analysis/hlo_cost.py: Estimator._masked_groups). Every row lies in one
    group: the step estimate counts 2 x rows x K x N FLOPs, not G times that (on a v5e step the
    dense count put the grouped matmuls at 0.24 s where the chip measured 0.10)."""
    from hybridmoe.analysis.hlo_cost import Estimator, hlo_flops
    from hybridmoe.analysis.program import cost_figures

    rows, k, n, groups = 2048, 256, 512, 8

    def loss(lhs, rhs, group_sizes):
        return jax.lax.ragged_dot(lhs, rhs, group_sizes).astype(jnp.float32).sum()

    lowered = jax.jit(jax.grad(loss, argnums=1)).lower(spec((rows, k), jnp.bfloat16, device),
                                                      spec((groups, k, n), jnp.bfloat16, device),
                                                      spec((groups,), jnp.int32, device))
    compiled = lowered.compile()
    text = compiled.as_text()
    assert "pred[8,2048]" in text  # the masked form this test is about
    flops = sum(c.flops * times for c, times in Estimator(text).ops())
    assert flops == 2 * rows * k * n, (flops, 2 * rows * k * n, 2 * rows * k * n * groups)
    # bench's MFU numerator is the same count; XLA's cost analysis counts every group (the chip's
    # step once printed an MFU of 86% where its model FLOPs ran at 34%).
    assert hlo_flops(text) == 2 * rows * k * n
    assert cost_figures(compiled)["flops"] >= groups * 2 * rows * k * n
