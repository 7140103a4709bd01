"""`hybridmoe tune-gmm`: the Pallas grouped matmuls' tiles measured on this chip, into the tile table.

What it tunes are the grouped matmuls a config's training step calls: the step is traced (not
compiled) with `kernels.gmm.backend=pallas_tpu kernels.gmm.tiling=auto`, and every plain kernel
call the trace looks up (kernels/gmm/tile_table.py: kind gmm / gmm_t / tgmm, rows, K, N, local
groups, operand size) is one shape to tune. Each shape's kernel runs alone on the chip, its rows
spread evenly over its groups, at candidate tiles: tm in 128..1024, tk and tn each a lane-aligned
divisor of their dimension up to 4,096 (or the whole dimension), every one whose VMEM need
(tiling.plain_buffers) stays under the generation's cap for a raised limit. The search is by
coordinates: from the heuristic tiles (on a TPU the chip's rule, tile_table.TPU_RULE), every tm with tk and tn held, then every tk, then every tn,
each time keeping the fastest, and a second round where the first changed anything; a shape's
entry keeps the fastest tiles, its time and the heuristic tiles' time (the before / after). The
entries replace the same shapes' in the generation's section of the table; other shapes and
generations stay.
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from pathlib import Path
from typing import Callable

from hybridmoe.kernels.gmm import tile_table
from hybridmoe.kernels.gmm.tiling import DEFAULT, LANE, SUBLANE, Tiling, plain_buffers
from hybridmoe.kernels.gmm.tile_table import Call
from hybridmoe.kernels.vmem import AUTO_LIMIT_CAP_MIB, MIB, tpu_bytes

ROW_TILES = (128, 256, 512, 1024)
MAX_TILE = 4096
TUNE_OVERRIDES = ["kernels.gmm.backend=pallas_tpu", "kernels.gmm.tiling=auto"]


def step_calls(cfg, devices=None) -> list[Call]:
    """Each distinct plain grouped-matmul call of the config's training step, traced on `devices`
    (default: this host's) with the tiles asked of the table."""
    import jax

    from hybridmoe.run.setup import build
    from hybridmoe.tools.train_program import jitted_program

    setup = build(cfg, list(devices or jax.devices()))
    with setup.context(), tile_table.recording() as calls:
        fn, inputs, _ = jitted_program(cfg, setup, "train")
        fn.trace(*inputs)
    unique: dict[tuple, Call] = {}
    for c in calls:
        unique.setdefault((c.generation, *c.key().values()), c)
    return list(unique.values())


def dim_tiles(dim: int) -> list[int]:
    """The lane-aligned divisors of `dim` up to MAX_TILE, and `dim` itself when it is not larger."""
    out = [t for t in range(LANE, min(dim, MAX_TILE) + 1, LANE) if dim % t == 0 and t & (t - 1) == 0]
    return sorted(set(out + ([dim] if dim <= MAX_TILE else [])))


def fits(call: Call, t: Tiling, cap_mib: float = AUTO_LIMIT_CAP_MIB) -> bool:
    """Whether the kernel's blocks at these tiles stay under the cap of a raised VMEM limit."""
    need = tpu_bytes(plain_buffers(call.kind, tm=t.tm, tk=t.tk, tn=t.tn, k=call.k, itemsize=call.itemsize))
    return need <= cap_mib * MIB


def axis_candidates(call: Call, row_tiles: tuple[int, ...] = ROW_TILES) -> dict[str, list[int]]:
    rows = -(-call.m // SUBLANE) * SUBLANE
    return {"tm": [t for t in row_tiles if t <= max(rows, row_tiles[0])], "tk": dim_tiles(call.k), "tn": dim_tiles(call.n)}


def search(call: Call, seconds: Callable[[Call, Tiling], float], *, rounds: int = 2,
           deadline: float | None = None, start: Tiling | None = None,
           row_tiles: tuple[int, ...] = ROW_TILES) -> dict:
    """The fastest tiles by coordinate search from `start`, by default the heuristic ones a TPU runs
    without the table (tile_table.tpu_rule; the 128^3 DEFAULT where the rule's blocks would not fit),
    each tiling timed once: {"tiling", "s", "default_s" (the start's), "timed"}."""
    if start is None:
        rule = tile_table.tpu_rule(call.k, call.n)
        start = rule if fits(call, rule) else DEFAULT
    times: dict[Tiling, float] = {}

    def timed(t: Tiling) -> float:
        if t not in times:
            times[t] = seconds(call, t)
        return times[t]

    best = start
    timed(best)
    candidates = axis_candidates(call, row_tiles)
    for _ in range(rounds):
        before = best
        for axis, values in candidates.items():
            for v in values:
                if deadline is not None and time.monotonic() > deadline:
                    break
                t = dataclasses.replace(best, **{axis: v})
                if fits(call, t) and timed(t) < timed(best):
                    best = t
        if best == before:
            break
    return {"tiling": best, "s": times[best], "default_s": times[start], "timed": len(times)}


def entry(call: Call, found: dict) -> dict:
    t = found["tiling"]
    return {**call.key(), "tm": t.tm, "tk": t.tk, "tn": t.tn, "ms": found["s"] * 1e3,
            "default_ms": found["default_s"] * 1e3, "timed": found["timed"]}


def merged_section(section: dict, entries: list[dict], about: dict) -> dict:
    """A generation's section with `entries` in place of those of the same shapes."""
    new = {shape_key(e) for e in entries}
    kept = [e for e in section.get("entries", []) if shape_key(e) not in new]
    # Each entry keeps the commit it was measured at (a rerun may tune only the shapes left over).
    stamped = [{**e, "commit": e.get("commit", about.get("commit"))} for e in entries]
    return {**about, "entries": sorted(kept + stamped, key=shape_key)}


def write_table(generation: str, entries: list[dict], about: dict, path: Path = tile_table.TABLE_FILE) -> None:
    """Merge a generation's measured entries into the table (written whole, then renamed)."""
    from hybridmoe.analysis.hardware import write_json_atomically

    generations = tile_table.read_table(path)
    generations[generation] = merged_section(generations.get(generation, {}), entries, about)
    write_json_atomically(path, {"about": tile_table.ABOUT, "generations": generations})


def kernel_seconds(call: Call, t: Tiling, *, repeats: int = 5, interpret: bool = False, sizes=None) -> float:
    """The kernel of `call` alone, at tiles `t`, its rows split over its groups by `sizes` (int [groups],
    summing to the rows), by default spread evenly."""
    import jax
    import jax.numpy as jnp

    from hybridmoe.kernels.gmm import pallas_tpu
    from hybridmoe.tools.calibrate import median_seconds

    dtype = {2: jnp.bfloat16, 4: jnp.float32, 1: jnp.float8_e4m3fn}[call.itemsize]
    if sizes is None:
        sizes = jnp.full((call.groups,), call.m // call.groups, jnp.int32).at[0].add(call.m % call.groups)
    elif len(sizes) != call.groups or int(sum(sizes)) != call.m:
        raise ValueError(f"sizes: {len(sizes)} groups summing to {int(sum(sizes))} rows; the call has "
                         f"{call.groups} groups of {call.m} rows in all")
    sizes = jnp.asarray(sizes, jnp.int32)
    key = jax.random.key(0)
    lhs = jax.random.normal(key, (call.m, call.k), jnp.float32).astype(dtype)
    common = dict(group_offset=0, sharded=False, out_dtype=dtype, tiling=t, interpret=interpret)
    if call.kind == "tgmm":
        grad = jax.random.normal(jax.random.fold_in(key, 1), (call.m, call.n), jnp.float32).astype(dtype)
        fn = jax.jit(lambda a, b, s: pallas_tpu.tgmm(a, b, s, num_local=call.groups, **common))
        return median_seconds(fn, lhs, grad, sizes, repeats=repeats)
    shape = (call.groups, call.n, call.k) if call.kind == "gmm_t" else (call.groups, call.k, call.n)
    rhs = jax.random.normal(jax.random.fold_in(key, 2), shape, jnp.float32).astype(dtype)
    fn = jax.jit(lambda a, b, s: pallas_tpu.gmm(a, b, s, transpose_rhs=call.kind == "gmm_t", **common))
    return median_seconds(fn, lhs, rhs, sizes, repeats=repeats)


def check_host(devices=None) -> str:
    """This host's chip generation, or a RuntimeError saying the command needs a TPU."""
    import jax

    from hybridmoe.kernels.platform import generation_of_device

    device = (devices or jax.devices())[0]
    generation = generation_of_device(device)
    if device.platform != "tpu" or generation is None:
        raise RuntimeError(f"tune-gmm times the Pallas TPU kernels on a TPU chip; this host's JAX sees "
                           f"{device.platform} ({device.device_kind})")
    return generation


def shape_key(e: dict) -> tuple:
    """The shape an entry (or a Call's key()) is measured at: what a later run replaces."""
    return tuple(e[k] for k in ("kind", "m", "k", "n", "groups", "itemsize"))


def tuned_shapes(generation: str, path: Path = tile_table.TABLE_FILE) -> set[tuple]:
    """The shapes the table already holds for `generation` (tune-gmm --missing leaves them out)."""
    return {shape_key(e) for e in tile_table.read_table(path).get(generation, {}).get("entries", [])}


def tune(cfg, *, budget_s: float = 500.0, repeats: int = 5, seconds: Callable | None = None,
         devices=None, missing_only: bool = False, path: Path = tile_table.TABLE_FILE) -> dict:
    """Every plain grouped matmul of the config's step tuned on this host's chip: {"generation",
    "device", "entries", "skipped", "already_tuned"} (shapes left when the budget ran out are listed
    as skipped; with missing_only, those the table at `path` holds for this generation are not timed
    again and are listed as already_tuned)."""
    import jax

    from hybridmoe.kernels.platform import generation_of_device

    device = (devices or jax.devices())[0]
    generation = generation_of_device(device) if seconds else check_host(devices)
    seconds = seconds or (lambda call, t: kernel_seconds(call, t, repeats=repeats))
    deadline = time.monotonic() + budget_s
    entries, skipped, already = [], [], []
    have = tuned_shapes(generation, path) if missing_only else set()
    for call in step_calls(cfg, devices):
        if shape_key(call.key()) in have:
            already.append(call.key())
            continue
        if time.monotonic() > deadline:
            skipped.append(call.key())
            continue
        entries.append(entry(call, search(call, seconds, deadline=deadline)))
    return {"generation": generation, "device": device.device_kind, "entries": entries, "skipped": skipped,
            "already_tuned": already}


def about(result: dict) -> dict:
    from hybridmoe.tools.record import source_commit

    return {"device": result["device"], "commit": source_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def format_result(result: dict) -> str:
    lines = [f"grouped-matmul tiles on {result['device']} ({result['generation']}):",
             f"  {'kind':<6} {'rows':>7} {'K':>6} {'N':>6} {'groups':>6}  {'tiles (tm tk tn)':<18} "
             f"{'ms':>8} {'heuristic ms':>12} {'speed-up':>8}"]
    for e in result["entries"]:
        lines.append(f"  {e['kind']:<6} {e['m']:>7} {e['k']:>6} {e['n']:>6} {e['groups']:>6}  "
                     f"{e['tm']:>5} {e['tk']:>5} {e['tn']:>5}   {e['ms']:>8.3f} {e['default_ms']:>12.3f} "
                     f"{e['default_ms'] / e['ms']:>7.2f}x")
    if result.get("already_tuned"):
        lines.append(f"  {len(result['already_tuned'])} shapes already in the table for {result['generation']}: left as they are")
    if result["skipped"]:
        lines.append(f"  {len(result['skipped'])} shapes left untuned (the budget ran out): run again with a larger --budget-s")
    return "\n".join(lines)
