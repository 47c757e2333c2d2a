"""RDMA fabric health: every port of every InfiniBand/RoCE device under
``class/infiniband`` (pure parsing in :mod:`rdma_parse`).

Per device ``class/infiniband/<device>/``: ``board_id``, ``fw_ver``, ``hca_type`` and
every file of ``hw_counters/``.  Per port ``ports/<N>/``: ``state``, ``phys_state``,
``rate``, ``link_layer``, every file of ``counters/``, ``counters_ext/`` and
``hw_counters/``, and the bound interface: ``gid_attrs/ndevs/0`` (RoCE), else the
device's parent's ``device/net/*`` matched by ``dev_port``.

The tree is walked afresh every run (no descriptor or device list is kept), so a device
that went away is gone from the next run's readings; a device or port whose directory
vanishes while it is read is left out of this run.  The agent runs the collector at once
after an ``infiniband`` uevent (:data:`metalguard.agent.collectors.udev.REFRESH`).
"""

from __future__ import annotations

from metalguard.agent.collectors.base import BatchField, Collected, CollectorSettings, register
from metalguard.agent.collectors.rdma_parse import (
    DeviceFiles,
    Issue,
    PortFiles,
    choose_netdev,
    parse_device_counters,
    parse_netdev_name,
    parse_port,
)
from metalguard.agent.sysfs import ReadStatus, SysfsReader, run_scan
from metalguard.proto.telemetry import CollectorError, RdmaPort

NAME = "rdma"
CLASS_DIR = "class/infiniband"
DEVICE_FILES = ("board_id", "fw_ver", "hca_type")
PORT_FILES = ("state", "phys_state", "rate", "link_layer")
GID_NETDEV = "gid_attrs/ndevs/0"
"""The interface of a RoCE port's default GID (index 0, from its MAC)."""


class _Scan:
    """One walk of the tree: the reader and the errors met so far (blocking I/O)."""

    def __init__(self, reader: SysfsReader) -> None:
        self.reader = reader
        self.errors: list[CollectorError] = []

    def error(self, rel: str, message: str | None) -> None:
        self.errors.append(
            CollectorError(
                collector=NAME, path=self.reader.display(rel), message=message or "unreadable"
            )
        )

    def names(self, rel: str) -> tuple[str, ...]:
        """A directory's entries; none (silently) when it is absent."""
        listing = self.reader.listdir(rel)
        if listing.status is ReadStatus.ERROR:
            self.error(rel, listing.error)
        return listing.names

    def texts(self, rel: str, names: tuple[str, ...]) -> dict[str, str]:
        """The texts of the files that could be read; an unreadable one is an error,
        an absent one or one whose driver had no answer is skipped."""
        out: dict[str, str] = {}
        for name, result in self.reader.read_files(rel, names).items():
            if result.ok and result.text is not None:
                out[name] = result.text
            elif result.status is ReadStatus.ERROR:
                self.error(f"{rel}/{name}", result.error)
        return out

    def folder(self, rel: str) -> dict[str, str]:
        """Every file of a counter folder, by name."""
        return self.texts(rel, self.names(rel))

    def issues(self, base: str, issues: list[Issue]) -> None:
        for path, message in issues:
            self.error(f"{base}/{path}", message)


def scan_rdma(reader: SysfsReader) -> tuple[list[RdmaPort], list[CollectorError]]:
    """Read and parse every port of every RDMA device below the reader's root."""
    scan = _Scan(reader)
    listing = reader.listdir(CLASS_DIR)
    if listing.status is ReadStatus.MISSING:
        return [], []  # no RDMA stack, or no device: nothing to report
    if listing.status is ReadStatus.ERROR:
        scan.error(CLASS_DIR, listing.error)
    ports: list[RdmaPort] = []
    for name in listing.names:
        base = f"{CLASS_DIR}/{name}"
        if not reader.is_dir(base):
            continue  # a dangling entry: the device went away
        errors_before = len(scan.errors)
        found = _device(scan, name, base)
        if reader.is_dir(base):  # still there after reading: not a removed device
            ports.extend(found)
        else:  # removed while read: neither its ports nor its half-read files count
            del scan.errors[errors_before:]
    return ports, scan.errors


def _device(scan: _Scan, name: str, base: str) -> list[RdmaPort]:
    files = scan.texts(base, DEVICE_FILES)
    device = DeviceFiles(
        name=name,
        board_id=files.get("board_id"),
        fw_ver=files.get("fw_ver"),
        hca_type=files.get("hca_type"),
        hw_counters=scan.folder(f"{base}/hw_counters"),
    )
    device_hw, issues = parse_device_counters(device)
    scan.issues(base, issues)
    parent_netdevs: dict[str, int | None] | None = None
    out: list[RdmaPort] = []
    for entry in scan.names(f"{base}/ports"):
        if not entry.isdigit():
            scan.error(f"{base}/ports/{entry}", f"not a port number: {entry[:40]!r}")
            continue
        port_dir = f"{base}/ports/{entry}"
        gid = scan.reader.read(f"{port_dir}/{GID_NETDEV}")  # IB ports: EINVAL, ignored
        gid_netdev = parse_netdev_name(gid.text) if gid.ok and gid.text else ""
        if not gid_netdev and parent_netdevs is None:
            parent_netdevs = _parent_netdevs(scan, base)
        texts = scan.texts(port_dir, PORT_FILES)
        port_files = PortFiles(
            port=int(entry),
            state=texts.get("state"),
            phys_state=texts.get("phys_state"),
            rate=texts.get("rate"),
            link_layer=texts.get("link_layer"),
            counters=scan.folder(f"{port_dir}/counters"),
            counters_ext=scan.folder(f"{port_dir}/counters_ext"),
            hw_counters=scan.folder(f"{port_dir}/hw_counters"),
            netdev=choose_netdev(int(entry), gid_netdev, parent_netdevs or {}),
        )
        port, issues = parse_port(device, port_files, device_hw)
        scan.issues(base, issues)
        if scan.reader.is_dir(port_dir):
            out.append(port)
    return out


def _parent_netdevs(scan: _Scan, base: str) -> dict[str, int | None]:
    """The interfaces of the device's parent (``device/net/*``) and their ``dev_port``;
    best effort: nothing here is an error."""
    net = f"{base}/device/net"
    found: dict[str, int | None] = {}
    for ifname in scan.reader.listdir(net).names:
        result = scan.reader.read(f"{net}/{ifname}/dev_port")
        text = (result.text or "").strip() if result.ok else ""
        found[ifname] = int(text) if text.isdigit() else None
    return found


@register(NAME, default_interval_s=5)
class RdmaCollector:
    """Every port of every InfiniBand/RoCE device, walked afresh each run."""

    name = NAME
    field: BatchField = "rdma"

    def __init__(self, settings: CollectorSettings, *, reader: SysfsReader | None = None) -> None:
        self._reader = reader or SysfsReader(settings.sysfs)

    async def collect(self) -> Collected:
        """Scan ``class/infiniband`` off the event loop."""
        ports, errors = await run_scan(scan_rdma, self._reader)
        return Collected(field=self.field, items=tuple(ports), errors=tuple(errors))
