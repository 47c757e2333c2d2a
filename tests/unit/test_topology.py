"""Topology: the agent's [node] keys, the batch field, the controller's [topology] merge."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metalguard.agent.config import parse_config as parse_agent_config
from metalguard.agent.oneshot import collect_once
from metalguard.controller.config import ConfigError
from metalguard.controller.config import parse_config as parse_controller_config
from metalguard.controller.core.topology import (
    FIELDS,
    ClusterTopology,
    RackOverride,
    TopologyOverride,
    TopologySection,
    TopologyView,
    resolve,
)
from metalguard.demo.sim.fleet import SimFleet, agent_config_text, sim_topology
from metalguard.demo.sim.tree import NodeSpec, write_tree
from metalguard.proto.base import NodeIdentity
from metalguard.proto.codec import decode, encode
from metalguard.proto.nodes import NodeRecord
from metalguard.proto.telemetry import TelemetryBatch
from metalguard.proto.topology import NodeTopology

NODE = NodeIdentity(region="r1", cluster="c1", node="n7")
REPORTED = NodeTopology(zone="z9", rack="k1", leaf="k1-l1", gpus=8, gpu_type="h100", cpu_cores=64)


def test_agent_node_keys_make_the_topology_and_the_batch_carries_it() -> None:
    config = parse_agent_config(
        '[node]\nregion = "r1"\ncluster = "c1"\nname = "n7"\nzone = "z1"\nrack = "k3"\n'
        'leaf = "k3-l2"\ngpus = 8\ngpu_type = "h100"\ncpu_cores = 96\nmemory_gb = 1024\n'
        "bandwidth_tier = 2\n"
    )
    topo = config.node.topology()
    assert topo == NodeTopology(
        zone="z1", rack="k3", leaf="k3-l2", gpus=8, gpu_type="h100",
        cpu_cores=96, memory_gb=1024, bandwidth_tier=2,
    )  # fmt: skip
    assert parse_agent_config('[node]\nname = "x"\n').node.topology() is None
    with pytest.raises(ValueError, match=r"node\.gpus: Expected `int` >= 0"):
        parse_agent_config("[node]\ngpus = -1\n", "agent.toml")


async def test_collect_once_sends_the_topology() -> None:
    config = parse_agent_config(
        '[node]\nname = "n7"\nrack = "k3"\ngpus = 4\n[collect]\nenabled = []\n'
    )
    batch = await collect_once(config, [])
    assert batch.topology == NodeTopology(rack="k3", gpus=4)
    again = decode(encode(batch), TelemetryBatch)
    assert again.topology == batch.topology
    bare = msgspec.structs.replace(batch, topology=None)
    assert decode(encode(bare), TelemetryBatch).topology is None


def test_controller_topology_section_and_its_errors() -> None:
    config = parse_controller_config(
        'region = "r1"\n[topology]\ngpu_type = "h100"\n'
        '[topology.clusters.c1]\nzone = "z1"\n'
        "[topology.clusters.c1.racks.k1]\nbandwidth_tier = 3\n"
        '[topology.clusters.c1.nodes.n7]\nrack = "k1"\ngpus = 4\n'
    )
    assert config.topology.gpu_type == "h100"
    assert config.topology.clusters["c1"].racks["k1"].bandwidth_tier == 3
    assert parse_controller_config('region = "r1"\n').topology == TopologySection()
    with pytest.raises(
        ConfigError, match=r"^c\.toml: topology\.clusters\[\.\.\.\]\.gpus: Expected `int` >= 0"
    ):
        parse_controller_config('region = "r1"\n[topology.clusters.c1]\ngpus = -2\n', "c.toml")
    with pytest.raises(
        ConfigError,
        match=r"^c\.toml: topology\.clusters\[\.\.\.\]\.racks\[\.\.\.\]\.leef: unknown key",
    ):
        parse_controller_config(
            'region = "r1"\n[topology.clusters.c1.racks.k1]\nleef = "x"\n', "c.toml"
        )


def test_resolve_layers_in_order() -> None:
    config = TopologySection(
        gpu_type="a100",
        clusters={
            "c1": ClusterTopology(
                zone="z1",
                gpu_type="h100",
                racks={
                    "k1": RackOverride(leaf="k1-spine", bandwidth_tier=3),
                    "k2": RackOverride(gpus=2),
                },
                nodes={"n7": TopologyOverride(rack="k2", cpu_cores=8)},
            )
        },
    )
    assert resolve(NODE, None, TopologySection()) == NodeTopology()
    assert resolve(NODE, REPORTED, TopologySection()) == REPORTED
    got = resolve(NODE, REPORTED, config)
    assert got.zone == "z1", "the cluster's zone beats the report"
    assert got.gpu_type == "h100", "the cluster table beats the region table"
    assert got.rack == "k2", "the node table moves it to rack k2 ..."
    assert (got.gpus, got.leaf) == (2, "k1-l1"), "... so k2's table applies, not k1's"
    assert got.cpu_cores == 8
    assert got.memory_gb == 0
    other = resolve(NodeIdentity(region="r1", cluster="c2", node="n7"), REPORTED, config)
    assert other == msgspec.structs.replace(REPORTED, gpu_type="a100")


rack_overrides = st.builds(
    RackOverride,
    zone=st.none() | st.sampled_from(["z1", "z2"]),
    gpus=st.none() | st.integers(0, 8),
    bandwidth_tier=st.none() | st.integers(0, 3),
)
overrides = st.builds(
    TopologyOverride,
    zone=st.none() | st.sampled_from(["z1", "z2"]),
    rack=st.none() | st.sampled_from(["k1", "k2"]),
    gpus=st.none() | st.integers(0, 8),
    bandwidth_tier=st.none() | st.integers(0, 3),
)


@settings(max_examples=100, deadline=None)
@given(
    overrides, overrides, st.dictionaries(st.sampled_from(["k1", "k2"]), rack_overrides), overrides
)
def test_resolve_the_most_specific_table_wins(
    region: TopologyOverride,
    cluster: TopologyOverride,
    racks: dict[str, RackOverride],
    node: TopologyOverride,
) -> None:
    fields = {f: getattr(cluster, f) for f in FIELDS}
    config = TopologySection(
        **{f: getattr(region, f) for f in FIELDS},
        clusters={"c1": ClusterTopology(**fields, racks=racks, nodes={"n7": node})},
    )
    got = resolve(NODE, REPORTED, config)
    rack_table = racks.get(got.rack)
    for f in FIELDS:
        layers = [getattr(t, f, None) for t in (region, cluster, rack_table, node) if t is not None]
        forced = [v for v in layers if v is not None]
        assert getattr(got, f) == (forced[-1] if forced else getattr(REPORTED, f)), f


def test_view_keeps_reports_and_builds_the_schedulers_nodes() -> None:
    config = TopologySection(clusters={"c1": ClusterTopology(zone="z1")})
    view = TopologyView(config)
    batch = TelemetryBatch(node=NODE, seq=1, ts=1.0, topology=REPORTED)
    view.observe("r1.c1.n7", batch)
    view.observe("r1.c1.n7", msgspec.structs.replace(batch, seq=2, topology=None))
    assert view.reported("r1.c1.n7") == REPORTED, "a batch without topology keeps the last one"
    records = {
        "r1.c1.n7": NodeRecord(node=NODE, grade="HEALTHY"),
        "r1.c1.n8": NodeRecord(
            node=NodeIdentity(region="r1", cluster="c1", node="n8"), rack="k5", cordoned=True
        ),
    }
    n7, n8 = view.fleet(records)
    assert (n7.zone, n7.rack, n7.leaf, n7.gpus, n7.cpu_cores, n7.schedulable) == (
        "z1",
        "k1",
        "k1-l1",
        8,
        64,
        True,
    )
    assert (n8.zone, n8.rack, n8.gpus, n8.schedulable) == ("z1", "k5", 0, False), (
        "unreported: config and record"
    )


def test_sim_fleet_topology(tmp_path: Path) -> None:
    assert sim_topology(1, 2, 4, 8).leaf == "k2-l1"
    assert sim_topology(1, 2, 5, 8).leaf == "k2-l2", "a leaf per half rack"
    assert sim_topology(1, 2, 5, 4).leaf == "k2-l1", "small racks: one leaf"
    assert [sim_topology(c, 1, 1, 8).zone for c in (1, 2, 3)] == ["z1", "z1", "z2"]
    fleet = SimFleet(tmp_path, "nats://127.0.0.1:1", clusters=2, racks=2, nodes_per_rack=8)
    topo = fleet.topology["r1c2k1n8"]
    assert (topo.zone, topo.rack, topo.leaf, topo.gpus, topo.gpu_type) == (
        "z1",
        "k1",
        "k1-l2",
        8,
        "h100",
    )
    assert len(fleet.topology) == len(fleet.node_names) == 32
    tree = write_tree(tmp_path / "n", NodeSpec(gpus=4), 1)
    text = agent_config_text(
        name="r1c2k1n8", region="r1", cluster="c2", tree=tree, spool_dir=tmp_path / "spool",
        nats_url="nats://127.0.0.1:1", prefix="mg", interval_s=1.0,
        topology=sim_topology(2, 1, 8, 8, gpus=4),
    )  # fmt: skip
    assert parse_agent_config(text).node.topology() == sim_topology(2, 1, 8, 8, gpus=4)
    small = SimFleet(
        tmp_path, "nats://127.0.0.1:1", racks=1, nodes_per_rack=2, spec=NodeSpec(gpus=2)
    )
    assert {t.gpus for t in small.topology.values()} == {2}, "the tree's GPU count"
