"""Every Pallas kernel run natively on a TPU chip against the XLA path and a float32 reference, and one
training step on the chip against the same step on CPU. Marked tpu: skipped without a chip; on a TPU
host `python3 -m pytest --chip tests/test_chip.py` (or benchmarks/tpu_tests.py) runs them.

The kernel cases are hybridmoe/tools/chip_cases.py's at its `edges` geometry on the chip (every tile
and block edge crossed: rows not a multiple of the row tile and an empty group at the seed's tiles,
documents starting inside chunks and blocks; compiles in seconds) and at `tiny`, interpreted,
anywhere else (how the file was run on CPU). Each comparison is max |a - b| / max |b| over the
output and every gradient (chip_cases.relative_error), against the reference and against the XLA
path, both printed when one fails.

Tolerances, from the arithmetic each path does (measured at tiny on CPU in brackets):
- BF16_OUT 1e-2 (gmm, flash attention): bf16 outputs and gradients from float32 accumulators, each
  element within one rounding, 2^-8 = 3.9e-3 of the largest [1.9e-3 to 3.2e-3];
- MOE 2e-2: the same, and h rounded to bf16 between the two matmuls in the unfused paths, whose
  error the down projection carries [4.5e-3 to 7.2e-3];
- GDN 5e-2: bf16 q, k, v, and the Pallas core's intra-chunk matmuls in bf16 passes (tpu_chunk:
  operands rounded at each product, chained through the chunk's triangular solve); the relative
  RMS tolerance of tests/test_gdn_kernel.py's bf16 kernels is 5e-3 to 2e-2, the element-wise
  maximum sits above it [4.3e-3 to 5.0e-3];
- F32 1e-4 (the CP scans): float32 at HIGHEST precision end to end, products of a few dozen chunk
  maps [2e-7 to 2.4e-6 at edges on CPU];
- log-probs: float32 values 1e-4, bf16 gradients BF16_OUT.
A broken kernel (a row of the wrong group, a block skipped or masked wrong, a document boundary
missed) is off by O(1) of the largest value, far above each.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybridmoe.tools import chip_cases as cc

pytestmark = pytest.mark.tpu

BF16_OUT, MOE, GDN, F32 = 1e-2, 2e-2, 5e-2, 1e-4
TOLERANCE = {"gmm": BF16_OUT, "moe_mlp": MOE, "moe_mlp_fp8": MOE, "gdn": GDN, "gdn_cp": GDN, "attention": BF16_OUT}
XLA_PATH = {"gmm": "ragged_dot", "moe_mlp": "xla", "moe_mlp_fp8": "xla", "gdn": "xla", "gdn_cp": "xla", "attention": "xla"}
# Our Pallas kernels of each family (the benchmark's other arms, splash and tokamax, are not ours to test).
PALLAS = {"gmm": ("pallas_tpu", "pallas_tpu_128", "pallas_tpu_table", "pallas_tpu_aligned_128"),
          "moe_mlp": ("pallas_tpu", "pallas_tpu_fused", "pallas_tpu_table", "pallas_tpu_fused_table",
                      "pallas_tpu_fused_aligned_128"),
          "moe_mlp_fp8": ("pallas_tpu_table", "pallas_tpu_fused_table"),
          "gdn": ("pallas_tpu", *cc.GDN_SETTINGS), "gdn_cp": ("pallas_tpu", "pallas_tpu_terms_in_xla"),
          "attention": ("pallas_tpu", "pallas_tpu_256x512")}


def on_chip() -> bool:
    return jax.default_backend() == "tpu"


def geometry() -> str:
    return "edges" if on_chip() else "tiny"


@functools.cache
def _case(family: str):
    """(case, its reference, its inputs) at this host's geometry."""
    (case,) = cc.cases(geometry(), interpret=not on_chip(), families=[family]).values()
    return case, case.reference(), case.make_inputs()


def _host(tree):
    return jax.tree.map(lambda a: np.asarray(jax.device_get(a), np.float32), tree)


def run_backend(case, backend: str, inputs):
    """(forward output, (output, gradients)) of a backend, each as the reference covers it, on the host."""
    built = case.backends[backend](inputs)
    fwd = case.view(built.restore(built.fwd[0](*built.fwd[1]), False), backward=False)
    both = (case.view(built.restore(built.fwd_bwd[0](*built.fwd_bwd[1]), True), backward=True)
            if built.fwd_bwd else None)
    return _host(fwd), _host(both)


@functools.cache
def _xla_outputs(family: str):
    case, _, inputs = _case(family)
    return run_backend(case, XLA_PATH[family], inputs)


def _errors(actual, reference, xla):
    """{part: (error vs the reference, error vs the XLA path)} for the forward and forward + backward."""
    return {part: (cc.relative_error(a, r), cc.relative_error(a, x))
            for part, a, r, x in (("fwd", actual[0], reference.fwd, xla[0]), ("fwd_bwd", actual[1], reference.fwd_bwd, xla[1]))}


@pytest.mark.parametrize("family, backend", [(f, b) for f, bs in PALLAS.items() for b in bs])
def test_pallas_kernel_matches_the_xla_path_and_the_reference(family, backend):
    """Forward and forward + backward of each Pallas kernel: the grouped matmul at explicit and at the
    heuristic tiles; the MoE MLP unfused and with the fused SwiGLU / dSwiGLU pair at the seed's tiles
    (row-scale gradient included); the GDN core over packed documents; flash attention at the
    default blocks and at 256 x 512 over packed documents with positions restarting."""
    case, reference, inputs = _case(family)
    errors = _errors(run_backend(case, backend, inputs), reference, _xla_outputs(family))
    tol = TOLERANCE[family]
    assert all(e < tol for pair in errors.values() for e in pair), \
        f"{case.name} {backend}: (vs reference, vs {XLA_PATH[family]}) {errors}; tolerance {tol}"


@pytest.mark.parametrize("family", sorted(PALLAS))
def test_the_xla_path_matches_the_reference(family):
    """The XLA path the Pallas kernels are held to is itself within the tolerance of the reference."""
    case, reference, _ = _case(family)
    xla = _xla_outputs(family)
    errors = {"fwd": cc.relative_error(xla[0], reference.fwd), "fwd_bwd": cc.relative_error(xla[1], reference.fwd_bwd)}
    assert max(errors.values()) < TOLERANCE[family], f"{case.name} {XLA_PATH[family]} vs reference: {errors}"


def test_attention_in_the_load_balanced_layout():
    """attention.cp_load_balance's token order (parallel/context.py, 4 ranks: each holds half-chunks r
    and 7 - r), whole sequence on the chip: every token array permuted, each kernel's output and
    gradients equal the natural order's reference permuted the same way (masking and block skipping
    read positions and segment ids as values, never token indices)."""
    from hybridmoe.parallel.context import load_balanced_token_index

    case, reference, (args, cot) = _case("attention")
    order = load_balanced_token_index(case.shape["tokens"], 4)
    permute = lambda a: a[:, order]  # noqa: E731
    inputs = (tuple(permute(a) for a in args), permute(cot))
    o, (o2, (dq, dk, dv)) = reference.fwd, reference.fwd_bwd
    want = (permute(o), (permute(o2), tuple(permute(d) for d in (dq, dk, dv))))
    for backend in ("xla", *PALLAS["attention"]):
        fwd, both = run_backend(case, backend, inputs)
        errors = {"fwd": cc.relative_error(fwd, want[0]), "fwd_bwd": cc.relative_error(both, want[1])}
        assert max(errors.values()) < BF16_OUT, f"{backend}, load-balanced order, vs reference: {errors}"


@pytest.mark.parametrize("family", ["cp_m_scan", "cp_dh_scan"])
def test_context_parallel_scans_match_the_recurrence(family):
    """The shard's transition product M_r and local state cotangent dS_loc, tree and scan, against
    the token-by-token recurrence (M_r: the end state from the identity with v = 0; dS_loc: the
    start state's gradient), and against each other."""
    case, reference, inputs = _case(family)
    got = {}
    for backend in ("tree", "scan"):
        fn, args = case.backends[backend](inputs).fwd
        got[backend] = _host(fn(*args))
    errors = {b: cc.relative_error(v, reference.fwd) for b, v in got.items()}
    errors["tree vs scan"] = cc.relative_error(got["tree"], got["scan"])
    assert max(errors.values()) < F32, f"{case.name}: {errors}; {_where_the_chip_differs(case, inputs, reference)}"


def _where_the_chip_differs(case, inputs, reference) -> str:
    """On a chip, the same inputs (the chunk terms, field by field) and reference made on the host's
    CPU against the chip's: which of them carries the error (the chip once put the CP scans 1.4e-3
    from the recurrence while the tree and the Mosaic scan agreed to 1e-6)."""
    if not on_chip():
        return "(on CPU)"
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        (cpu_terms, *rest), _ = case.make_inputs()
        cpu_reference = case.reference()
    (chip_terms, *_), _ = inputs
    fields = {f"{name} chip vs cpu": cc.relative_error(_host(getattr(chip_terms, name)), _host(getattr(cpu_terms, name)))
              for name in chip_terms._fields}
    fields["reference chip vs cpu"] = cc.relative_error(_host(reference.fwd), _host(cpu_reference.fwd))
    return "where: " + ", ".join(f"{k} {v:.1e}" for k, v in fields.items())


def test_reference_recurrence_is_the_oracle():
    """chip_cases' segmented recurrence (the kernel benchmark's GDN reference) equals
    kernels/gdn/reference.py's token-by-token oracle at the test's GDN shape."""
    from hybridmoe.kernels.gdn.reference import gated_delta_rule_reference

    case, _, ((q, k, v, gate, beta, seg), _) = _case("gdn")
    f32 = [a.astype(jnp.float32) for a in (q, k, v, gate, beta)]
    ours = jax.jit(lambda *a: cc.recurrence(*a, segment_ids=seg))(*f32)
    oracle = jax.jit(lambda *a: gated_delta_rule_reference(*a, segment_ids=seg))(*f32)
    errors = [cc.relative_error(_host(a), _host(b)) for a, b in zip(ours, oracle)]
    assert max(errors) < F32, f"{case.name}: (o, final state) {errors}"


def test_chunked_logprobs_match_the_reference():
    """kernels/logprobs.py's chunked log-probs and entropies, and their gradients for hidden states
    and the LM head, against the unchunked definition in float32 at HIGHEST precision: bf16 inputs,
    chunks that divide neither the tokens nor the vocabulary."""
    from hybridmoe.kernels.logprobs import chunked_token_logprobs, token_logprobs_reference

    b, t, d, vocab = (2, 1000, 512, 10000) if on_chip() else (2, 60, 32, 300)
    chunks = (256, 4096) if on_chip() else (16, 128)
    key = jax.random.split(jax.random.key(7), 5)
    h = jax.random.normal(key[0], (b, t, d), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(key[1], (d, vocab), jnp.float32) * d ** -0.5).astype(jnp.bfloat16)
    targets = jax.random.randint(key[2], (b, t), 0, vocab)
    c_logp, c_ent = (jax.random.normal(k, (b, t), jnp.float32) for k in key[3:])

    def value_and_grads(fn, h, w):
        loss = lambda h, w: jnp.sum(fn(h, w)[0] * c_logp + fn(h, w)[1] * c_ent)  # noqa: E731
        return fn(h, w), jax.grad(loss, (0, 1))(h, w)

    chunked = jax.jit(lambda h, w: value_and_grads(
        lambda h, w: chunked_token_logprobs(h, w, targets, chunk_tokens=chunks[0], chunk_vocab=chunks[1]), h, w))
    # The reference runs on the host's CPU: on a chip its own float32 softmax entropy was 1.0e-4 from
    # the host's, where the chunked entropy on the chip was 1.2e-5 from the same chunked code on the host.
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu), jax.default_matmul_precision("highest"):
        want = _host(jax.jit(lambda h, w, t: value_and_grads(
            lambda h, w: token_logprobs_reference(h, w, t), h, w))(
                *(jax.device_put(a, cpu) for a in (h.astype(jnp.float32), w.astype(jnp.float32), targets))))
    (logp, ent), grads = _host(chunked(h, w))
    errors = {"logp": cc.relative_error(logp, want[0][0]), "entropy": cc.relative_error(ent, want[0][1]),
              "grads": cc.relative_error(grads, want[1])}
    if on_chip() and not (errors["logp"] < F32 and errors["entropy"] < F32):
        # Where the chip differs: the same chunked entropies and reference made on the host's CPU.
        cpu = jax.devices("cpu")[0]
        forward = jax.jit(lambda h, w, t: chunked_token_logprobs(h, w, t, chunk_tokens=chunks[0], chunk_vocab=chunks[1]))
        _, ent_cpu = _host(forward(*(jax.device_put(a, cpu) for a in (h, w, targets))))
        errors["entropy chip vs cpu (chunked)"] = cc.relative_error(ent, ent_cpu)
    assert errors["logp"] < F32 and errors["entropy"] < F32 and errors["grads"] < BF16_OUT, errors


def test_one_training_step_on_the_chip_matches_the_same_step_on_cpu():
    """The tiny recipe (one GDN and one attention layer, f32 weights and activations), the same
    parameters and batch, one step on this host's default device (on a chip: its kernels, attention by
    the Mosaic flash kernels under `auto`) and one on the CPU (XLA): the loss, the gradient norm and
    the parameter updates agree.

    Tolerances: on a TPU, float32 matmuls at the default precision run in one bf16 pass (inputs
    rounded to 2^-8 relative, float32 accumulation), so activations and gradients differ from the
    CPU's float32 by about 1e-3 relative; the loss (a mean over the batch's tokens) within 1e-2
    relative and the gradient norm within 3e-2. Adam's first step moves each weight by -lr g /
    (|g| + eps) (plus weight decay, the same on both): lr times the gradient's sign, so the updates
    agree exactly except where a gradient element is so close to 0 that its sign flips: at most 1% of
    all updates and 5% of any one tensor's (a norm scale has 64 elements) may differ by more than
    lr / 2; a wrong gradient flips about half of its tensor."""
    from helpers import TWO_LAYERS, tiny_config
    from hybridmoe.parallel.host import put_global
    from hybridmoe.run.setup import build, init_state, jit_train_step
    from hybridmoe.train import loop

    cfg = tiny_config(*TWO_LAYERS, "mesh.cpu_devices=0", "mesh.data=1", "mesh.fsdp=1", "train.warmup_steps=0")
    arms = {"device": jax.devices()[0], "cpu": jax.devices("cpu")[0]}
    setups = {name: build(cfg, [dev]) for name, dev in arms.items()}
    with setups["cpu"].context():
        initial = jax.device_get(init_state(setups["cpu"], jax.random.key(0)))
    batch = loop.training_source(cfg).batch(0, 0)[0]
    after, metrics = {}, {}
    for name, setup in setups.items():
        with setup.context():
            state = jax.device_put(initial, setup.state_shardings)
            state, m = jit_train_step(setup)(state, put_global(batch, setup.batch_sharding(1)))
            after[name], metrics[name] = jax.device_get(state["params"]), jax.device_get(m)
    loss = {n: float(m["loss"]) for n, m in metrics.items()}
    norm = {n: float(m["grad_norm"]) for n, m in metrics.items()}
    assert abs(loss["device"] - loss["cpu"]) < 1e-2 * abs(loss["cpu"]), loss
    assert abs(norm["device"] - norm["cpu"]) < 3e-2 * norm["cpu"], norm
    lr = cfg.train.learning_rate

    def flipped(path, before, on_device, on_cpu):
        """The share of the tensor's elements whose two updates differ by more than lr / 2."""
        moved = [np.asarray(x, np.float64) - np.asarray(before, np.float64) for x in (on_device, on_cpu)]
        assert np.abs(moved[1]).max() > lr / 2, f"{jax.tree_util.keystr(path)}: the CPU step did not move it"
        return float(np.mean(np.abs(moved[0] - moved[1]) > lr / 2))

    shares = jax.tree_util.tree_map_with_path(flipped, initial["params"], after["device"], after["cpu"])
    sizes = [np.size(a) for a in jax.tree.leaves(initial["params"])]
    overall = sum(s * n for s, n in zip(jax.tree.leaves(shares), sizes)) / sum(sizes)
    worst = max(jax.tree_util.tree_leaves_with_path(shares), key=lambda kv: kv[1])
    assert overall <= 0.01 and worst[1] <= 0.05, \
        f"{overall:.2%} of all updates differ; {jax.tree_util.keystr(worst[0])}: {worst[1]:.1%} of its own"

