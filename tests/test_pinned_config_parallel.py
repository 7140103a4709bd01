"""Start-up and target checks pinned with fakes: joining the distributed runtime (parallel/host.py),
the host helpers at one and several processes, the load-balanced halves' even-length rule
(parallel/context.py), inspect's targets and their HBM (tools/train_program.py), and the overrides a
target adds to inspect's config (cli.py). No program is compiled."""

from types import SimpleNamespace

import jax
import numpy as np
import pytest

from hybridmoe.config import schema as s
from hybridmoe.parallel import context, host
from hybridmoe.tools import train_program as tp


def _joined(monkeypatch, **mesh):
    calls = {"config": [], "init": []}
    monkeypatch.setattr(jax.config, "update", lambda k, v: calls["config"].append((k, v)))
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls["init"].append(kw))
    host.initialize_distributed(s.MeshConfig(distributed=True, **mesh))
    return calls


def test_a_distributed_run_with_a_coordinator_passes_it_with_the_process_count_and_index(monkeypatch):
    calls = _joined(monkeypatch, coordinator_address="127.0.0.1:99", num_processes=3, process_id=2)
    assert calls == {"config": [], "init": [{"coordinator_address": "127.0.0.1:99", "num_processes": 3,
                                             "process_id": 2}]}


def test_a_distributed_run_without_a_coordinator_finds_the_cluster_and_simulated_devices_use_gloo(monkeypatch):
    calls = _joined(monkeypatch, cpu_devices=4, num_processes=2, process_id=1)
    assert calls == {"config": [("jax_cpu_collectives_implementation", "gloo")], "init": [{}]}


def test_hosts_sync_and_gather_only_when_there_are_several(monkeypatch):
    from jax.experimental import multihost_utils
    synced, gathered = [], []
    monkeypatch.setattr(multihost_utils, "sync_global_devices", synced.append)
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda t, tiled: gathered.append(tiled) or "all")
    monkeypatch.setattr(jax, "process_count", lambda: 1)
    host.sync_hosts("a")
    assert synced == [] and host.fetch_global({"x": np.ones(2)})["x"].tolist() == [1.0, 1.0] and gathered == []
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    host.sync_hosts("b")
    assert synced == ["b"] and host.fetch_global({"x": 1}) == "all" and gathered == [True]


def test_global_arrays_take_one_sharding_for_every_leaf():
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    out = host.put_global({"a": np.arange(3), "b": np.ones((2, 2))}, sharding)
    assert out["a"].tolist() == [0, 1, 2] and out["b"].shape == (2, 2) and out["a"].sharding == sharding


def test_load_balancing_refuses_an_odd_shard_and_splits_an_even_one():
    with pytest.raises(ValueError, match="load balancing needs an even shard length; got 3 tokens per rank"):
        context._halves(np.zeros((1, 3)), 1)
    with pytest.raises(ValueError, match="got 1 tokens per rank"):
        context._halves(np.zeros((2, 1, 4)), 1)
    a, b = context._halves(np.arange(4).reshape(1, 4), 1)
    assert a.tolist() == [[0, 1]] and b.tolist() == [[2, 3]]


def test_rank_query_runs_at_three_ranks():
    """t = 6 tokens a rank of S = 18: load-balanced rank 0 holds half-chunks 0 and 5 ((0, 3), (15, 3));
    natural order, the last rank's 6 from 12."""
    assert context.rank_query_runs(6, 18, True) == ((0, 3), (15, 3))
    assert context.rank_query_runs(6, 18, False) == ((12, 6),)


def test_load_balanced_token_index_at_three_ranks():
    """T = 12, P = 3: half-chunks of 2; rank 0 holds 0 and 5, rank 1 holds 1 and 4, rank 2 holds 2 and 3."""
    assert context.load_balanced_token_index(12, 3).tolist() == [0, 1, 10, 11, 2, 3, 8, 9, 4, 5, 6, 7]


# ------------------------------------------------------------------------------------------------
# inspect's targets


@pytest.mark.parametrize("name", ["cpu:", "cpu:x", "cpu:-1", "cpu:0", "v5e", "v9:2x2", "v5e:2x", "v5e:2x2 ",
                                  "gpu:4", "v5e:2x2/", "cpu"])
def test_a_malformed_target_is_refused(name):
    with pytest.raises(ValueError, match=f"target {name!r}"):
        tp.parse_target(name)


@pytest.mark.parametrize("name", ["v4:2x2x1", "v5e:2x2", "v5p:2x2x1", "v6e:4x4", "tpu7x:2x2x1", "v5e:16"])
def test_each_tpu_generation_is_a_target(name):
    assert tp.parse_target(name) == ("tpu", None)


def test_a_tpu_target_names_the_generations_it_knows():
    with pytest.raises(ValueError, match="GEN one of tpu7x, v4, v5e, v5p, v6e"):
        tp.parse_target("v3:2x2")


def _fake_topology(monkeypatch, devices):
    import importlib.util

    from jax.experimental import topologies
    monkeypatch.setattr(importlib.util, "find_spec", lambda n: object() if n == "libtpu" else None)
    monkeypatch.setattr(topologies, "get_topology_desc", lambda n, platform: SimpleNamespace(devices=[0] * devices))


@pytest.mark.parametrize("name,devices,want_gib", [("v4:2x2x1", 4, 32), ("v4:2x2x2", 16, 16), ("v5e:2x2", 2, 16)])
def test_the_hbm_of_each_generation_per_device(monkeypatch, name, devices, want_gib):
    """v4: 32 GiB a chip, one device each (4 on 2x2x1); 16 devices on 8 chips: 2 a chip, 16 GiB each;
    fewer devices than chips (2 on 4): a device has its chip's whole 16 GiB."""
    _fake_topology(monkeypatch, devices)
    assert tp.tpu_target(name).hbm_bytes_per_device == want_gib * 2**30


def test_a_tpu_target_needs_libtpu_and_names_a_topology_the_compiler_refuses(monkeypatch):
    import importlib.util

    from jax.experimental import topologies
    monkeypatch.setattr(importlib.util, "find_spec", lambda n: None)
    with pytest.raises(RuntimeError, match="target 'v5e:2x2' needs libtpu on this host"):
        tp.tpu_target("v5e:2x2")
    monkeypatch.setattr(importlib.util, "find_spec", lambda n: object())

    def refuse(n, platform):
        raise jax.errors.JaxRuntimeError("INVALID_ARGUMENT: bad shape 3x3\nmore")
    monkeypatch.setattr(topologies, "get_topology_desc", refuse)
    with pytest.raises(ValueError, match=r"target 'v5e:3x3': the TPU compiler refuses this topology \(bad shape 3x3\)"):
        tp.tpu_target("v5e:3x3")


def test_the_host_target_is_named_by_platform_and_count_with_no_hbm_figure():
    t = tp.host_target()
    n = len(jax.devices())
    assert (t.name, t.platform, t.num_devices, t.hbm_bytes_per_device) == (f"cpu:{n}", "cpu", n, None)


def test_inspect_adds_the_targets_device_count_last_and_checks_a_tpu_target_for_tpu(monkeypatch):
    from hybridmoe import cli
    seen = []
    monkeypatch.setattr(cli, "load_config", lambda recipe, overrides, platform: seen.append(
        (recipe, overrides, platform)) or "cfg")
    words = ["recipe=small", "mesh.cpu_devices=2"]
    assert cli._inspect_config(words, "cpu", 8) == ("small", ["mesh.cpu_devices=2", "mesh.cpu_devices=8"], "cfg")
    assert cli._inspect_config(words, "tpu", None) == ("small", ["mesh.cpu_devices=2", "mesh.cpu_devices=0"], "cfg")
    assert cli._inspect_config(words, None, None) == ("small", ["mesh.cpu_devices=2"], "cfg")
    assert [p for _, _, p in seen] == [None, "tpu", None]


@pytest.mark.parametrize("argv, needle", [
    (["launch", "--processes", "2", "--", "describe"], "launch runs a command in N processes"),
    (["launch", "--processes", "2", "--", "launch", "train"], "launch runs a command in N processes"),
    (["launch", "--processes", "0", "--", "train"], "--processes 0: at least 1"),
    (["launch", "--processes", "-1", "--", "rl"], "--processes -1: at least 1"),
])
def test_launch_refuses_a_command_it_cannot_spread_and_a_count_below_one(argv, needle, capsys):
    from hybridmoe.cli import main
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_launch_hands_the_command_after_the_separator_with_the_count_and_port(monkeypatch):
    from hybridmoe.cli import main
    from hybridmoe.parallel import launch
    seen = []
    monkeypatch.setattr(launch, "launch", lambda argv, n, port: seen.append((argv, n, port)) or 0)
    assert main(["launch", "--processes", "1", "--port", "77", "--", "train", "recipe=tiny"]) == 0
    assert main(["launch", "--processes", "3", "score", "--hf", "d"]) == 0
    assert seen == [(["train", "recipe=tiny"], 1, 77), (["score", "--hf", "d"], 3, 0)]


def test_the_context_size_over_several_axes_is_their_product():
    from hybridmoe.parallel.mesh import MESH_AXES
    mesh = jax.sharding.AbstractMesh((1, 2, 3, 4, 1), MESH_AXES)
    with jax.sharding.use_abstract_mesh(mesh):
        assert context.context_size(("context", "expert")) == 12 and context.context_size(("fsdp", "context")) == 6
        assert context.context_size(()) == 1
