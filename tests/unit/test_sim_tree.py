"""Generated sysfs trees and faults, read back by the real collectors."""

from __future__ import annotations

import itertools
import os
import random
from pathlib import Path

import pytest

from metalguard.agent.batch import build_batch
from metalguard.agent.collection import Collection
from metalguard.agent.collectors.base import CollectorSettings
from metalguard.agent.events import detect_events
from metalguard.controller.core.scoring.engine import assess
from metalguard.controller.core.scoring.signals import NodeSignals
from metalguard.demo.sim.faults import (
    KNOWN_KINDS,
    CeStorm,
    FaultError,
    Heat,
    apply_fault,
    write_atomic,
)
from metalguard.demo.sim.tree import GPU_CLASS, NIC_CLASS_IB, NodeSpec, NodeTree, layout, write_tree
from metalguard.proto.base import NodeIdentity
from metalguard.proto.telemetry import (
    HwmonChip,
    PcieDevice,
    SmartDevice,
    TelemetryBatch,
    Temperature,
)

NODE = NodeIdentity(region="r1", cluster="c1", node="r1c1k1n1", uuid="sim-r1c1k1n1")


async def collect(tree: NodeTree, seq: int = 1, ts: float = 1000.0) -> TelemetryBatch:
    """One batch of the real collectors over ``tree``."""
    collection = Collection(
        ["edac", "pcie", "hwmon", "smart"],
        CollectorSettings(sysfs=tree.sysfs, smart_json_dir=tree.smart_dir),
        base_interval_s=1.0,
    )
    try:
        cycle = await collection.run_cycle(force=True)
    finally:
        await collection.close()
    assert cycle.errors == ()
    return build_batch(NODE, seq, cycle, ts=ts)


@pytest.fixture
def tree(tmp_path: Path) -> NodeTree:
    return write_tree(tmp_path / "node", NodeSpec(), seed=7)


def by_class(batch: TelemetryBatch, pci_class: str) -> list[PcieDevice]:
    return [d for d in batch.pcie if d.pci_class == pci_class]


def chip(batch: TelemetryBatch, name: str) -> HwmonChip:
    return next(c for c in batch.hwmon if c.name == name)


def celsius(temps: tuple[Temperature, ...]) -> list[float]:
    values = [t.celsius for t in temps]
    assert all(v is not None for v in values)
    return [v for v in values if v is not None]


def disks(batch: TelemetryBatch) -> list[SmartDevice]:
    return list(batch.smart)


def test_layout_is_deterministic_and_varies_by_seed() -> None:
    assert layout(NodeSpec(), 1) == layout(NodeSpec(), 1)
    assert layout(NodeSpec(), 1).files != layout(NodeSpec(), 2).files
    assert layout(NodeSpec(), 1).links == layout(NodeSpec(), 2).links


def test_links_are_relative_like_sysfs(tree: NodeTree) -> None:
    gpu_link = tree.sysfs / "bus/pci/devices/0000:10:00.0"
    target = os.readlink(gpu_link)
    assert target == "../../../devices/pci0000:00/0000:00:01.0/0000:10:00.0"
    assert os.readlink(tree.sysfs / "class/hwmon/hwmon1") == (
        "../../devices/platform/nct6775.656/hwmon/hwmon1"
    )
    assert gpu_link.resolve().is_dir()


async def test_healthy_tree_reads_as_the_spec(tree: NodeTree) -> None:
    batch = await collect(tree)
    gpus = by_class(batch, GPU_CLASS)
    assert len(gpus) == 8
    assert all(
        g.current_link_speed_gts == g.max_link_speed_gts == 16.0
        and g.current_link_width == g.max_link_width == 16
        and not g.downgraded
        and g.vendor == "0x10de"
        for g in gpus
    )
    nics = by_class(batch, NIC_CLASS_IB)
    assert len(nics) == 2
    assert all(n.aer is not None and n.aer.fatal["TOTAL_ERR_FATAL"] == 0 for n in nics)
    dimms = [d for mc in batch.edac for d in mc.dimms]
    assert len(batch.edac) == 2
    assert len(dimms) == 16
    assert all(d.ce_count == 0 and d.ue_count == 0 for d in dimms)
    assert dimms[0].label == "CPU_SrcID#0_Ha#0_Chan#0_DIMM#0"
    fans = chip(batch, "nct6798").fans
    assert len(fans) == 8
    assert all(f.rpm is not None and 8000 <= f.rpm < 12000 and f.min_rpm == 2000 for f in fans)
    temps = chip(batch, "coretemp").temps
    assert temps
    assert all(
        t.celsius is not None and 40 <= t.celsius <= 50 and t.crit_celsius == 95.0 for t in temps
    )
    assert len(disks(batch)) == 2
    assert all(d.passed and d.critical_warning == 0 for d in disks(batch))
    assert len({d.serial for d in disks(batch)}) == 2


async def test_ecc_ue_counts_and_raises_an_event(tree: NodeTree) -> None:
    before = await collect(tree, 1)
    apply_fault(tree, "ecc_ue", random.Random(1))
    after = await collect(tree, 2)
    hit = [(mc, d) for mc in after.edac for d in mc.dimms if d.ue_count]
    assert len(hit) == 1
    assert hit[0][1].ue_count == 1
    assert hit[0][0].ue_count == 1
    events = detect_events(before, after)
    assert [e.kind for e in events] == ["ecc_uncorrectable"]


async def test_aer_fatal_counts_on_a_nic(tree: NodeTree) -> None:
    before = await collect(tree, 1)
    apply_fault(tree, "aer_fatal", random.Random(1))
    after = await collect(tree, 2)
    fatal = [d for d in by_class(after, NIC_CLASS_IB) if d.aer and d.aer.fatal["TOTAL_ERR_FATAL"]]
    assert len(fatal) == 1
    assert fatal[0].aer is not None
    assert fatal[0].aer.fatal["TOTAL_ERR_FATAL"] == 1
    assert fatal[0].aer.fatal["MalfTLP"] == 1
    assert [e.kind for e in detect_events(before, after)] == ["aer_fatal"]


async def test_pcie_downgrade_marks_a_gpu_downgraded(tree: NodeTree) -> None:
    apply_fault(tree, "pcie_downgrade", random.Random(1))
    batch = await collect(tree)
    down = [g for g in by_class(batch, GPU_CLASS) if g.downgraded]
    assert len(down) == 1
    assert down[0].current_link_width == 8


async def test_smart_fail_fails_one_disk(tree: NodeTree) -> None:
    apply_fault(tree, "smart_fail", random.Random(1))
    batch = await collect(tree)
    assert sorted(d.passed is True for d in disks(batch)) == [False, True]
    failed = next(d for d in disks(batch) if not d.passed)
    assert failed.critical_warning == 4
    assert failed.exit_status == 8


async def test_fan_stop_then_heat_reaches_critical(tree: NodeTree) -> None:
    applied = apply_fault(tree, "fan_stop", random.Random(1))
    assert isinstance(applied.process, Heat)
    first = chip(await collect(tree), "coretemp").temps
    stopped = [f for f in chip(await collect(tree), "nct6798").fans if f.rpm == 0]
    assert len(stopped) == 1
    assert stopped[0].alarm is True
    series = [celsius(first)]
    for tick in range(20):
        if applied.process.step(float(tick)):
            break
        series.append(celsius(chip(await collect(tree), "coretemp").temps))
    else:
        pytest.fail("the heat never reached its ceiling")
    assert all(c >= tree.crit_celsius for c in celsius(chip(await collect(tree), "coretemp").temps))
    assert all(
        a <= b
        for earlier, later in itertools.pairwise(series)
        for a, b in zip(earlier, later, strict=True)
    )


async def test_ce_storm_rate_crosses_the_scoring_threshold(tree: NodeTree) -> None:
    """Ticked once a simulated second, a default storm is scored severe within a minute."""
    applied = apply_fault(tree, "ecc_ce_storm", random.Random(1), now=0.0, duration_s=30)
    storm = applied.process
    assert isinstance(storm, CeStorm)
    signals: NodeSignals | None = None
    ts0 = 1_000_000.0
    first = last = None
    for second in range(0, 40, 5):
        for tick in range(second - 4, second + 1):
            storm.step(float(max(tick, 0)))
        batch = await collect(tree, second + 1, ts=ts0 + second)
        signals, assessment = assess(signals, batch)
        ce = sum(d.ce_count or 0 for mc in batch.edac for d in mc.dimms)
        first = ce if first is None else first
        last = ce
    assert first is not None
    assert last is not None
    rate_per_h = (last - first) * 3600 / 35
    assert rate_per_h > 100
    rules = {f.reason.rule: f.severity for f in assessment.findings}
    assert rules.get("ecc_correctable_rate") == "severe"
    assert storm.step(31.0) is True  # over after duration_s


def test_storm_stops_adding_after_its_duration(tree: NodeTree) -> None:
    storm = apply_fault(
        tree, "ecc_ce_storm", random.Random(1), count=5, duration_s=2, now=0
    ).process
    assert isinstance(storm, CeStorm)
    assert storm.step(1.0) is False
    assert storm.step(2.0) is True
    assert storm.added == 10
    mc_total = sum(int((tree.sys_path(mc) / "ce_count").read_text()) for mc in tree.paths.mcs)
    assert mc_total == 10


def test_unknown_and_runner_kinds_are_refused(tree: NodeTree) -> None:
    with pytest.raises(FaultError, match="known: ecc_ue"):
        apply_fault(tree, "meteor", random.Random(1))
    with pytest.raises(FaultError, match="fleet runner"):
        apply_fault(tree, "agent_kill", random.Random(1))
    assert "agent_kill" in KNOWN_KINDS


def test_missing_device_is_a_fault_error(tmp_path: Path) -> None:
    bare = write_tree(tmp_path / "bare", NodeSpec(gpus=0), seed=1)
    with pytest.raises(FaultError, match="no GPU"):
        apply_fault(bare, "pcie_downgrade", random.Random(1))


def test_write_atomic_leaves_no_temp_file(tmp_path: Path) -> None:
    target = tmp_path / "ce_count"
    target.write_text("0\n")
    write_atomic(target, "5\n")
    assert target.read_text() == "5\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ce_count"]


async def test_bridges_are_listed_when_asked(tmp_path: Path) -> None:
    tree = write_tree(tmp_path / "node", NodeSpec(gpus=2, nics=1, bridges=True), seed=1)
    batch = await collect(tree)
    assert len(by_class(batch, "0x060400")) == 3
    assert len(batch.pcie) == 6


def test_write_tree_replaces_an_earlier_tree(tmp_path: Path) -> None:
    first = write_tree(tmp_path / "node", NodeSpec(), seed=1)
    apply_fault(first, "ecc_ue", random.Random(1))
    (tmp_path / "node" / "spool").mkdir()
    again = write_tree(tmp_path / "node", NodeSpec(), seed=1)
    ue = [int((again.sys_path(d) / "dimm_ue_count").read_text()) for d in again.paths.dimms]
    assert ue == [0] * 16
    assert (tmp_path / "node" / "spool").is_dir()
