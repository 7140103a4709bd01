"""The training, GRPO and sampler steps as compiled programs, for this host or a TPU topology,
and their facts.

`compile_step` lowers and compiles one of them for abstract inputs (nothing runs, no parameter is
allocated) on the devices of a *target*: "cpu:N" (N simulated CPU devices of this host) or a TPU
topology such as "tpu7x:2x2x1" or "v5p:4x4x4", whose compile-only devices come from
`jax.experimental.topologies.get_topology_desc` (needs libtpu, installed by `jax[tpu]`). The
Mosaic TPU compiler then runs for real, so memory and VMEM errors surface on this host.

`step_facts` reads what a compiled step says: per-device memory (arguments, outputs, aliased,
temporaries and their sum, against the target's HBM), the largest buffers live at the peak (XLA's
buffer assignment: shape, the op that makes them, in or out of a loop), the collectives by kind,
dtype and loop (per loop iteration: each op in a loop body runs once per iteration), XLA's FLOP
count and the count from the model shape (XLA's leaves out Pallas kernels); `saved_residuals`
lists what one layer block keeps for the backward under the remat policy. The `inspect` command
prints these; lever tests read the same functions.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from collections import defaultdict

import jax
import jax.numpy as jnp

from hybridmoe.analysis import compiled_facts, peak_memory, program
from hybridmoe.analysis.flops import model_flops_per_device
from hybridmoe.config.schema import Config
from hybridmoe.analysis.device_refusal import device_refusal

GIB = 2**30

# HBM per chip in GiB (Google Cloud TPU documentation, "TPU7x (Ironwood)" system architecture
# table: v5p 95, v6e 32, TPU7x 192; v5e 16, v4 32 from the v5e and v4 pages). A chip's HBM is
# shared by the JAX devices on it (a TPU7x chip shows two); per device = chip / devices per chip.
HBM_GIB_PER_CHIP = {"v4": 32, "v5e": 16, "v5p": 95, "v6e": 32, "tpu7x": 192}
# What a topology name looks like: libtpu describes whole hosts of 2x2x1 chips, so one chip alone
# ("v5e:1x1") is no topology it compiles for; a one-chip program is inspected on that chip's host.
TOPOLOGY_FORMS = ("use GEN:AxB for v5e and v6e or GEN:AxBxC for v4, v5p and tpu7x, whole hosts of 2x2x1 chips "
                  "(e.g. v5e:2x2, v5e:4x4, v6e:2x2, v5p:2x2x1, tpu7x:2x2x1); for one chip, run inspect without "
                  "--target on its host")


@dataclasses.dataclass(frozen=True)
class Target:
    """Where the step is compiled for."""
    name: str                   # "cpu:8", "tpu7x:2x2x1", ...
    platform: str               # "cpu" or "tpu"
    devices: tuple
    hbm_bytes_per_device: int | None

    @property
    def num_devices(self) -> int:
        return len(self.devices)


_TOPOLOGY = re.compile(r"^([a-z0-9]+):(\d+(?:x\d+)*)$")


def parse_target(name: str) -> tuple[str, int | None]:
    """("cpu", N) for "cpu:N"; ("tpu", None) for a TPU topology name; ValueError otherwise."""
    if name.startswith("cpu:"):
        n = name.split(":", 1)[1]
        if not n.isdigit() or int(n) < 1:
            raise ValueError(f"target {name!r}: cpu:N needs a positive device count N")
        return "cpu", int(n)
    m = _TOPOLOGY.match(name)
    if not m or m.group(1) not in HBM_GIB_PER_CHIP:
        raise ValueError(f"target {name!r}: use cpu:N, or a TPU topology with GEN one of "
                         f"{', '.join(sorted(HBM_GIB_PER_CHIP))}: {TOPOLOGY_FORMS}")
    return "tpu", None


def tpu_target(name: str) -> Target:
    """Compile-only devices of a TPU topology (no TPU needed; libtpu must be installed)."""
    import importlib.util

    if importlib.util.find_spec("libtpu") is None:
        raise RuntimeError(f"target {name!r} needs libtpu on this host: pip install 'jax[tpu]=="
                           f"{jax.__version__}' (installs libtpu; JAX itself is unchanged)")
    from jax.experimental import topologies

    # libtpu lets one process per host hold it (a lockfile), and on a CPU host any JAX process
    # that probes for a TPU backend takes it. Compile-only devices never touch a chip, so this
    # process shares libtpu instead of failing on that lock: set, not read (no switch of ours).
    os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    try:
        topo = topologies.get_topology_desc(name, platform="tpu")
    except jax.errors.JaxRuntimeError as e:
        reason = str(e).strip().splitlines()[0].removeprefix("INVALID_ARGUMENT: ")
        raise ValueError(f"target {name!r}: the TPU compiler refuses this topology ({reason}); {TOPOLOGY_FORMS}") from None
    gen, shape = _TOPOLOGY.match(name).groups()
    chips = math.prod(int(s) for s in shape.split("x"))
    per_chip = len(topo.devices) // chips or 1
    hbm = HBM_GIB_PER_CHIP[gen] * GIB // per_chip
    return Target(name, "tpu", tuple(topo.devices), hbm)


def host_target() -> Target:
    devs = tuple(jax.devices())
    return Target(f"{devs[0].platform}:{len(devs)}", devs[0].platform, devs, None)


def abstract_batch(cfg: Config, setup):
    """The step's batch as ShapeDtypeStructs: [micro_batches, B / micro_batches, T] int32 per field
    (auto: the fewest count; a compile-only target's choice is `compile_step`'s)."""
    from hybridmoe.run.step_plan import abstract_train_batch

    return abstract_train_batch(setup, cfg.train.fewest_micro_batches)


@dataclasses.dataclass
class CompiledStep:
    cfg: Config
    target: Target
    program: program.Program | None     # None when the compiler refused the step for memory
    compile_s: float
    residuals: list
    out_of_memory: dict | None = None   # what the refusal said (see `_out_of_hbm`)
    peak_buffers: list = dataclasses.field(default_factory=list)  # program.LiveBuffer, largest first
    program_name: str = "train"
    shapes: peak_memory.ModelShapes | None = None  # what attributes the peak's buffers to the model's parts
    cached: bool = False  # the facts (or the refusal) came from the compile cache (analysis/compiled_facts.py)
    count_search: dict | None = None  # a micro-batch count chosen under auto (`compile_step`)


# The TPU compiler refuses a program whose buffers exceed the device's HBM (after buffer
# assignment, so the figure is the program's own): analysis/device_refusal.py reads its figures.
# "G" is GiB there (a 96 GiB tpu7x device reports 94.75G available: the runtime's reserve).
def _out_of_hbm(error: Exception) -> dict | None:
    """The compiler's refusal of the program's temporaries (None: another error, or another form)."""
    refusal = device_refusal(error)
    if refusal is None or refusal["what"] != "HLO temporaries":
        return None
    return {"temp": refusal["needed_bytes"], "available": refusal["available_bytes"], "message": refusal["message"],
            "largest": buffer_rows(getattr(error, "peak_buffers", []))}


_VMEM_REFUSAL = re.compile(r"CompileTimeScopedVmemOom.*?%([A-Za-z_][\w]*?)(?:\.\d+)? = ", re.S)


def _vmem_refusal(error: Exception, cfg: Config) -> ValueError | None:
    """A Pallas kernel whose blocks do not fit the core's VMEM: a config problem (tile sizes), so
    a clear error naming the kernel, the grouped matmuls that run it with their own tile keys and
    the model's figure, not the compiler's trace."""
    from hybridmoe.recipe.kernel_needs import gmm_vmem_needs

    m = _VMEM_REFUSAL.search(str(error))
    if not m:
        return None
    kernel, g = m.group(1), cfg.kernels.gmm
    users = [(name, need) for name, need in gmm_vmem_needs(cfg).items() if f"({kernel})" in need.kernel]
    if not users:
        return ValueError(f"the Pallas kernel {kernel} does not fit the TPU core's VMEM under its limit; lower its "
                          "blocks or raise its family's vmem_limit_mib (hybridmoe describe lists the kernels)")
    which = "; ".join(f"{need.text()} by the model, at "
                      + " ".join(f"kernels.gmm.{name}_{d}={getattr(g, f'{name}_{d}') or getattr(g, d)}"
                                 for d in ("tm", "tk", "tn"))
                      for name, need in users)
    return ValueError(f"the Pallas kernel {kernel} does not fit the TPU core's VMEM (the compiler refused it): "
                      f"{which}; lower those tiles (or, for wi_fused_swiglu_fwd, kernels.gmm.wi_fwd_rhs_buffer_count=1) "
                      "or raise kernels.gmm.vmem_limit_mib")


def shard_bytes(tree) -> int:
    """Bytes one device holds of abstract arrays with shardings (the largest shard of each). A PRNG
    key (the sampler's) counts the words of its key data."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), leaf.dtype))
            total += math.prod(shape) * math.prod(data.shape) * data.dtype.itemsize
        else:
            total += math.prod(shape) * jnp.dtype(leaf.dtype).itemsize
    return total


PROGRAMS = ("train", "grpo", "sample")


def abstract_grpo_batch(cfg: Config, setup) -> dict:
    """One GRPO update's batch as ShapeDtypeStructs [M, b, ...] (rl/memory_plan.py): the rows of one
    mini-batch in rl.micro_batches micro-batches (auto: the fewest, 1; the run's own choice reads the
    device's memory), with pi_old's log-probs when a rollout takes several updates."""
    from hybridmoe.rl.memory_plan import abstract_update_batch, update_rows_per_step

    r = cfg.rl
    return abstract_update_batch(cfg, setup, r.fewest_micro_batches, update_rows_per_step(cfg),
                                 r.updates_per_rollout > 1)


def jitted_program(cfg: Config, setup, program_name: str):
    """(the jitted function, its abstract inputs, the name of its HLO module) of one program."""
    from hybridmoe.run.setup import jit_train_step

    state = setup.abstract_state()
    if program_name == "train":
        return jit_train_step(setup), (state, abstract_batch(cfg, setup)), "jit_step"
    if program_name == "grpo":
        from hybridmoe.recipe.validate import check_rl_requirements
        from hybridmoe.rl.grpo import jit_grpo_step

        check_rl_requirements(cfg, platform=setup.mesh.devices.flat[0].platform, devices=setup.mesh.size)
        with_reference = cfg.rl.beta > 0
        ref = state["params"] if with_reference else None
        return (jit_grpo_step(setup, with_reference),
                (state, ref, abstract_grpo_batch(cfg, setup)), "jit_step")
    if program_name == "sample":
        from jax.sharding import NamedSharding, PartitionSpec

        from hybridmoe.rl.sampler import SamplingOptions, make_generate

        r = cfg.rl
        replicated = NamedSharding(setup.mesh, PartitionSpec())
        # As the RL loop calls it: the step's prompts (replicated), each prefilled once for its group.
        generate = make_generate(cfg, SamplingOptions(r.max_new_tokens, r.temperature, r.top_p, top_k=r.top_k),
                                 group_size=r.group_size,
                                 in_shardings=(setup.param_shardings, replicated, replicated, replicated, replicated))
        prompts = jax.ShapeDtypeStruct((r.prompts_per_step, r.max_prompt_len), jnp.int32, sharding=replicated)
        key = jax.eval_shape(lambda: jax.random.key(0))
        key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=replicated)
        return generate, (state["params"], prompts, prompts, prompts, key), "jit__lambda"
    raise ValueError(f"unknown program {program_name!r}; choices: {', '.join(PROGRAMS)}")


# The count each program's micro-batches are set by.
COUNT_KEYS = {"train": "train.micro_batches", "grpo": "rl.micro_batches"}


def compile_step(cfg: Config, target: Target, *, with_residuals: bool = True, program_name: str = "train",
                 memory_only: bool = False) -> CompiledStep:
    """`compile_one`, with a micro-batch count under auto (train.micro_batches for "train",
    rl.micro_batches for "grpo") chosen as a run on the target would choose it: the search of
    run/memory_fit.py (the fewest count that splits the rows, counts the first one's figure rules
    out passed over) over the target's HBM by `fit_bytes`. The step returned is the chosen count's
    (or, where none fits, the last compiled), its `count_search` saying what each count did. A target
    without an HBM figure (a CPU) takes the fewest count, as a run there does."""
    from hybridmoe.rl.memory_plan import update_counts, update_held_bytes
    from hybridmoe.run.memory_fit import Fit, fewest_that_fit, per_device_bytes, with_count
    from hybridmoe.run.setup import build
    from hybridmoe.run.step_plan import train_counts

    key = COUNT_KEYS.get(program_name)
    section, field = key.split(".") if key else (None, None)
    if key is None or getattr(getattr(cfg, section), field) != "auto" or target.hbm_bytes_per_device is None:
        return compile_one(cfg, target, with_residuals=with_residuals, program_name=program_name,
                           memory_only=memory_only)
    budget = target.hbm_bytes_per_device
    setup = build(cfg, list(target.devices))
    if program_name == "grpo":
        counts, held = update_counts(setup), update_held_bytes(setup, cfg.rl.beta > 0)
    else:
        counts, held = train_counts(setup), per_device_bytes(setup.abstract_state())
    steps: dict[int, CompiledStep] = {}
    fits: dict[int, Fit] = {}

    def compile_at(count: int) -> Fit:
        step = steps[count] = compile_one(with_count(cfg, key, count), target, with_residuals=with_residuals,
                                          program_name=program_name, memory_only=memory_only)
        need = None if step.program is None else fit_bytes(memory_facts(step.program, budget))
        fits[count] = Fit(count, step if need is not None else None, need,
                          None if step.out_of_memory is None else step.out_of_memory["temp"])
        return fits[count]

    fit = fewest_that_fit(counts, compile_at, budget, held, key=key)
    step = steps[fit.count] if fit is not None else steps[max(steps)]
    searched = counts[:counts.index(fit.count) + 1] if fit is not None else counts
    tried = [{"count": c, "compiled": c in fits, "need": fits[c].need if c in fits else None,
              "refused_temp": fits[c].least_need if c in fits else None,
              "fits": fit is not None and c == fit.count} for c in searched]
    step.count_search = {"key": key, "setting": "auto", "counts": counts, "budget": budget, "held": held,
                         "tried": tried, "chosen": None if fit is None else fit.count}
    return step


def compile_one(cfg: Config, target: Target, *, with_residuals: bool = True, program_name: str = "train",
                memory_only: bool = False) -> CompiledStep:
    """Lower and compile one program for the target's devices (nothing is run): the supervised
    training step ("train"), one GRPO update ("grpo": rl.* rows, micro-batches, pi_old and the
    reference policy where the config holds them) or the sampler ("sample": one rollout batch's
    prefill and its decode loop, KV cache and GDN state included). A TPU compile refused for HBM
    comes back as a step without a program whose `out_of_memory` holds the compiler's figure and
    the arguments' per-device bytes.

    `memory_only`: read the compile at its buffer assignment, before code generation
    (program.read_buffer_assignment): the program's HLO, its peak and XLA's default memory space,
    without the compiler's memory analysis or cost figures (the memory facts say `memory_only`);
    the compile goes on in a background thread unless it finished first."""
    from hybridmoe.run.setup import build

    setup = build(cfg, list(target.devices))
    with setup.context():
        fn, inputs, module = jitted_program(cfg, setup, program_name)
        shapes = peak_memory.model_shapes(cfg, setup.abstract_state())
        lowered = fn.lower(*inputs)
        lowered_text = lowered.as_text()
        try:
            facts = compiled_facts.compile(lowered, module_name=module, memory_only=memory_only,
                                           lowered_text=lowered_text)
        except jax.errors.JaxRuntimeError as e:
            refusal = _out_of_hbm(e)
            if refusal is None:
                vmem = _vmem_refusal(e, cfg)
                if vmem is not None:
                    raise vmem from None
                raise
            refusal["argument"] = shard_bytes(inputs)
            return CompiledStep(cfg, target, None, e.compile_s, [], refusal,
                                peak_buffers=getattr(e, "peak_buffers", []), program_name=program_name,
                                shapes=shapes, cached=e.cached)
        residuals = block_residuals(cfg, setup) if with_residuals and program_name == "train" else []
    prog = program.Program(lowered_text, facts.hlo_text, facts.memory, facts.cost)
    return CompiledStep(cfg, target, prog, facts.compile_s, residuals, peak_buffers=facts.buffers,
                        program_name=program_name, shapes=shapes, cached=facts.cached)


def block_residuals(cfg: Config, setup) -> list[program.Residual]:
    """What one layer block's forward keeps for its backward under the config's remat policy
    (global shapes; the layer scan stacks one set per block)."""
    from hybridmoe.quant import LayerWeights
    from hybridmoe.model.forward import block_fn
    from hybridmoe.model.params import abstract_params, layer_axes
    from hybridmoe.model.remat import checkpointed

    t, m = cfg.train, cfg.model
    params = abstract_params(setup.specs, setup.param_shardings)
    # One iteration's xs of the layer scan: the block's params (and the hoisted fp8 absmax).
    with setup.context():
        xs = jax.eval_shape(LayerWeights(cfg, layer_axes(m)).scan_xs, params)
    block_params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), xs)
    ids = jax.ShapeDtypeStruct((t.rows_per_micro_batch, t.seq_len), jnp.int32)
    x = jax.ShapeDtypeStruct((t.rows_per_micro_batch, t.seq_len, m.d_model), jnp.dtype(m.compute_dtype))

    def block(x, bp, seg, pos):
        return checkpointed(block_fn(cfg, pos, seg), cfg, t.rows_per_micro_batch * t.seq_len)(x, bp)

    return program.saved_residuals(block, x, block_params, ids, ids)


# ---------------------------------------------------------------------------------------------
# Facts


def memory_facts(prog: program.Program, hbm_bytes: int | None) -> dict:
    """Per-device bytes. `total` = arguments + outputs - aliased (donated) + temporaries: every
    buffer of the step live at once, an upper bound of the step's HBM need."""
    m = prog.memory
    if m.get("memory_only"):  # read at buffer assignment (compile_step's memory_only): no analysis
        out = {"argument": m["argument"], "output": None, "alias": None, "temp": None, "generated_code": None,
               "total": None, "default_space": m["default_space"], "hbm": hbm_bytes, "memory_only": True}
        out["fits"] = None if hbm_bytes is None or m["default_space"] is None else m["default_space"] <= hbm_bytes
        return out
    total = m.get("argument", 0) + m.get("output", 0) - m.get("alias", 0) + m.get("temp", 0)
    out = {k: m.get(k, 0) for k in ("argument", "output", "alias", "temp", "generated_code")}
    out["total"] = total
    # XLA's memory-usage report: the default memory space as buffer assignment packed it (arguments
    # and the temporaries' heap). On CPU it agrees with `total`; a TPU compile's `temp` can count
    # more than the heap the dumps place.
    out["default_space"] = m.get("default_space")
    out["hbm"] = hbm_bytes
    out["fits"] = None if hbm_bytes is None else fit_bytes(out) <= hbm_bytes
    return out


def fit_bytes(memory: dict) -> int:
    """What a step needs of the device's HBM: the default memory space of XLA's report where the
    compile wrote one (arguments and the heap its buffer assignment packed: what the TPU compiler
    allocates and checks against HBM, refusing a step whose heap does not fit), else `total`.
    On TPU, memory_analysis' temporaries can count far more than that heap (the 397B cell's recipe:
    89.80 GiB against a 59.92 GiB heap, 98.47 GiB in all, a program the compiler accepted for 94.75
    GiB of HBM; docs/performance.md), so `total` over-states the need there."""
    return memory["total"] if memory.get("default_space") is None else memory["default_space"]


def collective_rows(colls: list[program.Collective]) -> list[dict]:
    """One row per (where, kind, dtype): `where` is "outside loops" or the enclosing loop with
    its trip count; ops and bytes are per execution of that place (per loop iteration)."""
    acc: dict = defaultdict(lambda: {"ops": 0, "bytes": 0})
    for c in colls:
        where = "outside loops" if not c.in_loop else (
            f"loop depth {c.loop_depth}, {c.trip_count if c.trip_count else '?'} iterations")
        row = acc[(where, c.kind, c.dtype)]
        row["ops"] += 1
        row["bytes"] += c.bytes
    return [{"where": w, "kind": k, "dtype": d, **v} for (w, k, d), v in sorted(acc.items())]


def residual_rows(residuals: list[program.Residual]) -> list[dict]:
    """Named residuals grouped by name: count, shapes, dtype, bytes (one block, global)."""
    acc: dict = {}
    for r in residuals:
        if not r.name:
            continue
        nbytes = math.prod(r.shape) * jnp.dtype(r.dtype).itemsize
        row = acc.setdefault(r.name, {"name": r.name, "count": 0, "shape": list(r.shape),
                                      "dtype": r.dtype, "bytes": 0})
        row["count"] += 1
        row["bytes"] += nbytes
    return sorted(acc.values(), key=lambda r: r["name"])


def residual_bytes(residuals: list[program.Residual]) -> int:
    return sum(math.prod(r.shape) * jnp.dtype(r.dtype).itemsize for r in residuals)


def refused_memory_facts(refusal: dict, hbm_bytes: int | None) -> dict:
    """Memory facts of a step the compiler refused: its temporaries (the compiler's figure), the
    arguments (shard sizes), outputs aliased onto the donated state; `fits` False."""
    return {"argument": refusal["argument"], "output": None, "alias": None, "temp": refusal["temp"],
            "generated_code": None, "total": refusal["argument"] + refusal["temp"], "hbm": hbm_bytes,
            "fits": False, "refused": refusal["message"]}


PEAK_BUFFERS_SHOWN = 12


def buffer_rows(buffers: list[program.LiveBuffer], top: int = PEAK_BUFFERS_SHOWN,
                shapes: peak_memory.ModelShapes | None = None) -> list[dict]:
    """The largest buffers live at the peak, one row each (per device), with their category when
    `shapes` is given (arguments and outputs: their storage)."""
    def what(b):
        if b.storage != "temp" or shapes is None:
            return b.storage
        return peak_memory.category(b, shapes)

    return [{"bytes": b.bytes, "shape": b.shape, "op_name": b.op_name, "value": b.value,
             "where": f"in loop {b.loop}" if b.in_loop else "outside loops", "category": what(b)}
            for b in buffers[:top]]


def peak_by_category(step: CompiledStep, memory: dict) -> dict | None:
    """The step's temporaries at the peak itemised by what made them, with their share of the
    compiler's temporaries figure and of the default memory space's heap (analysis/peak_memory.py).
    `memory`: the step's memory facts."""
    if step.shapes is None or not step.peak_buffers:
        return None
    temp = step.program.memory.get("temp") if step.program is not None else step.out_of_memory["temp"]
    peak = peak_memory.itemise(step.peak_buffers, step.shapes, temp)
    return peak | {"heap_share": peak_memory.heap_share(peak, memory)}


def step_facts(step: CompiledStep) -> dict:
    prog = step.program
    model_flops = model_flops_per_device(step.cfg, step.target.num_devices, step.program_name)
    if prog is None:
        memory = refused_memory_facts(step.out_of_memory, step.target.hbm_bytes_per_device)
        return {"target": step.target.name, "devices": step.target.num_devices, "count_search": step.count_search,
                "compile_s": round(step.compile_s, 1), "compile_cached": step.cached, "memory": memory,
                "flops": None, "model_flops": model_flops, "collectives": [], "saved_residuals": [],
                "saved_residual_bytes_per_block": None,
                "peak_buffers": buffer_rows(step.peak_buffers, shapes=step.shapes) or step.out_of_memory.get("largest", []),
                "peak_by_category": peak_by_category(step, memory)}
    memory = memory_facts(prog, step.target.hbm_bytes_per_device)
    return {"target": step.target.name, "devices": step.target.num_devices, "count_search": step.count_search,
            "compile_s": round(step.compile_s, 1), "compile_cached": step.cached, "memory": memory,
            "flops": prog.cost.get("flops"), "model_flops": model_flops,
            "peak_buffers": buffer_rows(step.peak_buffers, shapes=step.shapes),
            "peak_by_category": peak_by_category(step, memory),
            "collectives": collective_rows(prog.compiled_collectives),
            "saved_residuals": residual_rows(step.residuals),
            "saved_residual_bytes_per_block": residual_bytes(step.residuals)}


# ---------------------------------------------------------------------------------------------
# Text


def format_count_search(search: dict) -> str:
    """One line: the count chosen under auto and what each count tried did."""
    def one(t):
        if not t["compiled"]:
            return f"{t['count']} passed over (ruled out by the first count's figure)"
        if t["need"] is None:
            return f"{t['count']} refused by the compiler ({t['refused_temp'] / GIB:.2f} GiB of temporaries)"
        return f"{t['count']} needs {t['need'] / GIB:.2f} GiB" + ("" if t["fits"] else " (over)")
    chosen = "none fits" if search["chosen"] is None else f"{search['chosen']} chosen"
    return (f"{search['key']}=auto: {chosen} against {search['budget'] / GIB:.2f} GiB per device "
            f"(held state {search['held'] / GIB:.2f} GiB): " + "; ".join(one(t) for t in search["tried"]))


def _in(unit: int):
    return lambda n: "-" if n is None else f"{n / unit:.2f}"


def format_facts(columns: dict[str, dict]) -> str:
    """The facts of one or more programs (name -> step_facts) side by side."""
    names = list(columns)
    width = max(12, *(len(n) for n in names))
    head = lambda title: f"{title:<34}" + "".join(f"{n:>{width + 2}}" for n in names)  # noqa: E731
    lines = [head("per device")]
    mem = {n: c["memory"] for n, c in columns.items()}
    big = max(fit_bytes(m) or 0 for m in mem.values()) >= GIB
    unit, fmt = ("GiB", _in(GIB)) if big else ("MiB", _in(2**20))
    for key, label in (("argument", "arguments"), ("output", "outputs"), ("alias", "aliased (donated)"),
                       ("temp", "temporaries"), ("total", "total (args+outs-aliased+temps)"),
                       ("default_space", "default space (XLA report)"), ("hbm", "HBM")):
        lines.append(f"{label + ' ' + unit:<34}" + "".join(f"{fmt(mem[n].get(key)):>{width + 2}}" for n in names))
    fits = {n: mem[n]["fits"] for n in names}
    lines.append(f"{'fits HBM (default space)':<34}" + "".join(
        f"{'-' if fits[n] is None else ('yes' if fits[n] else 'NO'):>{width + 2}}" for n in names))
    for key, label in (("flops", "TFLOPs per device (XLA)"), ("model_flops", "TFLOPs per device (model shape)")):
        lines.append(f"{label:<34}" + "".join(
            f"{'-' if columns[n].get(key) is None else format(columns[n][key] / 1e12, '.4f'):>{width + 2}}"
            for n in names))
    lines.append(f"{'compile s':<34}" + "".join(f"{columns[n]['compile_s']:>{width + 2}.1f}" for n in names))
    lines.append(f"{'  read from the compile cache':<34}" + "".join(
        f"{'yes' if columns[n].get('compile_cached') else 'no':>{width + 2}}" for n in names))
    lines.append("")
    lines.append("collectives (compiled; ops and MiB per execution of the place, per device)")
    keys = sorted({(r["where"], r["kind"], r["dtype"]) for c in columns.values() for r in c["collectives"]})
    by = {n: {(r["where"], r["kind"], r["dtype"]): r for r in c["collectives"]} for n, c in columns.items()}
    for key in keys:
        label = f"  {key[0]}: {key[1]} {key[2]}"
        cells = []
        for n in names:
            r = by[n].get(key)
            cells.append("-" if r is None else f"{r['ops']} / {r['bytes'] / 2**20:.2f}")
        lines.append(f"{label:<50}" + "".join(f"{c:>{width + 2}}" for c in cells))
    lines.append("")
    lines.append("named residuals one layer block saves for the backward (global MiB)")
    rnames = sorted({r["name"] for c in columns.values() for r in c["saved_residuals"]})
    rby = {n: {r["name"]: r for r in c["saved_residuals"]} for n, c in columns.items()}
    for rn in rnames:
        cells = ["-" if rn not in rby[n] else f"{rby[n][rn]['count']}x {rby[n][rn]['bytes'] / 2**20:.2f}"
                 for n in names]
        lines.append(f"  {rn:<32}" + "".join(f"{c:>{width + 2}}" for c in cells))
    lines.append(f"  {'all residuals (named or not)':<32}" + "".join(
        f"{_in(2**20)(columns[n]['saved_residual_bytes_per_block']):>{width + 2}}" for n in names))
    for n in names:
        rows = columns[n].get("peak_buffers") or []
        if rows:
            lines.append("")
            lines.append(f"{n}: the largest buffers live at the peak (per device)")
            for r in rows:
                lines.append(f"  {fmt(r['bytes']):>9} {unit}  {r['shape']:<28} {r.get('category', ''):<30} "
                             f"{r['where']:<22} {r['op_name'][:110]}")
        itemised = peak_memory.format_itemised(n, columns[n].get("peak_by_category"), GIB if big else 2**20, unit)
        if itemised:
            lines.append("")
            lines.extend(itemised)
    for n in names:
        if mem[n].get("refused"):
            lines.append(f"{n}: the compiler refused the step for memory (temporaries as it reports them, "
                         f"arguments from their shardings): {mem[n]['refused']}")
    return "\n".join(lines)
