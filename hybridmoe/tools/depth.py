"""Memory against depth: a step compiled at two depths, extrapolated to the model's.

The decoder runs its layers as a scan over blocks (one block = one pass of model.layer_pattern),
so a compiled step holds one copy of the block's body and its temporaries, whatever the depth;
what grows with the number of blocks is what the loop stacks: the parameters and optimizer state
(arguments), the gradients, and the residuals the forward saves per block for the backward. So
per-device memory is affine in the number of blocks, m(b) = intercept + slope x b, and two
compiles at b and b + 1 blocks give both terms (`extrapolate`). It is not exact where the
compiler schedules or packs the deeper program differently (a loop of one iteration is removed
outright, so b >= 2 here); the error against a full compile is recorded in
benchmarks/records/inspect_depth.json.

The step-time estimate (analysis/step_estimate.py) extrapolates the same way and more closely:
it sums each instruction's cost times the trip counts of the loops around it, so the layer loop's
body counts once per block and everything outside it once, whatever the depth
(`extrapolate_estimate`).
"""

from __future__ import annotations

KEYS = ("argument", "temp", "total", "default_space")


def depths(cfg, layers: int) -> tuple[int, int]:
    """The two layer counts to compile for `--layers N`: N and N + one block. N must be a whole
    number (at least 2) of blocks and below the model's depth."""
    m = cfg.model
    block = len(m.layer_pattern)
    if layers % block:
        raise ValueError(f"--layers {layers}: not a whole number of layer blocks (one block is {block} layers, "
                         f"model.layer_pattern={list(m.layer_pattern)}): e.g. --layers {2 * block}")
    if layers // block < 2:
        raise ValueError(f"--layers {layers}: at least two blocks (--layers {2 * block}): a one-block step compiles "
                         "without its layer loop (the compiler removes a loop of one iteration), so its memory is "
                         "off the line the deeper steps lie on")
    if layers + block > m.num_layers:
        raise ValueError(f"--layers {layers}: the model has {m.num_layers} layers (model.num_layers) and the "
                         f"extrapolation compiles {layers} and {layers + block}; use fewer layers, or inspect "
                         "without --layers to compile the whole model")
    return layers, layers + block


def extrapolate(memory: dict[int, dict], block: int, num_layers: int, hbm: int | None) -> dict:
    """`memory`: {layers: memory facts (train_program.memory_facts)} at two depths one block
    apart. Per key of KEYS: the per-block slope and the value at `num_layers`; `fits` against the
    HBM per device."""
    (l1, m1), (l2, m2) = sorted(memory.items())
    b1, b2, full = l1 // block, l2 // block, num_layers // block
    per_block, at_full = {}, {}
    for k in KEYS:
        if m1.get(k) is None or m2.get(k) is None:
            per_block[k] = at_full[k] = None
            continue
        slope = (m2[k] - m1[k]) / (b2 - b1)
        per_block[k] = round(slope)
        at_full[k] = round(m1[k] + slope * (full - b1))
    need = at_full["total"] if at_full["default_space"] is None else at_full["default_space"]  # fit_bytes
    fits = None if hbm is None or need is None else need <= hbm
    return {"block_layers": block, "compiled": [{"layers": l1, "blocks": b1, **{k: m1.get(k) for k in KEYS}},
                                                {"layers": l2, "blocks": b2, **{k: m2.get(k) for k in KEYS}}],
            "per_block": per_block, "extrapolated": {"layers": num_layers, "blocks": full, **at_full},
            "hbm": hbm, "fits": fits}


def format_depth(d: dict) -> str:
    biggest = max((row["total"] or 0) for row in [*d["compiled"], d["extrapolated"]])
    unit, name = (2**30, "GiB") if biggest >= 2**30 else (2**20, "MiB")
    cell = lambda v: "-" if v is None else f"{v / unit:.2f}"  # noqa: E731
    lines = [f"memory against depth (per device, {name}): compiled at {d['compiled'][0]['layers']} and "
             f"{d['compiled'][1]['layers']} layers (blocks of {d['block_layers']}), extrapolated to "
             f"{d['extrapolated']['layers']}",
             f"  {'':<24}{'blocks':>7}{'layers':>8}{'arguments':>11}{'temporaries':>13}{'total':>9}"
             f"{'default space':>15}"]
    row_text = lambda label, blocks, layers, r: (  # noqa: E731
        f"  {label:<24}{blocks:>7}{layers:>8}{cell(r['argument']):>11}{cell(r['temp']):>13}{cell(r['total']):>9}"
        f"{cell(r.get('default_space')):>15}")
    for row in d["compiled"]:
        lines.append(row_text("compiled", row["blocks"], row["layers"], row))
    lines.append(row_text("per block (difference)", 1, d["block_layers"], d["per_block"]))
    e = d["extrapolated"]
    lines.append(row_text("EXTRAPOLATED", e["blocks"], e["layers"], e))
    if d["hbm"] is not None:
        verdict = "-" if d["fits"] is None else ("fits" if d["fits"] else "does NOT fit")
        lines.append(f"  HBM per device {d['hbm'] / 2**30:.2f} GiB: the extrapolated step {verdict}")
    return "\n".join(lines)


def _along(v1, v2, t: float):
    """v1 + t (v2 - v1) over the numbers of two nested records (a key one lacks counts as 0);
    anything else is the second's."""
    if isinstance(v1, dict) or isinstance(v2, dict):
        v1, v2 = v1 or {}, v2 or {}
        return {k: _along(v1.get(k, 0), v2.get(k, 0), t) for k in {**v1, **v2}}
    if isinstance(v1, (int, float)) and isinstance(v2, (int, float)) and not isinstance(v2, bool):
        return v1 + t * (v2 - v1)
    return v2


def extrapolate_estimate(estimates: dict[int, dict], block: int, num_layers: int,
                         model_flops_per_device: float | None) -> dict:
    """`estimates`: {layers: step_estimate.estimate(...)} at two depths one block apart. The
    estimate at `num_layers`: each category's, collective kind's and Pallas kernel's seconds, bytes,
    FLOPs, calls and grid steps along the line through the two, then the totals from the categories
    with the model's FLOPs at full depth (`model_flops_per_device`)."""
    from hybridmoe.analysis.step_estimate import totals

    (l1, e1), (l2, e2) = sorted(estimates.items())
    t = (num_layers // block - l1 // block) / (l2 // block - l1 // block)
    out = {**e2, **{k: _along(e1[k], e2[k], t) for k in ("categories", "collectives", "kernels")}}
    hw = e2["hardware"]
    out.update(totals(out["categories"], hw["bf16_flops_chip"] / hw["devices_per_chip"], e2["tokens_per_step"],
                      e2["chips"], model_flops_per_device))
    if e1.get("designed_flops_per_device") and e2.get("designed_flops_per_device"):
        out["designed_flops_per_device"] = _along(e1["designed_flops_per_device"], e2["designed_flops_per_device"], t)
    out["extrapolated_from_layers"] = [l1, l2]
    out["layers"] = num_layers
    return out
