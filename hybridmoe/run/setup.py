"""From a Config to a mesh, sharded state and one compiled step: the ordered set-up of a run."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from hybridmoe.config.schema import Config
from hybridmoe.model.params import abstract_params, declare_params, init_params, param_shardings
from hybridmoe.parallel.mesh import make_mesh
from hybridmoe.parallel.rules import logical_to_spec, rules_table, use_rules
from hybridmoe.recipe.validate import check_requirements
from hybridmoe.run.step import make_optimizer, train_step


@dataclasses.dataclass(eq=False)
class RunSetup:
    cfg: Config
    mesh: jax.sharding.Mesh
    rules: dict
    specs: Any
    param_shardings: Any
    state_shardings: Any
    optimizer: optax.GradientTransformation
    # What kept() made: the loops' jitted programs (not a constructor field, so dataclasses.replace,
    # which may change what they are made of, starts an empty one).
    _kept: dict = dataclasses.field(default_factory=dict, init=False, repr=False)

    def kept(self, key, make: Callable[[], Any]):
        """make() once per set-up and key: a loop's jitted program, so that a run started again in
        this process with the same config and devices (a resume, a reference arm run twice) traces
        and compiles nothing again. The key names the program and whatever else it depends on."""
        if key not in self._kept:
            self._kept[key] = make()
        return self._kept[key]

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


# The last few set-ups, by config and devices: build() of an equal config on the same devices gives
# the same set-up, with the programs it keeps.
_SETUPS: collections.OrderedDict = collections.OrderedDict()
SETUPS_KEPT = 4


def build(cfg: Config, devices=None) -> RunSetup:
    """The run's mesh over `devices` (default: every device), its sharded state and optimizer; the
    config validated first for those devices (their platform and count: the -1 axis resolved, the
    batch and every weight split over the real mesh). One of the last SETUPS_KEPT set-ups when
    config and devices are equal (forget_setups() drops them)."""
    devices = list(jax.devices() if devices is None else devices)
    key = (cfg.model_dump_json(), tuple(devices))
    if key in _SETUPS:
        _SETUPS.move_to_end(key)
        return _SETUPS[key]
    check_requirements(cfg, platform=devices[0].platform, devices=len(devices))
    sizes, _ = cfg.mesh.resolve(len(devices))  # they fit: the validator checked it
    mesh = make_mesh(sizes, devices)
    rules = rules_table(cfg.mesh.rules, cfg.mesh.expert_fsdp_dim)
    specs = declare_params(cfg.model)
    p_sh = param_shardings(specs, mesh, rules)
    optimizer = make_optimizer(cfg.train)
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_abstract = jax.eval_shape(optimizer.init, abstract_params(specs))
    opt_sh = optax.tree_map_params(optimizer, lambda _, sh: sh, opt_abstract, p_sh,
                                   transform_non_params=lambda _: replicated)
    state_sh = {"params": p_sh, "opt_state": opt_sh, "step": replicated}
    _SETUPS[key] = setup = RunSetup(cfg, mesh, rules, specs, p_sh, state_sh, optimizer)
    if len(_SETUPS) > SETUPS_KEPT:
        _SETUPS.popitem(last=False)
    return setup


def forget_setups() -> None:
    """Drop the kept set-ups and their programs: the next build() builds, and its programs trace
    the code as it is now (a test that patches model code in calls it)."""
    _SETUPS.clear()


def init_state(setup: RunSetup, key: jax.Array):
    def make():
        def init(key):
            params = init_params(setup.specs, key)
            return {"params": params, "opt_state": setup.optimizer.init(params), "step": jnp.int32(0)}
        return jax.jit(init, out_shardings=setup.state_shardings)

    with setup.context():
        return setup.kept("init_state", make)(key)


def jit_train_step(setup: RunSetup):
    step = train_step(setup.cfg, setup.optimizer)
    replicated = NamedSharding(setup.mesh, PartitionSpec())
    return jax.jit(step, in_shardings=(setup.state_shardings, setup.batch_sharding(1)),
                   out_shardings=(setup.state_shardings, replicated), donate_argnums=(0,))
