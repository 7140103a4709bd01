"""From a Config to a mesh, sharded state and one compiled step: the ordered set-up of a run."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from hybridmoe.config.schema import Config
from hybridmoe.config.errors import ConfigError
from hybridmoe.model.params import abstract_params, declare_params, init_params, param_shardings
from hybridmoe.model.fit import sharding_problems
from hybridmoe.parallel.mesh import make_mesh
from hybridmoe.parallel.rules import RULES_TABLES, logical_to_spec, mesh_axes_of, use_rules
from hybridmoe.recipe.validate import check_requirements, compile_target
from hybridmoe.run.step import make_optimizer, train_step


@dataclasses.dataclass
class RunSetup:
    cfg: Config
    mesh: jax.sharding.Mesh
    rules: dict
    specs: Any
    param_shardings: Any
    state_shardings: Any
    optimizer: optax.GradientTransformation

    def batch_sharding(self, leading: int = 1) -> NamedSharding:
        """Sharding of [micro_batches?, B, T] batch arrays (leading unsharded dims first)."""
        spec = logical_to_spec(("batch", "seq"), self.rules)
        return NamedSharding(self.mesh, PartitionSpec(*([None] * leading), *spec))

    def abstract_state(self):
        params = abstract_params(self.specs, self.param_shardings)
        opt = jax.eval_shape(self.optimizer.init, params)
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            {"params": params, "opt_state": opt, "step": jax.ShapeDtypeStruct((), jnp.int32)},
                            self.state_shardings)

    @contextlib.contextmanager
    def context(self):
        """Mesh and rules in force while tracing model code."""
        with jax.set_mesh(self.mesh), use_rules(self.rules):
            yield


def check_batch_fits(cfg: Config, mesh, rules) -> None:
    """The batch and sequence must split evenly over the mesh axes the rules give them."""
    problems = []
    for key, size, axis in (("train.batch_size", cfg.train.batch_size, "batch"),
                            ("train.seq_len", cfg.train.seq_len, "seq")):
        mesh_axes = rules[axis]
        names = mesh_axes_of(mesh_axes)
        shards = math.prod(mesh.shape[a] for a in names)
        if size % shards:
            problems.append((key, f"{size} does not split over the {shards} shards of mesh axes {names}"))
    if problems:
        raise ConfigError(problems)


def check_on_mesh(cfg: Config, mesh) -> None:
    """The validation pass again on the mesh the run builds: its real axis sizes (the -1 axis
    resolved), its device count (not the simulated one: a run may build on a subset of the devices)
    and its devices' platform (a compile-only TPU target is validated as TPU). A rule that could
    not decide at load, before the devices were known, decides now."""
    sizes = {a: mesh.shape[a] for a in cfg.mesh.axis_sizes}
    on_mesh = cfg.mesh.model_copy(update={**sizes, "cpu_devices": 0})
    with compile_target(mesh.devices.flat[0].platform):
        check_requirements(cfg.model_copy(update={"mesh": on_mesh}))


def build(cfg: Config, devices=None) -> RunSetup:
    mesh = make_mesh(cfg.mesh, devices)
    check_on_mesh(cfg, mesh)
    rules = RULES_TABLES[cfg.mesh.rules]
    check_batch_fits(cfg, mesh, rules)
    problems = sharding_problems(cfg.model, rules, dict(mesh.shape))
    if problems:
        raise ConfigError(problems)
    specs = declare_params(cfg.model)
    p_sh = param_shardings(specs, mesh, rules)
    optimizer = make_optimizer(cfg.train)
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_abstract = jax.eval_shape(optimizer.init, abstract_params(specs))
    opt_sh = optax.tree_map_params(optimizer, lambda _, sh: sh, opt_abstract, p_sh,
                                   transform_non_params=lambda _: replicated)
    state_sh = {"params": p_sh, "opt_state": opt_sh, "step": replicated}
    return RunSetup(cfg, mesh, rules, specs, p_sh, state_sh, optimizer)


def init_state(setup: RunSetup, key: jax.Array):
    def init(key):
        params = init_params(setup.specs, key)
        return {"params": params, "opt_state": setup.optimizer.init(params), "step": jnp.int32(0)}

    with setup.context():
        return jax.jit(init, out_shardings=setup.state_shardings)(key)


def jit_train_step(setup: RunSetup):
    step = train_step(setup.cfg, setup.optimizer)
    replicated = NamedSharding(setup.mesh, PartitionSpec())
    return jax.jit(step, in_shardings=(setup.state_shardings, setup.batch_sharding(1)),
                   out_shardings=(setup.state_shardings, replicated), donate_argnums=(0,))
