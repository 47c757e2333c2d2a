"""The DMA isolation posture (docs/security.md "DMA isolation"): the IOMMUs the kernel
registered (``class/iommu``), its groups (``kernel/iommu_groups/<n>/devices``, ``type``),
the IOMMU arguments of ``/proc/cmdline``, and for every GPU and NIC its group, its ATS
and the ACS of each bridge above it (``bus/pci/devices/<bdf>/config``, the path from
``devices/pci<domain>:<bus>/...``). Judged by :func:`iommu_parse.assess`.

It changes at boot (or when someone clears ACS bits with setpci): collected every 5 min.
Root reads the whole configuration space; another user gets 64 bytes and the ACS is
``unknown``.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from metalguard.agent.collectors.base import BatchField, Collected, CollectorSettings, register
from metalguard.agent.collectors.iommu_parse import (
    IommuReading,
    PciFunction,
    assess,
    device_kind,
    is_bdf,
)
from metalguard.proto.telemetry import CollectorError

CONFIG_SIZE = 4096


def _listdir(path: Path) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _text(path: Path) -> str:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return ""


def read_iommu(sysfs: Path, procfs: Path) -> IommuReading:
    """Everything the posture is judged from (blocking: run it off the loop); the files
    that could not be read are its ``problems``."""
    problems: list[str] = []
    iommus = tuple(_listdir(sysfs / "class" / "iommu"))
    cmdline = _text(procfs / "cmdline")
    groups_dir = sysfs / "kernel" / "iommu_groups"
    members: dict[str, tuple[str, ...]] = {}
    types: dict[str, str] = {}
    for group in _listdir(groups_dir):
        members[group] = tuple(_listdir(groups_dir / group / "devices"))
        types[group] = _text(groups_dir / group / "type")
    devices_dir = sysfs / "bus" / "pci" / "devices"
    classes: dict[str, str] = {}
    for address in _listdir(devices_dir):
        classes[address] = _text(devices_dir / address / "class")
    wanted: dict[str, Path] = {}
    """The functions whose config space is read, and their real directories."""
    paths: dict[str, tuple[str, ...]] = {}
    group_of: dict[str, str | None] = {}
    for address, pci_class in classes.items():
        if device_kind(pci_class) is None:
            continue
        device = devices_dir / address
        try:
            real = Path(os.path.realpath(device))
        except OSError:
            real = device
        wanted[address] = real
        above = [parent for parent in real.parents if is_bdf(parent.name)]
        paths[address] = tuple(p.name for p in reversed(above))
        for parent in above:
            wanted.setdefault(parent.name, parent)
        link = device / "iommu_group"
        group_of[address] = os.path.basename(os.readlink(link)) if link.is_symlink() else None
    functions: dict[str, PciFunction] = {}
    translating = bool(iommus or members)  # without an IOMMU the posture is off anyway
    for address in sorted(set(classes) | set(wanted)):
        config = b""
        if address in wanted and translating:
            try:
                with open(wanted[address] / "config", "rb") as f:
                    config = f.read(CONFIG_SIZE)
            except OSError as exc:
                problems.append(f"{address}/config: {exc.strerror or exc}")
        functions[address] = PciFunction(
            address=address,
            pci_class=classes.get(address, ""),
            config=config,
            group=group_of.get(address),
            path=paths.get(address, ()),
        )
    reading = IommuReading(
        iommus=iommus,
        cmdline=cmdline,
        group_types=types,
        group_members=members,
        functions=functions,
        problems=tuple(problems),
    )
    return reading


@register("iommu", default_interval_s=300)
class IommuCollector:
    """The node's DMA isolation posture, one per run."""

    name = "iommu"
    field: BatchField = "iommu"

    def __init__(self, settings: CollectorSettings) -> None:
        self._sysfs = settings.sysfs
        self._procfs = settings.procfs

    async def collect(self) -> Collected:
        """Read the IOMMU's state off the event loop and judge the posture."""
        reading = await asyncio.to_thread(read_iommu, self._sysfs, self._procfs)
        errors = tuple(
            CollectorError(collector=self.name, message=p) for p in reading.problems[:10]
        )
        return Collected(field=self.field, items=(assess(reading),), errors=errors)
