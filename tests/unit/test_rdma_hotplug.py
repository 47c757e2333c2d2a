"""The rdma collector follows hotplug: an ``infiniband`` uevent makes the agent's
collection run it at once (``refresh_for`` + ``Collection.expedite``), so a hot-unplugged
device leaves no stale port in the readings (the agent end to end:
tests/integration/test_rdma_hotplug_agent.py)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

from metalguard.agent.collection import Collection
from metalguard.agent.collectors.base import BatchField, Collected, CollectorSettings
from metalguard.agent.collectors.udev import REFRESH, refresh_for, uevent_event
from metalguard.proto.base import NodeIdentity
from metalguard.proto.events import NodeEvent
from metalguard.proto.telemetry import RdmaPort
from tests.support.clock import ManualClock
from tests.support.rdma_trees import ROCE, write_device

NODE = NodeIdentity(region="r1", cluster="c1", node="n1")
DEVPATH = "/devices/pci0000:00/0000:3c:00.0/infiniband/mlx5_1"
HOUR = 3600.0


def _uevent(action: str, subsystem: str = "infiniband") -> NodeEvent:
    props = {"ACTION": action, "SUBSYSTEM": subsystem, "DEVPATH": DEVPATH, "SEQNUM": "7"}
    event = uevent_event(props, node=NODE, ts=1.0, event_id="e1")
    assert event is not None
    return event


def test_infiniband_uevents_refresh_the_rdma_collector() -> None:
    assert REFRESH["infiniband"] == ("rdma",)
    for action in ("add", "remove", "change", "bind", "unbind"):
        assert refresh_for(_uevent(action)) == ("rdma",)
    assert refresh_for(_uevent("remove", "block")) == ()
    other = NodeEvent(
        node=NODE, event_id="x", ts=1.0, kind="device_removed", source="gpu",
        attributes={"subsystem": "infiniband"},
    )  # fmt: skip
    assert refresh_for(other) == ()  # only the udev monitor's events


def _ports(readings: dict[BatchField, tuple[object, ...]]) -> set[tuple[str, int]]:
    return {(p.device, p.port) for p in readings.get("rdma", ()) if isinstance(p, RdmaPort)}


async def test_an_infiniband_uevent_runs_the_collector_before_it_is_due(tmp_path: Path) -> None:
    write_device(tmp_path, "mlx5_0", {1: ROCE})
    gone = write_device(tmp_path, "mlx5_1", {1: ROCE}, pci="0000:3c:00.0")
    clock = ManualClock(0.0)
    collection = Collection(
        ["rdma", "pcie"],
        CollectorSettings(sysfs=tmp_path),
        base_interval_s=5.0,
        intervals={"rdma": HOUR, "pcie": HOUR},
        clock=clock,
    )
    try:
        first = await collection.run_cycle()
        assert first.ran == {"rdma", "pcie"}
        assert _ports(first.readings) == {("mlx5_0", 1), ("mlx5_1", 1)}

        (tmp_path / "class/infiniband/mlx5_1").unlink()
        shutil.rmtree(gone)
        clock.now = 10.0
        stale = await collection.run_cycle()
        assert stale.ran == frozenset()  # not due for an hour: the old port is still there
        assert ("mlx5_1", 1) in _ports(stale.readings)

        assert collection.expedite(refresh_for(_uevent("remove")))
        fresh = await collection.run_cycle()
        assert fresh.ran == {"rdma"}  # only the collector that reads the device class
        assert _ports(fresh.readings) == {("mlx5_0", 1)}
        assert (await collection.run_cycle()).ran == frozenset()  # once, then its schedule

        write_device(tmp_path, "mlx5_1", {1: ROCE}, pci="0000:3c:00.0")
        assert collection.expedite(refresh_for(_uevent("add")))
        back = await collection.run_cycle()
        assert _ports(back.readings) == {("mlx5_0", 1), ("mlx5_1", 1)}

        assert not collection.expedite(["gpu"])  # not in this collection: nothing to wake
        assert not collection.expedite(())
    finally:
        await collection.close()


class _Gated:
    """A collector whose run waits for the test to open the gate."""

    name = "rdma"
    field: BatchField = "rdma"

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.runs = 0

    async def collect(self) -> Collected:
        self.runs += 1
        await self.gate.wait()
        self.gate.clear()
        return Collected(field=self.field)


async def test_a_run_in_progress_runs_again_after_it_ends(tmp_path: Path) -> None:
    clock = ManualClock(0.0)
    collection = Collection(
        ["rdma"], CollectorSettings(sysfs=tmp_path), base_interval_s=5.0,
        intervals={"rdma": HOUR}, timeout_s=0.05, clock=clock,
    )  # fmt: skip
    gated = _Gated()
    collection._slots["rdma"].collector = gated  # a scan that hangs in a driver read
    try:
        first = await collection.run_cycle()  # times out: the run goes on
        assert [e.message for e in first.errors] == ["timed out after 0.05s"]
        collection.expedite(["rdma"])  # the uevent comes while it still runs
        busy = await collection.run_cycle()
        assert (busy.ran, busy.errors) == (frozenset(), ())  # no second run, no error
        running = collection._slots["rdma"].running
        assert running is not None
        gated.gate.set()
        await running  # the first run ends
        gated.gate.set()  # the next run may finish at once
        again = await collection.run_cycle()
        assert again.ran == {"rdma"}
        assert gated.runs == 2
    finally:
        gated.gate.set()
        await collection.close()
