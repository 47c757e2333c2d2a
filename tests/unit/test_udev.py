"""udev: kernel uevent properties -> NodeEvents (pure), and the monitor's event path."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Iterator

import pytest

from metalguard.agent.collectors.udev import (
    DEFAULT_SUBSYSTEMS,
    MonitorLike,
    UdevMonitor,
    device_properties,
    uevent_event,
)
from metalguard.proto.base import NodeIdentity
from metalguard.proto.events import NODE_EVENT_KINDS, NodeEvent
from tests.support.uevent_monitor import SocketMonitor, Uevent

NODE = NodeIdentity(region="r1", cluster="c1", node="n1")

VETH_ADD = {
    "ACTION": "add",
    "DEVPATH": "/devices/virtual/net/mgt0",
    "SUBSYSTEM": "net",
    "INTERFACE": "mgt0",
    "IFINDEX": "17",
    "SEQNUM": "4242",
}
GPU_REMOVE = {
    "ACTION": "remove",
    "DEVPATH": "/devices/pci0000:17/0000:17:01.0/0000:18:00.0",
    "SUBSYSTEM": "pci",
    "DRIVER": "nvidia",
    "PCI_CLASS": "30200",
    "PCI_ID": "10DE:2330",
    "PCI_SLOT_NAME": "0000:18:00.0",
    "SEQNUM": "5000",
}
NVME_UNBIND = {
    "ACTION": "unbind",
    "DEVPATH": "/devices/pci0000:40/0000:40:01.1/0000:41:00.0/nvme/nvme0",
    "SUBSYSTEM": "nvme",
    "DEVNAME": "/dev/nvme0",
}


def _event(props: dict[str, str], **kw: object) -> NodeEvent | None:
    return uevent_event(props, node=NODE, ts=5.0, event_id="e1", **kw)  # type: ignore[arg-type]


def test_veth_added_is_an_info_device_added() -> None:
    event = _event(VETH_ADD)
    assert event is not None
    assert (event.kind, event.source, event.device, event.severity) == (
        "device_added",
        "udev",
        "mgt0",
        "info",
    )
    assert event.message == "network interface mgt0 added"
    assert event.attributes == {
        "action": "add",
        "subsystem": "net",
        "devpath": "/devices/virtual/net/mgt0",
        "virtual": True,
        "ifindex": "17",
        "seqnum": "4242",
    }
    assert (event.node, event.ts, event.event_id) == (NODE, 5.0, "e1")


def test_a_gpu_falling_off_the_bus_is_critical() -> None:
    event = _event(GPU_REMOVE)
    assert event is not None
    assert (event.kind, event.device, event.severity) == (
        "device_removed",
        "0000:18:00.0",
        "critical",
    )
    assert event.message == "PCI device 0000:18:00.0 (driver nvidia) removed"
    assert event.attributes["pci_id"] == "10DE:2330"
    assert event.attributes["virtual"] is False


def test_unbind_bind_and_change() -> None:
    unbound = _event(NVME_UNBIND)
    assert unbound is not None
    assert (unbound.kind, unbound.device, unbound.severity) == (
        "device_unbound",
        "nvme0",
        "critical",
    )
    bound = _event({**NVME_UNBIND, "ACTION": "bind"})
    assert bound is not None
    assert (bound.kind, bound.severity) == ("device_bound", "info")
    changed = _event({**VETH_ADD, "ACTION": "change"})
    assert changed is not None
    assert (changed.kind, changed.severity, changed.message) == (
        "device_changed",
        "info",
        "network interface mgt0 change event",
    )


def test_partitions_and_virtual_devices_going_away_are_info() -> None:
    part = {
        "ACTION": "remove",
        "SUBSYSTEM": "block",
        "DEVTYPE": "partition",
        "DEVPATH": "/devices/pci0000:00/0000:00:04.0/virtio1/block/vda/vda1",
        "DEVNAME": "vda1",
    }
    disk = {**part, "DEVTYPE": "disk", "DEVNAME": "vda", "DEVPATH": part["DEVPATH"][:-5]}
    severities = [
        event.severity if (event := _event(props)) else None
        for props in (part, disk, {**VETH_ADD, "ACTION": "remove"})
    ]
    assert severities == ["info", "critical", "info"]


@pytest.mark.parametrize(
    "props",
    [
        {**VETH_ADD, "SUBSYSTEM": "queues"},
        {**VETH_ADD, "SUBSYSTEM": "usb"},
        {**VETH_ADD, "ACTION": "weird"},
        {"SUBSYSTEM": "net"},
    ],
)
def test_unwatched_uevents_give_nothing(props: dict[str, str]) -> None:
    assert _event(props) is None


def test_subsystems_are_configurable_and_kinds_declared() -> None:
    assert _event(GPU_REMOVE, subsystems=("net",)) is None
    assert set(DEFAULT_SUBSYSTEMS) == {"pci", "block", "nvme", "net", "hwmon", "infiniband"}
    assert {
        "device_added",
        "device_removed",
        "device_changed",
        "device_bound",
        "device_unbound",
    } <= NODE_EVENT_KINDS


def test_device_properties_fill_in_action() -> None:
    props = {k: v for k, v in VETH_ADD.items() if k != "ACTION"}
    assert device_properties(Uevent(props, "add"))["ACTION"] == "add"


@pytest.fixture
def fake_monitor() -> Iterator[SocketMonitor]:
    mon = SocketMonitor()
    yield mon
    mon.close()


async def test_monitor_publishes_each_watched_uevent_through_emit(
    fake_monitor: SocketMonitor,
) -> None:
    got: asyncio.Queue[NodeEvent] = asyncio.Queue()
    opened: list[tuple[str, ...]] = []

    def opener(subsystems: Iterable[str]) -> MonitorLike:
        opened.append(tuple(subsystems))
        return fake_monitor

    ids = iter(range(100))
    monitor = UdevMonitor(
        lambda: NODE, subsystems=("net", "pci"), clock=lambda: 7.0,
        new_id=lambda: f"u{next(ids)}", opener=opener,
    )  # fmt: skip
    assert monitor.open()
    task = asyncio.create_task(monitor.run(got.put))
    try:
        fake_monitor.push(VETH_ADD)
        fake_monitor.push({**VETH_ADD, "SUBSYSTEM": "queues"})  # not watched: skipped
        fake_monitor.push(GPU_REMOVE)
        first = await asyncio.wait_for(got.get(), 5)
        second = await asyncio.wait_for(got.get(), 5)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert opened == [("net", "pci")]
    assert [(e.kind, e.device, e.event_id, e.ts) for e in (first, second)] == [
        ("device_added", "mgt0", "u0", 7.0),
        ("device_removed", "0000:18:00.0", "u2", 7.0),
    ]
    assert got.empty()


async def test_no_netlink_socket_is_reported_once_and_run_returns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def opener(subsystems: Iterable[str]) -> MonitorLike:
        raise PermissionError(1, "Operation not permitted")

    got: list[NodeEvent] = []

    async def emit(event: NodeEvent) -> None:
        got.append(event)

    monitor = UdevMonitor(lambda: NODE, opener=opener, clock=lambda: 3.0)
    with caplog.at_level(logging.ERROR, logger="metalguard.agent.collectors.udev"):
        await asyncio.wait_for(monitor.run(emit), 5)
    (event,) = got
    assert (event.kind, event.source, event.severity) == ("collector_failed", "udev", "warning")
    assert event.message == (
        "udev monitor off: cannot open the kernel uevent socket: "
        "PermissionError: [Errno 1] Operation not permitted"
    )
    assert len(caplog.records) == 1


def test_udev_defaults_on_only_with_the_default_collector_set() -> None:
    from metalguard.agent.config import parse_config

    default = parse_config("")
    assert default.events.udev_on(default.collect)
    assert default.events.udev_subsystems == DEFAULT_SUBSYSTEMS
    listed = parse_config('[collect]\nenabled = ["edac"]')
    assert not listed.events.udev_on(listed.collect)
    forced = parse_config('[collect]\nenabled = ["edac"]\n[events]\nudev = true')
    assert forced.events.udev_on(forced.collect)
    off = parse_config("[events]\nudev = false")
    assert not off.events.udev_on(off.collect)
