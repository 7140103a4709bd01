"""hybridmoe.analysis.program on small programs whose collectives, loops and residuals are known."""

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from hybridmoe.analysis import program


def _mesh():
    """Built when a test runs, not at import: `pytest --chip` collects this file on a one-device host."""
    return jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))


RING = [(i, (i + 1) % 8) for i in range(8)]


def _looped(c, ws):
    """A 3-step scan whose body runs one of each collective (the reduce-scatter in bf16),
    then one all-reduce after the loop."""
    def body(c, w):
        g = jax.lax.all_gather(w, "x", tiled=True)                        # f32[16]
        s = jax.lax.psum(c, "x")                                          # f32[4]
        r = jax.lax.psum_scatter(g.astype(jnp.bfloat16), "x", tiled=True)  # bf16[2]
        p = jax.lax.ppermute(c, "x", RING)
        a = jax.lax.all_to_all(g.reshape(8, 2), "x", 0, 0, tiled=True)    # f32[8, 2]
        return p + s + r.astype(jnp.float32).sum() + a.sum(), None

    def inner(c, ws):
        c, _ = jax.lax.scan(body, jax.lax.pcast(c, ("x",), to="varying"), ws)
        return jax.lax.psum(c, "x")

    return jax.shard_map(inner, mesh=_mesh(), in_specs=(P(), P(None, "x")), out_specs=P())(c, ws)


def _analyzed():
    return program.analyze(jax.jit(_looped), jnp.ones((4,)), jnp.ones((3, 16)))


def test_lowered_collectives_by_kind_dtype_bytes_and_loop():
    colls = _analyzed().lowered_collectives
    assert program.count(colls, in_loop=True) == 5 and program.count(colls, in_loop=False) == 1
    by = {(c.kind, c.in_loop): c for c in colls}
    assert by[("all-gather", True)].dtype == "f32" and by[("all-gather", True)].bytes == 64
    assert by[("reduce-scatter", True)].dtype == "bf16" and by[("reduce-scatter", True)].bytes == 4
    assert by[("all-to-all", True)].shape == (8, 2)
    assert by[("collective-permute", True)].bytes == 16
    assert by[("all-reduce", False)].loop_depth == 0


def test_compiled_collectives_per_iteration_and_trip_count():
    colls = _analyzed().compiled_collectives
    per_iter = program.per_iteration(colls)
    (loop, kinds), = per_iter.items()
    assert kinds == {"all-gather": 1, "all-reduce": 1, "reduce-scatter": 1, "collective-permute": 1,
                     "all-to-all": 1}
    assert all(c.trip_count == 3 for c in colls if c.in_loop)
    # The CPU backend widens the bf16 reduce-scatter when it compiles: dtype is a lowered-text
    # question.
    assert program.count(colls, kind="reduce-scatter", dtype="f32") == 1
    outside = [c for c in colls if not c.in_loop]
    assert [c.kind for c in outside] == ["all-reduce"]
    # Executed bytes count the loop three times.
    loop_bytes = sum(c.bytes for c in colls if c.in_loop)
    assert program.executed_bytes(colls) == 3 * loop_bytes + outside[0].bytes


def test_memory_and_cost_figures():
    prog = _analyzed()
    assert prog.memory["argument"] == 4 * 4 + 3 * 2 * 4  # per device: c and its ws shard
    assert prog.memory["output"] == 16 and prog.temp_bytes > 0
    assert prog.bytes_accessed > 0 and "flops" in prog.cost


def test_table_groups_kind_dtype_and_loop():
    t = program.table(_analyzed().lowered_collectives)
    assert t[("reduce-scatter", "bf16", True)] == {"ops": 1, "bytes": 4}
    assert t[("all-reduce", "f32", False)]["ops"] == 1


def test_saved_residuals_by_name():
    def block(x):
        a = checkpoint_name(jnp.sin(x) * 2.0, "keep_me")
        b = checkpoint_name(jnp.cos(a), "drop_me")
        return jnp.sum(b * b)

    policy = jax.checkpoint_policies.save_only_these_names("keep_me")
    f = jax.checkpoint(block, policy=policy)
    names = program.saved_names(f, jnp.ones((5,)))
    assert names == {"keep_me": 1}
    res = program.saved_residuals(f, jnp.ones((5,)))
    assert any(r.name == "keep_me" and r.shape == (5,) and r.dtype == "float32" for r in res)


def test_jaxpr_walk_counts_nested_primitives():
    def f(x):
        return jax.lax.scan(lambda c, _: (jax.nn.sigmoid(c), None), x, None, length=2)[0]

    counts = program.primitive_counts(jax.make_jaxpr(f)(jnp.ones(3)))
    assert counts["logistic"] == 1 and counts["scan"] == 1


MEMORY_USAGE_REPORT = """Memory Space: vmem (color=1)
Total bytes: 67108864 (64.00MiB)
  cumulative_size;       size;       offset; used_by_n_values; shapes_list
Memory Space: default (color=0)
Total bytes: 97050166368 (90.38GiB)
  cumulative_size;       size;       offset; used_by_n_values; shapes_list
    4.00GiB(  1%);    4.00GiB;  83156582400;                4; bf16[256,4096,2048]
"""


def test_the_default_memory_space_is_read_from_the_usage_report():
    """The default space's total, not the first space's (here VMEM) nor a table row; None without one."""
    from hybridmoe.analysis.program import default_space_bytes

    assert default_space_bytes(MEMORY_USAGE_REPORT) == 97050166368
    assert default_space_bytes(MEMORY_USAGE_REPORT.replace("default (color=0)", "color_6 (color=6)")) is None
    assert default_space_bytes("") is None


BUFFER_ASSIGNMENT = """\
allocation 0: size 4096, parameter 0, shape |f32[1024]| at ShapeIndex {}:
 value: <3 p0 @0> (size=4096,offset=0): f32[1024]{0}
allocation 1: size 512, parameter 1, shape |f32[128]| at ShapeIndex {}, color 1:
 value: <4 p1 @0> (size=512,offset=0): f32[128]{0}
allocation 2: size 2048, parameter 2, output shape is |f32[512]|, maybe-live-out:
 value: <5 p2 @0> (size=2048,offset=0): f32[512]{0}
allocation 3: size 1024, output shape is |f32[256]|, maybe-live-out:
allocation 4: size 8192, preallocated-temp:
allocation 5: size 64, constant:
"""


def test_the_arguments_are_the_parameter_allocations_in_the_default_space():
    """4096 + 2048 bytes (parameter 2 is reused by the output, still an argument); the parameter in
    the on-chip space (color 1), the output, the temporaries and the constant are not arguments."""
    assert program.argument_bytes(BUFFER_ASSIGNMENT) == 4096 + 2048
    assert program.value_storage(BUFFER_ASSIGNMENT) == {("p0", "{}"): ("argument", 4096), ("p1", "{}"): ("on-chip", 512),
                                                        ("p2", "{}"): ("argument", 2048)}
