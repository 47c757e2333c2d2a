"""The agent (in process, a real nats-server) follows RDMA hotplug: after an
``infiniband`` uevent the rdma collector runs at once, so the next batch has no port of a
hot-unplugged device, and a device that comes back is in it again — with the collector's
own interval an hour long, only the uevent can have made those runs."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from metalguard.agent.collectors.udev import MonitorLike
from metalguard.agent.config import parse_config
from metalguard.agent.service import AgentService
from metalguard.proto.codec import decode
from metalguard.proto.events import NodeEvent
from metalguard.proto.subjects import Subjects
from metalguard.proto.telemetry import TelemetryBatch
from tests.support.rdma_trees import ROCE, write_device
from tests.support.uevent_monitor import SocketMonitor

WAIT_S = 10.0
DEVPATH = "/devices/pci0000:00/0000:3c:00.0/infiniband/mlx5_1"


def uevent(action: str) -> dict[str, str]:
    return {"ACTION": action, "SUBSYSTEM": "infiniband", "DEVPATH": DEVPATH}


@pytest.fixture
def monitor() -> Iterator[SocketMonitor]:
    mon = SocketMonitor()
    yield mon
    mon.close()


def _config(tmp_path: Path, nats_url: str, prefix: str, sysfs: Path) -> str:
    return f"""
[node]
region = "r1"
cluster = "c1"
name = "ib1"
uuid = "test-uuid-ib1"

[nats]
servers = ["{nats_url}"]
prefix = "{prefix}"
connect_timeout_s = 1.0
reconnect_base_s = 0.1
reconnect_max_s = 0.5

[collect]
interval_s = 0.2
enabled = ["rdma"]
sysfs = "{sysfs}"

[collect.intervals]
rdma = 3600.0

[events]
udev = true
udev_subsystems = ["infiniband"]
gpu_xid = false

[spool]
dir = "{tmp_path / "spool"}"
"""


def _devices(batch: TelemetryBatch) -> set[str]:
    return {port.device for port in batch.rdma}


async def _next_batch(
    batches: asyncio.Queue[TelemetryBatch], devices: set[str], what: str
) -> TelemetryBatch:
    """The first batch whose RDMA devices are ``devices``."""

    async def scan() -> TelemetryBatch:
        while True:
            batch = await batches.get()
            if _devices(batch) == devices:
                return batch

    try:
        return await asyncio.wait_for(scan(), WAIT_S)
    except TimeoutError:
        raise AssertionError(f"no batch {what} within {WAIT_S}s") from None


def _drain(queue: asyncio.Queue[TelemetryBatch]) -> None:
    while not queue.empty():
        queue.get_nowait()


async def test_unplugged_device_leaves_no_stale_port_and_comes_back(
    tmp_path: Path, nats_url: str, nc: Client, subjects: Subjects, monitor: SocketMonitor
) -> None:
    sysfs = tmp_path / "sys"
    write_device(sysfs, "mlx5_0", {1: ROCE})
    gone = write_device(sysfs, "mlx5_1", {1: ROCE}, pci="0000:3c:00.0")
    batches: asyncio.Queue[TelemetryBatch] = asyncio.Queue()
    events: asyncio.Queue[NodeEvent] = asyncio.Queue()

    async def on_batch(msg: Msg) -> None:
        batches.put_nowait(decode(msg.data, TelemetryBatch))

    async def on_event(msg: Msg) -> None:
        events.put_nowait(decode(msg.data, NodeEvent))

    tel = await nc.subscribe(subjects.telemetry("r1", "c1", "ib1"), cb=on_batch)
    evt = await nc.subscribe(subjects.all_of("evt"), cb=on_event)
    await nc.flush()
    config_path = tmp_path / "agent.toml"
    config_path.write_text(_config(tmp_path, nats_url, subjects.prefix, sysfs))
    opened: list[tuple[str, ...]] = []

    def opener(subsystems: Iterable[str]) -> MonitorLike:
        opened.append(tuple(subsystems))
        return monitor

    service = AgentService(
        config_path, parse_config(config_path.read_text()), env={}, udev_opener=opener
    )
    agent = asyncio.create_task(service.run())
    try:
        first = await _next_batch(batches, {"mlx5_0", "mlx5_1"}, "with both devices")
        assert [r.collector for r in first.collectors] == ["rdma"]
        assert opened == [("infiniband",)]

        # Hot-unplug: the kernel drops the class entry and the directory, then says so.
        (sysfs / "class/infiniband/mlx5_1").unlink()
        shutil.rmtree(gone)
        _drain(batches)
        monitor.push(uevent("remove"))
        removed = await asyncio.wait_for(events.get(), WAIT_S)
        assert (removed.kind, removed.source, removed.device) == (
            "device_removed", "udev", "mlx5_1",
        )  # fmt: skip
        after = await _next_batch(batches, {"mlx5_0"}, "without the unplugged device")
        assert [p.device for p in after.rdma] == ["mlx5_0"]

        write_device(sysfs, "mlx5_1", {1: ROCE, 2: ROCE}, pci="0000:3c:00.0")
        monitor.push(uevent("add"))
        back = await _next_batch(batches, {"mlx5_0", "mlx5_1"}, "with the device back")
        assert {(p.device, p.port) for p in back.rdma} == {
            ("mlx5_0", 1), ("mlx5_1", 1), ("mlx5_1", 2),
        }  # fmt: skip
    finally:
        service.request_stop()
        await asyncio.wait_for(agent, 30)
        await tel.unsubscribe()
        await evt.unsubscribe()
