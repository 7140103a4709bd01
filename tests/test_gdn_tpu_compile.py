"""The Mosaic TPU Gated DeltaNet core compiles for a real TPU target from this CPU host, and the
training step runs its kernels per shard (tests/tpu_target.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from tests.tpu_target import TOPOLOGY, compile_abstract, spec

pytestmark = pytest.mark.tpu_compile


def _gdn_pallas_grad(device, chunk_size, key_dim, value_dim):
    from hybridmoe.kernels.gdn import gated_delta_rule

    tokens, heads = 4 * chunk_size, 2
    args = (spec((1, tokens, 1, key_dim), jnp.bfloat16, device), spec((1, tokens, 1, key_dim), jnp.bfloat16, device),
            spec((1, tokens, heads, value_dim), jnp.bfloat16, device), spec((1, tokens, heads), jnp.float32, device),
            spec((1, tokens, heads), jnp.float32, device), spec((1, tokens), jnp.int32, device))

    def loss(q, k, v, g, beta, segment_ids):
        o, final = gated_delta_rule(q, k, v, g, beta, segment_ids=segment_ids, chunk_size=chunk_size,
                                    backend="pallas_tpu")
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(final)

    return compile_abstract(jax.grad(loss, (0, 1, 2, 3, 4)), *args)


@pytest.mark.parametrize("chunk_size, key_dim, value_dim", [(64, 128, 128), (16, 16, 8), (2, 16, 8)])
def test_gdn_pallas_core_compiles(device, chunk_size, key_dim, value_dim):
    """The Pallas GDN core's forward and backward kernels lower through Mosaic (packed rows, bf16
    inputs): Qwen3.5's head dims at chunk 64, the small dims the CPU tests run, and the smallest
    chunk the validator lets through on TPU."""
    compiled = _gdn_pallas_grad(device, chunk_size, key_dim, value_dim)
    assert compiled.hlo_text.count("tpu_custom_call") == 2  # the forward and the backward kernel


def test_gdn_pallas_core_chunk_one_is_refused_by_mosaic(device):
    """Why the validator asks for gdn.chunk_size >= 2 with pallas_tpu."""
    with pytest.raises(Exception, match="dot_dimension_numbers"):
        _gdn_pallas_grad(device, 1, 16, 8)


def test_gdn_pallas_training_step_runs_the_kernels_per_shard(device):
    """The training step (one GDN layer, rows over data x fsdp, heads over tensor) compiled for the
    topology's 8 devices: with kernels.gdn.backend=pallas_tpu it holds the forward and backward GDN
    kernels and exactly the collectives of the xla backend (place, kind, dtype, count, bytes), so
    no operand of the kernels is gathered: they run per shard."""
    from hybridmoe.tools import train_program as tp
    from hybridmoe.recipe import load_config
    from hybridmoe.kernels.gdn.pallas_chunk import KERNEL_NAMES

    steps = {}
    for backend in ("xla", "pallas_tpu"):
        cfg = load_config("tiny", ["mesh.cpu_devices=0", "mesh.tensor=2", "model.layer_pattern=[gdn]",
                                   "model.num_layers=1", f"kernels.gdn.backend={backend}"], platform="tpu")
        steps[backend] = tp.compile_step(cfg, tp.tpu_target(TOPOLOGY), with_residuals=False)
    text = steps["pallas_tpu"].program.compiled_text
    assert all(name in text for name in KERNEL_NAMES.values())
    assert not any(name in steps["xla"].program.compiled_text for name in KERNEL_NAMES.values())
    collectives = {b: tp.collective_rows(s.program.compiled_collectives) for b, s in steps.items()}
    assert collectives["pallas_tpu"] == collectives["xla"], collectives
