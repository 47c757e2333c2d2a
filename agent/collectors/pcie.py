"""PCIe functions from ``bus/pci/devices/*``: identity, link speed/width, AER counters.

The collector also remembers each link's state across cycles (:func:`track_links`) to
count downgrades and recoveries since the agent started.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import msgspec

from metalguard.agent.collectors.base import BatchField, Collected, CollectorSettings, register
from metalguard.agent.sysfs import ReadStatus, SysfsReader, run_scan
from metalguard.proto.telemetry import AerCounters, CollectorError, PcieDevice

DEVICES_DIR = "bus/pci/devices"
IDENTITY_FILES = ("class", "vendor", "device")
LINK_FILES = ("current_link_speed", "max_link_speed", "current_link_width", "max_link_width")
AER_FILES = ("aer_dev_correctable", "aer_dev_fatal", "aer_dev_nonfatal")

_SPEED_RE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(?![0-9.])")
_INT_RE = re.compile(r"^[0-9]+$")

T = TypeVar("T")
Issue = tuple[str, str]
"""A problem with one file: (file name in the device directory, message)."""


def parse_link_speed(text: str) -> float | None:
    """GT/s from ``"16.0 GT/s PCIe"`` or ``"8 GT/s"``; None for ``"Unknown"`` or empty."""
    value = text.strip()
    if not value or value.lower().startswith("unknown"):
        return None
    match = _SPEED_RE.match(value)
    if match is None:
        raise ValueError(f"not a link speed: {value[:40]!r}")
    return float(match[1])


def parse_link_width(text: str) -> int | None:
    """Lane count from a decimal integer; None for an empty file."""
    value = text.strip()
    if not value:
        return None
    if not _INT_RE.match(value):
        raise ValueError(f"not a link width: {value[:40]!r}")
    return int(value)


def parse_aer(text: str) -> tuple[dict[str, int], list[str]]:
    """Counters from an ``aer_dev_*`` file, keyed by kernel name, plus bad lines.

    Each line is ``<name> <count>``; names may hold spaces (``Receiver Error 2``), so a
    line splits on its last space.  ``TOTAL_ERR_*`` lines are kept like the others.
    """
    counters: dict[str, int] = {}
    bad: list[str] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        name, _, count = line.rpartition(" ")
        name = name.strip()
        if not name or not _INT_RE.match(count):
            bad.append(line[:60])
            continue
        counters[name] = int(count)
    return counters, bad


def is_downgraded(
    current_speed: float | None,
    max_speed: float | None,
    current_width: int | None,
    max_width: int | None,
) -> bool:
    """True when the link runs below its maximum speed or width (where both are known)."""
    slower = current_speed is not None and max_speed is not None and current_speed < max_speed
    narrower = current_width is not None and max_width is not None and current_width < max_width
    return slower or narrower


def _parsed(
    files: Mapping[str, str], name: str, parse: Callable[[str], T | None], issues: list[Issue]
) -> T | None:
    text = files.get(name)
    if text is None:
        return None
    try:
        return parse(text)
    except ValueError as exc:
        issues.append((name, str(exc)))
        return None


def parse_device(address: str, files: Mapping[str, str]) -> tuple[PcieDevice, list[Issue]]:
    """Build one PCI function from its files' texts, keyed by file name.

    Absent files give null fields; ``aer`` is None when no ``aer_dev_*`` file was read.
    """
    issues: list[Issue] = []
    cur_speed = _parsed(files, "current_link_speed", parse_link_speed, issues)
    max_speed = _parsed(files, "max_link_speed", parse_link_speed, issues)
    cur_width = _parsed(files, "current_link_width", parse_link_width, issues)
    max_width = _parsed(files, "max_link_width", parse_link_width, issues)

    aer: AerCounters | None = None
    if any(name in files for name in AER_FILES):
        parsed: dict[str, dict[str, int]] = {}
        for name in AER_FILES:
            counters, bad = parse_aer(files.get(name, ""))
            parsed[name] = counters
            issues.extend((name, f"bad line: {line!r}") for line in bad)
        aer = AerCounters(
            correctable=parsed["aer_dev_correctable"],
            fatal=parsed["aer_dev_fatal"],
            nonfatal=parsed["aer_dev_nonfatal"],
        )

    device = PcieDevice(
        address=address,
        pci_class=files.get("class", "").strip(),
        vendor=files.get("vendor", "").strip(),
        device=files.get("device", "").strip(),
        current_link_speed_gts=cur_speed,
        max_link_speed_gts=max_speed,
        current_link_width=cur_width,
        max_link_width=max_width,
        downgraded=is_downgraded(cur_speed, max_speed, cur_width, max_width),
        aer=aer,
    )
    return device, issues


@dataclass(frozen=True, slots=True)
class LinkHistory:
    """What the tracker remembers of one link."""

    downgraded: bool
    downgrades: int = 0
    recoveries: int = 0


def _link_known(device: PcieDevice) -> bool:
    speeds = device.current_link_speed_gts is not None and device.max_link_speed_gts is not None
    widths = device.current_link_width is not None and device.max_link_width is not None
    return speeds or widths


def track_links(
    previous: Mapping[str, LinkHistory], devices: Sequence[PcieDevice]
) -> tuple[dict[str, LinkHistory], tuple[PcieDevice, ...]]:
    """Advance the link histories by one cycle; return them and the devices with counts.

    A healthy-to-downgraded change, or a first sighting already downgraded, is a
    downgrade; downgraded-to-healthy is a recovery; ``retrains`` is their sum.  A device
    whose link state is unknown this cycle keeps its history unchanged.  Histories of
    devices not seen this cycle are kept, so a device that comes back is not new.
    """
    state = dict(previous)
    out: list[PcieDevice] = []
    for device in devices:
        before = state.get(device.address)
        now = before
        if _link_known(device):
            if before is None:
                now = LinkHistory(device.downgraded, downgrades=int(device.downgraded))
            elif device.downgraded and not before.downgraded:
                now = LinkHistory(True, before.downgrades + 1, before.recoveries)
            elif before.downgraded and not device.downgraded:
                now = LinkHistory(False, before.downgrades, before.recoveries + 1)
        if now is None:
            out.append(device)
            continue
        state[device.address] = now
        out.append(
            msgspec.structs.replace(
                device,
                downgrades=now.downgrades,
                recoveries=now.recoveries,
                retrains=now.downgrades + now.recoveries,
            )
        )
    return state, tuple(out)


def scan_pcie(reader: SysfsReader) -> tuple[list[PcieDevice], list[CollectorError]]:
    """Read and parse every PCI function below the reader's root (blocking I/O)."""
    errors: list[CollectorError] = []
    devices: list[PcieDevice] = []
    listing = reader.listdir(DEVICES_DIR)
    if listing.status is ReadStatus.ERROR:
        errors.append(_error(reader.display(DEVICES_DIR), listing.error))
    for address in listing.names:
        device_dir = reader.resolve(f"{DEVICES_DIR}/{address}")
        if device_dir is None or not reader.is_dir(device_dir):
            continue  # dangling link: the device went away between listing and reading
        files: dict[str, str] = {}
        for name, result in reader.read_files(
            device_dir, IDENTITY_FILES + LINK_FILES + AER_FILES
        ).items():
            if result.text is not None:
                files[name] = result.text
            elif result.status is ReadStatus.ERROR:
                errors.append(_error(reader.display(f"{device_dir}/{name}"), result.error))
        device, issues = parse_device(address, files)
        devices.append(device)
        errors.extend(_error(reader.display(f"{device_dir}/{n}"), msg) for n, msg in issues)
    return devices, errors


def _error(path: str, message: str | None) -> CollectorError:
    return CollectorError(collector="pcie", path=path, message=message or "unreadable")


@register("pcie", default_interval_s=5)
class PcieCollector:
    """Collects every PCI function and tracks link downgrades across calls."""

    name = "pcie"
    field: BatchField = "pcie"

    def __init__(self, settings: CollectorSettings, *, reader: SysfsReader | None = None) -> None:
        self._reader = reader or SysfsReader(settings.sysfs)
        self._links: dict[str, LinkHistory] = {}

    async def collect(self) -> Collected:
        """Scan the devices off the event loop, then advance the link tracker."""
        devices, errors = await run_scan(scan_pcie, self._reader, watch=(DEVICES_DIR,))
        self._links, tracked = track_links(self._links, devices)
        return Collected(field=self.field, items=tracked, errors=tuple(errors))
