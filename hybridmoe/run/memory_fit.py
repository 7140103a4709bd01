"""Counts that fit by construction: the fewest micro-batches whose compiled program fits the device.

A program's need is what the compiler reports for the program it built for these devices: its
arguments + temporaries + outputs - aliased (donated state written in place), per device; on a
TPU, the default memory space of XLA's memory-usage report, which its compiler checks against HBM
(`compile_measured`). The
budget is run.memory_budget_gib, or else the device's free memory, bytes_limit - bytes_in_use, read
before the run places its state on the device (the program's own figure holds its arguments, the
state among them). A CPU reports no limit: with no budget set, nothing is checked there and auto
is the fewest count (1 where it divides).

Where the device's compiler itself refuses a program for memory (a TPU's RESOURCE_EXHAUSTED at
compile time) that count does not fit either: the compiler decides where it can.

The search compiles the candidate counts in increasing order and stops at the first that fits
(a program's need falls as its micro-batches shrink), and hands back that compiled program, which
the run then calls: nothing is compiled twice. A compile of a GRPO update on a chip takes over a
minute, so counts that cannot fit are skipped without one: a program at M micro-batches needs at
least the training state it holds (the same at every count) plus the rest of the first count's
need scaled by (first count / M), since at most the per-micro-batch part shrinks; a count whose need
is over the budget even so is passed over. The first count's need is its compiled figure, or the
figure of the compiler's refusal (its temporaries: a floor of the part that shrinks).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence

import jax

from hybridmoe.analysis.compiled_facts import memory_refusal
from hybridmoe.analysis.device_refusal import device_refusal
from hybridmoe.config.schema import Config
from hybridmoe.run.run_dir import RunError

GIB = 2**30
log = logging.getLogger(__name__)


def program_bytes(compiled) -> int:
    """Per-device bytes a compiled program needs: arguments + temporaries + outputs - aliased."""
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes)


def compile_measured(lowered, platform: str) -> tuple[object, int]:
    """(the compiled program, its need in bytes per device). On a TPU the need is the default memory
    space of XLA's memory-usage report (the arguments and the temporaries' heap as buffer assignment
    packed them: what the TPU compiler checks against HBM, refusing what does not fit), since
    memory_analysis' temporaries can count far more than that heap (a tiny training step for
    v5e:2x2: 38.95 MiB by program_bytes, 25.62 in the default space); elsewhere, or where the compile
    wrote no report, program_bytes. A TPU compile read this way bypasses JAX's persistent cache (its
    report is written by a real compile): each run on a chip compiles its planned programs once."""
    if platform == "tpu":
        from hybridmoe.analysis.program import compile_with_buffers

        compiled, _, space = compile_with_buffers(lowered, buffers=False)
        return compiled, program_bytes(compiled) if space is None else space
    compiled = lowered.compile()
    return compiled, program_bytes(compiled)


def kept_measured(setup, key, lower: Callable[[], object]) -> tuple[object, int]:
    """compile_measured of the program `lower()` lowers, on the set-up's devices, kept on the set-up under `key`."""
    platform = setup.mesh.devices.flat[0].platform

    def make():
        with setup.context():
            return compile_measured(lower(), platform)

    return setup.kept(key, make)


def memory_budget_bytes(cfg: Config) -> int | None:
    """Bytes a program may need per device: run.memory_budget_gib, or the device's free memory now
    (read before the run places its state: the program's own figure holds its arguments); None where
    neither is known (a CPU without a set budget)."""
    if cfg.run.memory_budget_gib is not None:
        return int(cfg.run.memory_budget_gib * GIB)
    stats = jax.local_devices()[0].memory_stats() or {}
    if not stats.get("bytes_limit"):
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def per_device_bytes(abstract_tree) -> int:
    """Bytes one device holds of a tree of ShapeDtypeStructs with shardings (its shard of each)."""
    return sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(abstract_tree))


def fits(need: int, budget: int | None) -> bool:
    return budget is None or need <= budget


@dataclasses.dataclass(frozen=True)
class Fit:
    """A count, its compiled program and that program's need in bytes per device (None: refused by
    the compiler for memory; least_need then holds the refusal's own figure where it gave one)."""
    count: int
    compiled: object
    need: int | None
    least_need: int | None = None

    @property
    def need_floor(self) -> int | None:
        """Bytes this count needs at the least: its need, else the compiler's figure when it refused."""
        return self.need if self.need is not None else self.least_need


def compile_or_refusal(compile_at: Callable[[int], object], count: int) -> Fit:
    """The program of `count` compiled, or a Fit without a program where the compiler refused it for
    memory. compile_at returns the program (its need: program_bytes), (the program, its need), or a
    Fit it made itself (a caller that reads a refusal on its own, as `inspect` does)."""
    try:
        compiled = compile_at(count)
    except jax.errors.JaxRuntimeError as e:
        if not memory_refusal(e):
            raise
        return Fit(count, None, None, (device_refusal(e) or {}).get("needed_bytes"))
    if isinstance(compiled, Fit):
        return compiled
    compiled, need = compiled if isinstance(compiled, tuple) else (compiled, program_bytes(compiled))
    return Fit(count, compiled, need)


def cannot_fit(first: Fit, count: int, budget: int | None, fixed_bytes: int = 0) -> bool:
    """Whether `count` is certain not to fit, from the first count's need: its part beyond
    `fixed_bytes` (what no count changes: the training state among the arguments) scaled by
    first.count / count, as if it all shrank with the micro-batch, plus the fixed part, is over the
    budget. From a refusal, the compiler's figure (its temporaries) is that part's floor."""
    if budget is None or first.need_floor is None:
        return False
    shrinking = first.least_need if first.need is None else max(first.need - fixed_bytes, 0)
    return fixed_bytes + shrinking * first.count / count > budget


def fewest_that_fit(counts: Sequence[int], compile_at: Callable[[int], object], budget: int | None,
                    fixed_bytes: int = 0, first: Fit | None = None, key: str = "count") -> Fit | None:
    """The first of `counts` (increasing) whose program compiles and fits `budget`; None if none does.
    Counts the first one's need rules out are never compiled (cannot_fit; fixed_bytes: the bytes of
    the program's arguments that no count changes); `first`: a smaller count already compiled that
    did not fit, whose figure rules out from the start. Each count's outcome is logged (INFO) under `key`."""
    for count in counts:
        if first is not None and cannot_fit(first, count, budget, fixed_bytes):
            log.info("%s=%d: passed over (the figure at %d rules it out)", key, count, first.count)
            continue
        fit = compile_or_refusal(compile_at, count)
        if _judged(key, fit, budget):
            return fit
        first = first or fit
    return None


def _judged(key: str, fit: Fit, budget: int | None) -> bool:
    """Whether a compiled count fits `budget`; logged (INFO) either way under `key`."""
    ok = fit.compiled is not None and fits(fit.need, budget)
    log.info("%s=%d: %s", key, fit.count, _need_words(fit, "the program") + ("" if ok else ", over the budget"))
    return ok


def _need_words(fit: Fit, what: str) -> str:
    if fit.need is not None:
        return f"{what} needs {fit.need / GIB:.2f} GiB per device"
    figure = "" if fit.least_need is None else f" ({fit.least_need / GIB:.2f} GiB of temporaries)"
    return f"the device's compiler refused {what} for memory{figure}"


def _budget_words(budget: int | None) -> str:
    if budget is None:
        return "the device's memory"
    return f"the budget of {budget / GIB:.2f} GiB per device (run.memory_budget_gib, else the device's free memory)"


def choose_count(key: str, setting: int | str, counts: Sequence[int], compile_at: Callable[[int], object],
                 budget: int | None, what: str, fixed_bytes: int = 0) -> Fit:
    """The count of `key` and its compiled program: under auto the fewest of `counts` that fits; a
    set count is compiled and kept when it fits, else refused (RunError) with the smallest count above
    it that fits. `what`: the program's name in the messages; fixed_bytes: fewest_that_fit's."""
    if setting == "auto":
        fit = fewest_that_fit(counts, compile_at, budget, fixed_bytes, key=key)
        if fit is None:
            raise RunError(f"{key}=auto: {what} fits {_budget_words(budget)} at none of the counts {list(counts)}: "
                           "shorten the rows (rl.max_new_tokens, rl.max_prompt_len), remat more, or raise "
                           "run.memory_budget_gib")
        return fit
    fit = compile_or_refusal(compile_at, setting)
    if _judged(key, fit, budget):
        return fit
    smaller = fewest_that_fit([c for c in counts if c > setting], compile_at, budget, fixed_bytes, first=fit, key=key)
    fix = (f"the smallest count that fits is {key}={smaller.count} (or {key}=auto)" if smaller is not None else
           f"no count up to {max(counts)} fits: shorten the rows or remat more")
    raise RunError(f"{key}={setting}: {_need_words(fit, what)}, over {_budget_words(budget)}; {fix}")


def with_count(cfg: Config, key: str, count: int) -> Config:
    """`cfg` with the count `key` ("section.field", e.g. rl.micro_batches) set to `count`: a key
    chosen under auto resolved to what was chosen."""
    section, field = key.split(".")
    return cfg.model_copy(update={section: getattr(cfg, section).model_copy(update={field: count})})


def divisor_counts(rows: int, shards: int = 1) -> list[int]:
    """Counts M that split `rows` into equal micro-batches, each of which splits over `shards`, increasing."""
    return [m for m in range(1, rows + 1) if rows % m == 0 and (rows // m) % shards == 0]


def batch_shards(setup) -> int:
    """How many ways the mesh splits a batch's rows (the batch axes of the rules table)."""
    spec = setup.batch_sharding(0).spec[0]
    axes = () if spec is None else (spec,) if isinstance(spec, str) else tuple(spec)
    return math.prod(setup.mesh.shape[a] for a in axes)
