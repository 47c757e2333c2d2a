"""udev: kernel uevents (hotplug, unbind) published as NodeEvents the moment they come.

A GPU or NIC falling off the bus, a disk pulled, a driver letting go of a device after an
error: the kernel announces each on its uevent netlink socket.  :class:`UdevMonitor`
listens there through pyudev with ``source="kernel"``, which needs no udevd (events
arrive before udev has processed them, so there are no ``ID_*`` properties).  The pure
:func:`uevent_event` turns one uevent's properties into a NodeEvent.

If the netlink socket cannot be opened (no libudev, a sandbox without ``AF_NETLINK``),
the monitor logs why and publishes one ``collector_failed`` NodeEvent (source ``udev``,
severity ``warning``); the agent goes on without it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Final, Protocol

from metalguard.proto.base import AttrValue, NodeIdentity
from metalguard.proto.events import NodeEvent

log = logging.getLogger(__name__)

EmitEvent = Callable[[NodeEvent], Awaitable[None]]

DEFAULT_SUBSYSTEMS: Final = ("pci", "block", "nvme", "net", "hwmon", "infiniband")

ACTION_KINDS: Final[dict[str, str]] = {
    "add": "device_added",
    "remove": "device_removed",
    "change": "device_changed",
    "move": "device_changed",
    "online": "device_changed",
    "offline": "device_changed",
    "bind": "device_bound",
    "unbind": "device_unbound",
}
"""Kernel uevent ACTION -> NodeEvent kind."""

LOSS_ACTIONS: Final = frozenset({"remove", "unbind", "offline"})
"""Actions that take a device away: critical for physical devices."""

QUEUE_MAX = 4096
"""Uevents waiting to be published; past it they are dropped and counted (a storm)."""

SUBSYSTEM_LABELS: Final = {
    "pci": "PCI device",
    "block": "block device",
    "nvme": "NVMe controller",
    "net": "network interface",
    "hwmon": "hwmon chip",
    "infiniband": "InfiniBand device",
}


REFRESH: Final[dict[str, tuple[str, ...]]] = {"infiniband": ("rdma",)}
"""uevent subsystem -> the collectors the agent runs at once after one of its uevents
(they read that device class: an RDMA device that went away leaves no stale port)."""


def refresh_for(event: NodeEvent) -> tuple[str, ...]:
    """The collectors to run at once after this udev NodeEvent (pure): those of
    :data:`REFRESH` for its ``subsystem`` attribute; none for other events."""
    if event.source != "udev":
        return ()
    return REFRESH.get(str(event.attributes.get("subsystem", "")), ())


def _device_name(props: Mapping[str, str]) -> str:
    """The component as operators name it: PCI address, interface, disk, else sys name."""
    for key in ("PCI_SLOT_NAME", "INTERFACE", "DEVNAME"):
        if props.get(key):
            return props[key].removeprefix("/dev/")
    return props.get("DEVPATH", "").rsplit("/", 1)[-1] or "?"


def uevent_severity(action: str, props: Mapping[str, str]) -> str:
    """critical when a physical device goes away; info for everything else."""
    virtual = props.get("DEVPATH", "").startswith("/devices/virtual/")
    partition = props.get("DEVTYPE") == "partition"
    if action in LOSS_ACTIONS and not virtual and not partition:
        return "critical"
    return "info"


def uevent_event(
    props: Mapping[str, str],
    *,
    node: NodeIdentity,
    ts: float,
    event_id: str,
    subsystems: Iterable[str] = DEFAULT_SUBSYSTEMS,
) -> NodeEvent | None:
    """The NodeEvent of one kernel uevent (its properties: ACTION, DEVPATH, SUBSYSTEM,
    ...); None for a subsystem not watched or an action without a kind."""
    action = props.get("ACTION", "")
    subsystem = props.get("SUBSYSTEM", "")
    kind = ACTION_KINDS.get(action)
    if kind is None or subsystem not in set(subsystems):
        return None
    device = _device_name(props)
    devpath = props.get("DEVPATH", "")
    attributes: dict[str, AttrValue] = {
        "action": action,
        "subsystem": subsystem,
        "devpath": devpath,
        "virtual": devpath.startswith("/devices/virtual/"),
    }
    for key, attr in (
        ("DRIVER", "driver"),
        ("DEVTYPE", "devtype"),
        ("PCI_ID", "pci_id"),
        ("PCI_CLASS", "pci_class"),
        ("IFINDEX", "ifindex"),
        ("SEQNUM", "seqnum"),
    ):
        if props.get(key):
            attributes[attr] = props[key]
    label = SUBSYSTEM_LABELS.get(subsystem, subsystem)
    driver = f" (driver {props['DRIVER']})" if props.get("DRIVER") else ""
    verb = {"add": "added", "remove": "removed", "bind": "bound", "unbind": "unbound"}.get(
        action, f"{action} event"
    )
    return NodeEvent(
        node=node,
        event_id=event_id,
        ts=ts,
        kind=kind,
        source="udev",
        device=device,
        severity=uevent_severity(action, props),
        message=f"{label} {device}{driver} {verb}",
        attributes=attributes,
    )


class MonitorLike(Protocol):
    """What the monitor needs of ``pyudev.Monitor``."""

    def fileno(self) -> int: ...

    def poll(self, timeout: float | None = None) -> Any: ...


def open_kernel_monitor(subsystems: Iterable[str]) -> MonitorLike:
    """A started pyudev monitor on the kernel's uevent socket; raises on failure."""
    import pyudev

    monitor = pyudev.Monitor.from_netlink(pyudev.Context(), source="kernel")
    for subsystem in subsystems:
        monitor.filter_by(subsystem=subsystem)
    monitor.start()
    return monitor  # type: ignore[no-any-return]


def device_properties(device: Any) -> dict[str, str]:
    """A pyudev Device's uevent properties, with ACTION filled in."""
    props = {str(k): str(v) for k, v in device.properties.items()}
    if device.action and "ACTION" not in props:
        props["ACTION"] = str(device.action)
    return props


def _new_id() -> str:
    return uuid.uuid4().hex


class UdevMonitor:
    """The agent's kernel uevent listener: :meth:`open` then :meth:`run`."""

    def __init__(
        self,
        identity: Callable[[], NodeIdentity],
        *,
        subsystems: Iterable[str] = DEFAULT_SUBSYSTEMS,
        clock: Callable[[], float] = time.time,
        new_id: Callable[[], str] = _new_id,
        opener: Callable[[Iterable[str]], MonitorLike] = open_kernel_monitor,
    ) -> None:
        self._identity = identity
        self.subsystems = tuple(subsystems)
        self._clock = clock
        self._new_id = new_id
        self._opener = opener
        self._monitor: MonitorLike | None = None
        self.failure = ""
        """Why the socket could not be opened ("" when it was)."""
        self.dropped = 0
        """Uevents lost because the queue was full."""

    def open(self) -> bool:
        """Open and start the netlink monitor (synchronous, quick); False on failure,
        with the reason in :attr:`failure` (logged once)."""
        try:
            self._monitor = self._opener(self.subsystems)
        except Exception as exc:  # ImportError, OSError from libudev or the socket
            self.failure = f"cannot open the kernel uevent socket: {type(exc).__name__}: {exc}"
            log.error("udev monitor off: %s", self.failure)
            return False
        return True

    async def run(self, emit: EmitEvent) -> None:
        """Publish each watched uevent through ``emit`` until cancelled.  Without a
        socket: one ``collector_failed`` event, then return."""
        if self._monitor is None and not self.failure:
            self.open()
        monitor = self._monitor
        if monitor is None:
            await emit(self._failure_event())
            return
        queue: asyncio.Queue[dict[str, str]] = asyncio.Queue(QUEUE_MAX)
        loop = asyncio.get_running_loop()

        def readable() -> None:
            while True:
                try:
                    device = monitor.poll(timeout=0)
                except OSError as exc:  # ENOBUFS: the kernel dropped uevents
                    log.warning("udev monitor: %s", exc)
                    return
                if device is None:
                    return
                try:
                    queue.put_nowait(device_properties(device))
                except asyncio.QueueFull:
                    self.dropped += 1

        fd = monitor.fileno()
        loop.add_reader(fd, readable)
        try:
            while True:
                props = await queue.get()
                event = uevent_event(
                    props,
                    node=self._identity(),
                    ts=self._clock(),
                    event_id=self._new_id(),
                    subsystems=self.subsystems,
                )
                if event is not None:
                    await emit(event)
        finally:
            loop.remove_reader(fd)

    def _failure_event(self) -> NodeEvent:
        return NodeEvent(
            node=self._identity(),
            event_id=self._new_id(),
            ts=self._clock(),
            kind="collector_failed",
            source="udev",
            device="uevent",
            severity="warning",
            message=f"udev monitor off: {self.failure}",
            attributes={"collector": "udev"},
        )
