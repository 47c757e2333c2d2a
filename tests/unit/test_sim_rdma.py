"""The simulated RDMA devices and their faults, read back by the real rdma collector and
judged by the real scoring rules and DCQCN check."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from metalguard.agent.batch import build_batch
from metalguard.agent.collection import Collection
from metalguard.agent.collectors.base import CollectorSettings
from metalguard.agent.config import parse_config
from metalguard.agent.qos.dcqcn_check import check_port
from metalguard.controller.core.scoring.engine import assess
from metalguard.controller.core.scoring.signals import NodeSignals
from metalguard.demo.sim.faults import (
    DEFAULT_FLAPS,
    CounterGrowth,
    FaultError,
    LinkFlap,
    PortDown,
    apply_fault,
)
from metalguard.demo.sim.fleet import SimFleet, is_infiniband, sim_topology, topology_toml
from metalguard.demo.sim.scenario import load_scenario
from metalguard.demo.sim.traffic import Traffic
from metalguard.demo.sim.tree import (
    HW_COUNTERS_IB,
    HW_COUNTERS_ROCE,
    RDMA_DATA_COUNTERS,
    RDMA_FLAT_COUNTERS,
    NodeSpec,
    NodeTree,
    rdma_port_names,
    write_tree,
)
from metalguard.proto.base import NodeIdentity
from metalguard.proto.telemetry import RdmaPort, TelemetryBatch
from metalguard.proto.topology import NodeTopology

NODE = NodeIdentity(region="r1", cluster="c1", node="r1c1k1n1", uuid="sim-r1c1k1n1")
TOPOLOGY = sim_topology(1, 1, 1, 8, rdma_ports=rdma_port_names(NodeSpec()))
PORT0 = "mlx5_0/1"
DEFAULT_SCENARIO = Path(__file__).parents[2] / "scenarios" / "default.toml"


async def collect(tree: NodeTree, seq: int = 1, ts: float = 1000.0) -> TelemetryBatch:
    """One batch of the real rdma collector over ``tree``, with the node's topology."""
    collection = Collection(["rdma"], CollectorSettings(sysfs=tree.sysfs), base_interval_s=1.0)
    try:
        cycle = await collection.run_cycle(force=True)
    finally:
        await collection.close()
    assert cycle.errors == ()
    return build_batch(NODE, seq, cycle, ts=ts, topology=TOPOLOGY)


def ports(batch: TelemetryBatch) -> dict[str, RdmaPort]:
    return {f"{p.device}/{p.port}": p for p in batch.rdma}


def counter(tree: NodeTree, port: str, name: str, folder: str = "counters") -> int:
    return int(tree.sys_path(f"{port}/{folder}/{name}").read_text())


def rules(batch: TelemetryBatch, signals: NodeSignals | None) -> tuple[NodeSignals, dict[str, str]]:
    signals, assessment = assess(signals, batch)
    return signals, {f.reason.rule: f.severity for f in assessment.findings}


@pytest.fixture
def ib(tmp_path: Path) -> NodeTree:
    return write_tree(tmp_path / "ib", NodeSpec(), seed=7)


@pytest.fixture
def roce(tmp_path: Path) -> NodeTree:
    return write_tree(tmp_path / "roce", NodeSpec(infiniband=False), seed=7)


async def test_healthy_infiniband_ports_read_as_the_kernel_shows_them(ib: NodeTree) -> None:
    batch = await collect(ib)
    assert sorted(ports(batch)) == ["mlx5_0/1", "mlx5_1/1"]
    for name, port in ports(batch).items():
        assert (port.state, port.state_id, port.phys_state, port.phys_state_id) == (
            "ACTIVE",
            4,
            "LinkUp",
            5,
        )
        assert port.rate_gbps == 400.0
        assert port.link_layer == "InfiniBand"
        assert (port.hca_type, port.board_id, port.fw_ver) == (
            "MT4129",
            "MT_0000000838",
            "28.39.1002",
        )
        assert port.netdev == {"mlx5_0/1": "ibp48s0", "mlx5_1/1": "ibp49s0"}[name]
        assert set(port.counters) == {*RDMA_DATA_COUNTERS, *RDMA_FLAT_COUNTERS}
        assert all(port.counters[c] == 0 for c in RDMA_FLAT_COUNTERS)
        assert all(port.counters[c] > 0 for c in RDMA_DATA_COUNTERS)
        assert set(port.hw_counters) == set(HW_COUNTERS_IB)
        assert port.tx_bytes == 4 * port.counters["port_xmit_data"]
        assert port.saturated == ()
    _, found = rules(batch, None)
    assert not [r for r in found if r.startswith("rdma")]


async def test_healthy_roce_ports_have_dcqcn_counters_and_their_netdev(roce: NodeTree) -> None:
    port = ports(await collect(roce))[PORT0]
    assert port.link_layer == "Ethernet"
    assert port.netdev == "enp48s0np0"
    assert set(port.hw_counters) == set(HW_COUNTERS_ROCE)
    assert {"np_ecn_marked_roce_packets", "np_cnp_sent", "rp_cnp_handled"} <= set(port.hw_counters)
    assert (roce.sysfs / "class/net/enp48s0np0/type").read_text() == "1\n"


def test_rdma_links_are_relative_like_sysfs(ib: NodeTree) -> None:
    entry = ib.sysfs / "class/infiniband/mlx5_0"
    assert os.readlink(entry) == (
        "../../devices/pci0000:00/0000:00:10.0/0000:30:00.0/infiniband/mlx5_0"
    )
    assert os.readlink(entry / "device") == "../../../0000:30:00.0"
    assert (entry / "device").resolve() == (ib.sysfs / "bus/pci/devices/0000:30:00.0").resolve()
    assert (entry / "device/net/ibp48s0/dev_port").read_text() == "0\n"
    assert (ib.sysfs / "class/net/ibp48s0").resolve() == (entry / "device/net/ibp48s0").resolve()
    assert not (entry / "ports/1/gid_attrs").exists()  # an IB port's GIDs name no netdev


def test_no_rdma_devices_when_the_spec_has_none(tmp_path: Path) -> None:
    tree = write_tree(tmp_path / "n", NodeSpec(rdma=False), seed=1)
    assert tree.paths.rdma_ports == ()
    assert not (tree.sysfs / "class/infiniband").exists()
    assert rdma_port_names(NodeSpec(rdma=False)) == ()
    with pytest.raises(FaultError, match="no active RDMA port"):
        apply_fault(tree, "rdma_port_down", random.Random(1))


async def test_port_down_is_a_failing_port_with_its_name_in_the_reason(ib: NodeTree) -> None:
    signals, _ = rules(await collect(ib, 1, 1000.0), None)
    applied = apply_fault(ib, "rdma_port_down", random.Random(1))
    assert applied.process is None  # down for good
    after = ports(await collect(ib, 2, 1001.0))
    down = [p for p in after.values() if p.state != "ACTIVE"]
    assert len(down) == 1
    port = down[0]
    assert (port.state, port.state_id, port.phys_state, port.phys_state_id) == (
        "DOWN",
        1,
        "Disabled",
        3,
    )
    assert port.counters["link_downed"] == 1
    assert f"{port.device}/{port.port}" in applied.detail
    _, assessment = assess(signals, await collect(ib, 3, 1002.0))
    fatal = [f for f in assessment.findings if f.severity == "fatal"]
    assert fatal
    assert all(f"{port.device}/{port.port}" in f.reason.message for f in fatal)
    assert {f.reason.rule for f in fatal} <= {"rdma_port_down", "rdma_cabled_port_down"}


async def test_port_down_for_a_while_comes_back(ib: NodeTree) -> None:
    applied = apply_fault(ib, "rdma_port_down", random.Random(1), duration_s=5, now=100.0)
    back = applied.process
    assert isinstance(back, PortDown)
    assert back.step(104.0) is False
    assert [p.state for p in ports(await collect(ib)).values()].count("DOWN") == 1
    assert back.step(105.0) is True
    assert {(p.state, p.phys_state) for p in ports(await collect(ib)).values()} == {
        ("ACTIVE", "LinkUp")
    }
    first = apply_fault(ib, "rdma_port_down", random.Random(1)).detail
    second = apply_fault(ib, "rdma_port_down", random.Random(1)).detail
    assert first != second  # only a port still up is picked
    with pytest.raises(FaultError, match="no active RDMA port"):
        apply_fault(ib, "rdma_port_down", random.Random(1))


async def test_link_flap_counts_downs_and_ends_active_and_sub_healthy(ib: NodeTree) -> None:
    signals, _ = rules(await collect(ib, 1, 1000.0), None)
    applied = apply_fault(ib, "rdma_link_flap", random.Random(1))
    flap = applied.process
    assert isinstance(flap, LinkFlap)
    assert flap.flaps == 1  # the first flap on applying
    seq = 2
    while not flap.step(float(seq)):
        seq += 1
    assert flap.flaps == DEFAULT_FLAPS
    assert flap.step(99.0) is True  # over: no more flaps
    after = ports(await collect(ib, seq, 1000.0 + seq))
    port = after[port_of(flap.port)]
    assert (port.state, port.phys_state) == ("ACTIVE", "LinkUp")  # a flap comes back
    assert port.counters["link_downed"] == DEFAULT_FLAPS
    assert port.counters["link_error_recovery"] == DEFAULT_FLAPS
    other = next(p for name, p in after.items() if name != port_of(flap.port))
    assert other.counters["link_downed"] == 0
    _, found = rules(await collect(ib, seq + 1, 1001.0 + seq), signals)
    assert found.get("rdma_link_flap_rate") == "severe"
    assert "fatal" not in found.values()


def port_of(port_dir: str) -> str:
    parts = port_dir.split("/")
    return f"{parts[-3]}/{parts[-1]}"


async def test_symbol_errors_grow_every_tick_then_stop(ib: NodeTree) -> None:
    signals, _ = rules(await collect(ib, 1, 1000.0), None)
    growth = apply_fault(ib, "rdma_symbol_errors", random.Random(1), duration_s=10, now=0.0)
    errors = growth.process
    assert isinstance(errors, CounterGrowth)
    for tick in range(1, 10):
        assert errors.step(float(tick)) is False
    assert errors.step(10.0) is True
    assert counter(ib, errors.port, "symbol_error") == 100
    assert counter(ib, errors.port, "port_rcv_errors") == 50
    assert counter(ib, errors.port, "link_downed") == 0
    _, found = rules(await collect(ib, 2, 1010.0), signals)
    assert found.get("rdma_phys_error_rate") == "severe"
    assert "fatal" not in found.values()


def test_pma_counters_stop_at_their_width(ib: NodeTree) -> None:
    growth = apply_fault(
        ib, "rdma_symbol_errors", random.Random(1), count=40_000, duration_s=5, now=0.0
    )
    assert isinstance(growth.process, CounterGrowth)
    growth.process.step(1.0)
    growth.process.step(2.0)
    port = growth.process.port
    assert counter(ib, port, "symbol_error") == 0xFFFF  # 16 bits: stopped, not wrapped
    assert counter(ib, port, "port_rcv_errors") == 60_000
    flap = apply_fault(ib, "rdma_link_flap", random.Random(1), count=300).process
    assert isinstance(flap, LinkFlap)
    while not flap.step(0.0):
        pass
    assert counter(ib, flap.port, "link_downed") == 0xFF  # 8 bits


async def test_dcqcn_no_cnp_marks_without_cnps_and_leaves_the_grade(roce: NodeTree) -> None:
    before = await collect(roce, 1, 1000.0)
    signals, _ = rules(before, None)
    growth = apply_fault(roce, "dcqcn_no_cnp", random.Random(1), now=0.0).process
    assert isinstance(growth, CounterGrowth)
    growth.step(1.0)
    after = await collect(roce, 2, 1002.0)
    name = port_of(growth.port)
    old, new = ports(before)[name], ports(after)[name]
    assert new.hw_counters["np_ecn_marked_roce_packets"] == 1000
    assert new.hw_counters["np_cnp_sent"] == old.hw_counters["np_cnp_sent"] == 0
    check = check_port(old, new)
    assert [f.condition for f in check.problems] == ["np_no_cnp"]
    _, found = rules(after, signals)
    assert not [r for r in found if r.startswith("rdma")]  # a QoS status, not a node fault


def test_dcqcn_no_cnp_needs_a_roce_port(ib: NodeTree) -> None:
    with pytest.raises(FaultError, match="no active RoCE port"):
        apply_fault(ib, "dcqcn_no_cnp", random.Random(1))


def test_traffic_moves_data_counters_of_active_ports_only(ib: NodeTree) -> None:
    traffic = Traffic.of(ib, random.Random(3))
    traffic.advance(10.0)
    assert traffic.writes == 0  # the first call only sets the time
    apply_fault(ib, "rdma_port_down", random.Random(0))  # one of the two
    down = next(p for p in ib.paths.rdma_ports if "DOWN" in (ib.sys_path(p) / "state").read_text())
    up = next(p for p in ib.paths.rdma_ports if p != down)
    start = {p: {c: counter(ib, p, c) for c in RDMA_DATA_COUNTERS} for p in (up, down)}
    traffic.advance(15.0)
    grown = {c: counter(ib, up, c) - start[up][c] for c in RDMA_DATA_COUNTERS}
    assert 5 * 40_000 <= grown["port_xmit_data"] <= 5 * 80_000
    assert all(n > 0 for n in grown.values())
    assert {c: counter(ib, down, c) for c in RDMA_DATA_COUNTERS} == start[down]
    assert all(counter(ib, up, c) == 0 for c in RDMA_FLAT_COUNTERS)
    assert traffic.writes == len(RDMA_DATA_COUNTERS)
    assert not [p.name for p in ib.sys_path(f"{up}/counters").iterdir() if p.name.startswith(".")]


def test_topology_declares_the_cabled_ports_and_rate() -> None:
    text = '[node]\nname = "n"\n' + topology_toml(TOPOLOGY)
    topology = parse_config(text, "agent.toml").node.topology()
    assert topology == TOPOLOGY
    assert topology is not None
    assert topology.rdma_ports == ("mlx5_0/1", "mlx5_1/1")
    assert topology.rdma_rate_gbps == 400.0
    bare = sim_topology(1, 1, 1, 8)
    assert (bare.rdma_ports, bare.rdma_rate_gbps) == ((), 0.0)
    assert NodeTopology().rdma_ports == ()


def test_fleet_mixes_infiniband_and_roce_racks_and_moves_traffic(tmp_path: Path) -> None:
    now = [100.0]
    fleet = SimFleet(
        tmp_path, "nats://127.0.0.1:4222", racks=2, nodes_per_rack=5, clock=lambda: now[0]
    )
    assert [is_infiniband(k) for k in (1, 2, 3, 4)] == [True, False, True, False]
    assert is_infiniband(2, "infiniband")
    assert not is_infiniband(1, "roce")
    fleet.nodes = fleet._build()
    layers = {
        name: (node.tree.sys_path(node.tree.paths.rdma_ports[0]) / "link_layer").read_text()
        for name, node in fleet.nodes.items()
    }
    assert {layers[f"r1c1k1n{i}"] for i in range(1, 6)} == {"InfiniBand\n"}
    assert {layers[f"r1c1k2n{i}"] for i in range(1, 6)} == {"Ethernet\n"}
    config = fleet.nodes["r1c1k2n1"].config
    assert config.collect.enabled is not None
    assert "rdma" in config.collect.enabled
    assert config.collect.intervals["rdma"] == 5.0
    assert config.node.rdma_ports == ("mlx5_0/1", "mlx5_1/1")
    assert config.node.rdma_rate_gbps == 400.0

    def xmit(name: str) -> int:
        tree = fleet.nodes[name].tree
        return counter(tree, tree.paths.rdma_ports[0], "port_xmit_data")

    start = {name: xmit(name) for name in fleet.nodes}
    for _ in range(5):  # every node's first turn: the start of its traffic
        fleet.tick()
        now[0] += 1.0
    assert {name: xmit(name) for name in fleet.nodes} == start
    for _ in range(5):  # each node's second turn, 5 s after its first
        fleet.tick()
        now[0] += 1.0
    moved = {name: xmit(name) - start[name] for name in fleet.nodes}
    assert all(5 * 40_000 <= n <= 5 * 80_000 for n in moved.values()), moved


def test_the_default_scenarios_dcqcn_faults_hit_roce_nodes() -> None:
    scenario = load_scenario(DEFAULT_SCENARIO)
    roce_only = [f for f in scenario.fault if f.kind == "dcqcn_no_cnp"]
    assert roce_only
    for fault in roce_only:
        rack = int(fault.node[fault.node.index("k") + 1 : fault.node.index("n")])
        assert not is_infiniband(rack), fault.node
    rdma = {f.kind: f.expect for f in scenario.fault if f.kind.startswith(("rdma", "dcqcn"))}
    assert rdma == {
        "rdma_port_down": "FAILING",
        "rdma_link_flap": "SUB_HEALTHY",
        "rdma_symbol_errors": "SUB_HEALTHY",
        "dcqcn_no_cnp": "HEALTHY",
    }
