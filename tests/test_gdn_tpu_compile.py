"""The Mosaic TPU Gated DeltaNet kernels compile for real TPU targets from this CPU host
(tests/tpu_target.py): the chunk-parallel core and the context-parallel scans at the 397B cell's
per-device shapes for a v5e and a tpu7x target, within the generation's default scoped VMEM and
the VMEM model; small chunks; the training step runs the core's kernels per shard.
"""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import pytest

from tests.tpu_target import TOPOLOGY, compile_abstract, spec

pytestmark = pytest.mark.tpu_compile

# Qwen3.5-397B-A17B's GDN layer on one device of the seed cell: 16,384 tokens, 16 key / 64 value
# heads, dims 128, chunk 64 (tools/chip_cases.py's "cell" geometry).
CELL = dict(tokens=16384, key_heads=16, value_heads=64, key_dim=128, value_dim=128, chunk=64)
# A v5e target (16 MiB default scoped VMEM) beside the suite's tpu7x one (32 MiB).
V5E = "v5e:2x2"


@functools.cache
def _device(topology: str):
    from hybridmoe.tools.train_program import tpu_target

    return tpu_target(topology).devices[0]


def _core_grad(device, *, tokens, key_heads, value_heads, key_dim, value_dim, chunk, **settings):
    from hybridmoe.kernels.gdn import pallas_tpu

    args = (spec((1, tokens, key_heads, key_dim), jnp.bfloat16, device),
            spec((1, tokens, key_heads, key_dim), jnp.bfloat16, device),
            spec((1, tokens, value_heads, value_dim), jnp.bfloat16, device), spec((1, tokens, value_heads), jnp.float32, device),
            spec((1, tokens, value_heads), jnp.float32, device), spec((1, tokens), jnp.int32, device))

    def loss(q, k, v, g, beta, segment_ids):
        o, final = pallas_tpu.gated_delta_rule(q, k, v, g, beta, segment_ids=segment_ids, chunk_size=chunk, **settings)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(final)

    return compile_abstract(jax.grad(loss, (0, 1, 2, 3, 4)), *args)


def _elements(dims: str) -> int:
    """Elements of an HLO array type's dimensions as written ("16384,64,128"; "" for a scalar)."""
    return math.prod(int(d) for d in dims.split(",") if d)


def _f32_buffers(hlo_text: str, elements: int) -> list[str]:
    """Every float32 array type in the program with exactly `elements` elements."""
    shapes = re.findall(r"f32\[([\d,]+)\]", hlo_text)
    return sorted({s for s in shapes if _elements(s) == elements})


def _cell_needs():
    from hybridmoe.kernels.gdn import limits

    return limits.vmem_needs(0.0, chunk_size=CELL["chunk"], key_dim=CELL["key_dim"], value_dim=CELL["value_dim"],
                             group=CELL["value_heads"] // CELL["key_heads"], itemsize=2)


@pytest.mark.parametrize("topology", [V5E, TOPOLOGY])
def test_gdn_core_compiles_at_the_cell_within_the_default_vmem(topology):
    """Forward and backward kernels at the cell's shapes (bf16 inputs, packed rows) compile, and no
    float32 array of B x T x H x K elements (a copy of the keys per value head) is in the program.
    Both kernels' modelled VMEM (kernels/gdn/limits.py) is within v5e's 16 MiB default scoped
    limit; on v5e they compile with the limit set to the larger modelled need: the model is an
    upper bound of what the compiler wants. On tpu7x, under `auto`'s limits."""
    from hybridmoe.kernels.gdn import limits
    from hybridmoe.kernels.vmem import MIB, TPU_DEFAULT_LIMIT_MIB_BY_GENERATION

    needs = _cell_needs()
    v5e_default = TPU_DEFAULT_LIMIT_MIB_BY_GENERATION["v5e"] * MIB
    assert all(n.need_bytes <= v5e_default for n in needs.values()), needs
    limit = max(n.need_bytes for n in needs.values()) / MIB if topology == V5E else 0.0
    text = _core_grad(_device(topology), **CELL, vmem_limit_mib=limit).hlo_text
    assert text.count("tpu_custom_call") == 2 and all(name in text for name in limits.KERNELS)
    repeated = CELL["tokens"] * CELL["value_heads"] * CELL["key_dim"]
    assert not _f32_buffers(text, repeated), _f32_buffers(text, repeated)


def _value_sized_moves(hlo_text: str) -> list[str]:
    """The program's copies, transposes and fusions outside the kernels whose result is a bfloat16
    array of the cell's T x H x V elements: v, o, dO or dv moved to another layout in HBM."""
    elements = CELL["tokens"] * CELL["value_heads"] * CELL["value_dim"]
    moves = []
    for m in re.finditer(r"%([\w.\-]+) = bf16\[([\d,]+)\]\{[^}]*\} (copy|transpose|fusion)\(", hlo_text):
        if _elements(m.group(2)) == elements:
            moves.append(f"{m.group(1)} {m.group(3)} [{m.group(2)}]")
    return moves


def _layer_core_grad(device, token_major: bool):
    """The core at the cell as the GDN layer feeds it: q, k, v born flat [B, T, heads x dim] (the
    projections' and the conv's layout) and split into heads, the output merged back and weighted
    (its cotangent an array, as the output projection's is)."""
    from hybridmoe.kernels.gdn import pallas_tpu

    c = CELL
    T, G, H = c["tokens"], c["key_heads"], c["value_heads"]
    args = (spec((1, T, G * c["key_dim"]), jnp.bfloat16, device), spec((1, T, G * c["key_dim"]), jnp.bfloat16, device),
            spec((1, T, H * c["value_dim"]), jnp.bfloat16, device), spec((1, T, H), jnp.float32, device),
            spec((1, T, H), jnp.float32, device), spec((1, T), jnp.int32, device),
            spec((1, T, H * c["value_dim"]), jnp.bfloat16, device))

    def loss(q, k, v, g, beta, segment_ids, w):
        heads = lambda a, n: a.reshape(1, T, n, -1)  # noqa: E731
        o, final = pallas_tpu.gated_delta_rule(heads(q, G), heads(k, G), heads(v, H), g, beta, segment_ids=segment_ids,
                                               chunk_size=c["chunk"], token_major=token_major)
        return jnp.sum(o.reshape(1, T, -1).astype(jnp.float32) * w) + jnp.sum(final)

    return compile_abstract(jax.grad(loss, (0, 1, 2, 3, 4)), *args)


def test_token_major_blocks_leave_no_layout_copies_at_the_cell():
    """v5e, the cell's core forward + backward as the layer feeds it: with the kernels reading and
    writing token-major blocks no value-sized array is moved between layouts (the reshapes into heads
    and back cancel); the transposed layout's program moves v, o, dO and dv (six copies; the chip's
    profile of the core alone: four of 0.82 ms each beside 21.7 ms of kernels)."""
    device = _device(V5E)
    head_major = _value_sized_moves(_layer_core_grad(device, False).hlo_text)
    token_major = _value_sized_moves(_layer_core_grad(device, True).hlo_text)
    assert len(head_major) >= 4, head_major
    assert not token_major, token_major


@pytest.mark.parametrize("topology", [V5E, TOPOLOGY])
def test_cp_scans_compile_as_mosaic_kernels_at_the_cell(topology):
    """gdn.cp_m_scan's and gdn.cp_dh_scan's kernels (pallas_cp_scans.py) at the cell's chunk terms."""
    from hybridmoe.kernels.gdn import context_parallel as cp

    device = _device(topology)
    c = CELL
    chunks = c["tokens"] // c["chunk"]
    per_chunk = lambda *tail: spec((1, chunks, c["value_heads"], *tail), jnp.float32, device)  # noqa: E731
    terms = cp.ChunkTerms(per_chunk(c["chunk"], c["key_dim"]), per_chunk(c["chunk"], c["value_dim"]),
                          per_chunk(c["chunk"], c["chunk"]), per_chunk(c["chunk"], c["key_dim"]),
                          per_chunk(c["chunk"], c["key_dim"]), per_chunk())
    m = compile_abstract(lambda t: cp.cp_m_scan_product(t, pallas=True), terms)
    dh = compile_abstract(lambda t, do: cp.cp_dh_scan_cotangent(t, do, pallas=True), terms,
                          per_chunk(c["chunk"], c["value_dim"]))
    assert "gdn_cp_m_scan" in m.hlo_text and "gdn_cp_dh_scan" in dh.hlo_text


@pytest.mark.parametrize("topology", [V5E, TOPOLOGY])
def test_cp_kernels_compile_at_the_cell_and_the_chip_case_keeps_them(topology):
    """gdn.cp_terms_in_kernel's kernels (pallas_tpu_cp.py) compile at the cell's shard (bf16, packed
    rows), within `auto`'s VMEM limits, as the chip case gdn_cp runs them: two ranks of the cell's
    shard mapped onto one device, forward + backward. Both kernels are in the compiled program
    (a case of one rank lost them: its prefix is zero and XLA removed them), beside the chunk kernels."""
    from hybridmoe.kernels.gdn import limits
    from hybridmoe.tools import chip_cases as cc

    device = _device(topology)
    g = cc.GEOMETRIES["cell"]["gdn_cp"]
    fwd_bwd = cc._gdn_cp_backends(g, interpret=False)["pallas_tpu"].fwd_bwd
    t, hk, hv, kd, vd = g["tokens"], g["key_heads"], g["value_heads"], g["key_dim"], g["value_dim"]
    args = (spec((1, t, hk, kd), jnp.bfloat16, device), spec((1, t, hk, kd), jnp.bfloat16, device),
            spec((1, t, hv, vd), jnp.bfloat16, device), spec((1, t, hv), jnp.float32, device),
            spec((1, t, hv), jnp.float32, device), spec((1, t), jnp.int32, device),
            spec((1, t, hv, vd), jnp.bfloat16, device))
    text = compile_abstract(fwd_bwd, *args).hlo_text
    assert all(name in text for name in limits.CP_KERNELS + limits.KERNELS), [
        n for n in limits.CP_KERNELS + limits.KERNELS if n not in text]


@pytest.mark.parametrize("chunk_size, key_dim, value_dim", [(16, 16, 8), (2, 16, 8)])
def test_gdn_core_compiles_at_small_chunks(chunk_size, key_dim, value_dim):
    """The small dims the CPU tests run, and the smallest chunk the validator lets through on TPU
    (limits.PALLAS_TPU_MIN_CHUNK; chunk 1 compiles too, in 4 s)."""
    compiled = _core_grad(_device(TOPOLOGY), tokens=4 * chunk_size, key_heads=1, value_heads=2, key_dim=key_dim,
                          value_dim=value_dim, chunk=chunk_size)
    assert compiled.hlo_text.count("tpu_custom_call") == 2


def test_gdn_pallas_training_step_runs_the_kernels_per_shard(device):
    """The training step (one GDN layer, rows over data x fsdp, heads over tensor) compiled for the
    topology's 8 devices: with kernels.gdn.backend=auto (pallas_tpu on a TPU, the default) it holds
    the forward and backward GDN kernels and exactly the collectives of the xla backend (place, kind,
    dtype, count, bytes), so no operand of the kernels is gathered: they run per shard."""
    from hybridmoe.tools import train_program as tp
    from hybridmoe.recipe import load_config
    from hybridmoe.kernels.gdn import limits

    steps = {}
    for backend in ("xla", "auto"):
        cfg = load_config("tiny", ["mesh.cpu_devices=0", "mesh.tensor=2", "model.layer_pattern=[gdn]",
                                   "model.num_layers=1", f"kernels.gdn.backend={backend}"], platform="tpu")
        steps[backend] = tp.compile_step(cfg, tp.tpu_target(TOPOLOGY), with_residuals=False)
    text = steps["auto"].program.compiled_text
    assert all(name in text for name in limits.KERNELS)
    assert not any(name in steps["xla"].program.compiled_text for name in limits.KERNELS)
    collectives = {b: tp.collective_rows(s.program.compiled_collectives) for b, s in steps.items()}
    assert collectives["auto"] == collectives["xla"], collectives


def test_every_float32_matmul_of_the_xla_gdn_path_is_at_highest_precision(device):
    """On a TPU an f32 matmul at default precision is one bfloat16 pass: the XLA chunked GDN path
    (forward and backward, float32 inputs) asks HIGHEST of every f32 dot it lowers. One did not:
    the einsum that laid the inverse's diagonal blocks out against the identity, which rounded
    every inverse block to 8 bits on the chip."""
    import re

    from hybridmoe.kernels.gdn.xla import gated_delta_rule_chunked

    b, t, g, h, k, v = 1, 256, 1, 2, 128, 128

    def loss(q, kk, vv, gate, beta):
        return jnp.sum(gated_delta_rule_chunked(q, kk, vv, gate, beta, chunk_size=64)[0])

    args = [spec(s, jnp.float32, device) for s in ((b, t, g, k), (b, t, g, k), (b, t, h, v), (b, t, h), (b, t, h))]
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(*args).as_text()
    dots = [d for d in re.findall(r"stablehlo\.dot_general[^\n]*", text) if "xf32>" in d.split(":")[-1]]
    assert len(dots) > 10
    below = [d[:200] for d in dots if "precision = [HIGHEST, HIGHEST]" not in d]
    assert not below, below
