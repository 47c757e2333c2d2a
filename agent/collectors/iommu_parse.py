"""The DMA isolation posture's pure parts (docs/security.md "DMA isolation"): PCI
configuration space (the capability lists, ACS, ATS, the PCIe port type), the kernel's
IOMMU arguments, and the posture from what the collector read.

Configuration space (PCI Local Bus 3.0, PCIe Base 6.0 ch. 7): the status register's bit 4
says a capability list starts at the pointer in byte 0x34 (each entry: ID, next); the
PCI Express capability (ID 0x10) holds the port type in bits 4-7 of its flags (+2). The
extended capabilities start at 0x100 (root reads 4096 bytes; others 64): a 32-bit header
with the ID (bits 0-15), version (16-19) and the next offset (20-31). ACS is ID 0x000D
(capability +4, control +6, 16 bits each), ATS ID 0x000F (control +6, bit 15 enable).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from metalguard.proto.iommu import ACS_BITS, ACS_REDIRECT, BridgeAcs, IommuDevice, IommuPosture

EXT_START: Final = 0x100
EXT_ACS: Final = 0x000D
EXT_ATS: Final = 0x000F
CAP_PCIE: Final = 0x10
_MAX_CAPS: Final = 64
"""The standard list has room for at most 48 (192 bytes, 4 each): a longer one loops."""
PORT_TYPES: Final = {
    0: "endpoint",
    1: "legacy-endpoint",
    4: "root",
    5: "upstream",
    6: "downstream",
    7: "pcie-to-pci",
    8: "pci-to-pcie",
    9: "rc-endpoint",
    10: "rc-event-collector",
}
GPU_CLASSES: Final = ("0300", "0302", "0380")
NIC_CLASSES: Final = ("0200", "0207", "0280")
BRIDGE_CLASS: Final = "0604"
_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_IOMMU_ARGS = re.compile(r"^(?:intel_iommu|amd_iommu|iommu|iommu\.\w+|amd_iommu_\w+)=")


def _u16(config: bytes, offset: int) -> int:
    return int.from_bytes(config[offset : offset + 2], "little")


def _u32(config: bytes, offset: int) -> int:
    return int.from_bytes(config[offset : offset + 4], "little")


def capabilities(config: bytes) -> dict[int, int]:
    """The standard capabilities: ID -> offset (the first of each ID; none when the
    status register says there is no list or the bytes end)."""
    found: dict[int, int] = {}
    if len(config) < 0x40 or not _u16(config, 0x06) & 0x10:
        return found
    offset = config[0x34] & 0xFC
    for _ in range(_MAX_CAPS):
        if offset < 0x40 or offset + 2 > len(config):
            break
        found.setdefault(config[offset], offset)
        offset = config[offset + 1] & 0xFC
    return found


def extended_capabilities(config: bytes) -> dict[int, int]:
    """The PCIe extended capabilities: ID -> offset (none when only the first 256 bytes,
    or 64 for a user other than root, could be read)."""
    found: dict[int, int] = {}
    if len(config) <= EXT_START or CAP_PCIE not in capabilities(config):
        return found  # only a PCI Express function has them (else: garbage, or nothing)
    offset, seen = EXT_START, set()
    while EXT_START <= offset <= len(config) - 4 and offset not in seen:
        seen.add(offset)  # the next pointers may go down (PLX: 0x100 -> 0xfb4 -> 0x138)
        header = _u32(config, offset)
        if header in (0, 0xFFFFFFFF):
            break
        found.setdefault(header & 0xFFFF, offset)
        offset = (header >> 20) & 0xFFC
    return found


def acs_bits(value: int) -> tuple[str, ...]:
    """The ACS bits set in a capability or control register, in ``ACS_BITS`` order."""
    return tuple(name for bit, name in enumerate(ACS_BITS) if value >> bit & 1)


@dataclass(frozen=True, slots=True)
class Acs:
    """A port's ACS capability and control registers."""

    cap: int
    ctl: int

    @property
    def redirects(self) -> bool:
        """Whether every bit Linux needs for isolation is enabled (where the port has it:
        a bit it lacks cannot be turned on and is not needed, as Linux's check)."""
        need = [ACS_BITS.index(b) for b in ACS_REDIRECT]
        return all(self.ctl >> bit & 1 or not self.cap >> bit & 1 for bit in need) and any(
            self.cap >> bit & 1 for bit in need
        )


def acs(config: bytes) -> Acs | None:
    """The ACS registers (None: no ACS capability, or the extended space unreadable)."""
    offset = extended_capabilities(config).get(EXT_ACS)
    if offset is None or offset + 8 > len(config):
        return None
    return Acs(cap=_u16(config, offset + 4), ctl=_u16(config, offset + 6))


def ats_enabled(config: bytes) -> bool | None:
    """Whether ATS is enabled (None: no ATS capability, or unreadable)."""
    offset = extended_capabilities(config).get(EXT_ATS)
    if offset is None or offset + 8 > len(config):
        return None
    return bool(_u16(config, offset + 6) >> 15 & 1)


def port_type(config: bytes) -> str:
    """The PCIe device/port type ("" for conventional PCI or unreadable)."""
    offset = capabilities(config).get(CAP_PCIE)
    if offset is None or offset + 4 > len(config):
        return ""
    kind = (_u16(config, offset + 2) >> 4) & 0xF
    return PORT_TYPES.get(kind, f"type-{kind}")


def iommu_args(cmdline: str) -> tuple[str, ...]:
    """The kernel arguments that set the IOMMU, in order."""
    return tuple(arg for arg in cmdline.split() if _IOMMU_ARGS.match(arg))


def passthrough_by_args(args: Sequence[str]) -> str | None:
    """Why the arguments turn translation off (None: they do not)."""
    for arg in args:
        key, _, value = arg.partition("=")
        values = set(value.split(","))
        if key in ("intel_iommu", "amd_iommu") and "off" in values:
            return f"{arg} on the kernel command line"
        if key == "iommu" and values & {"off", "pt", "soft"}:
            return f"{arg} on the kernel command line"
        if key == "iommu.passthrough" and value in ("1", "y", "on"):
            return f"{arg} on the kernel command line"
    return None


def device_kind(pci_class: str) -> str | None:
    """``gpu`` or ``nic`` for a class a tenant is given (``0x030200``), else None."""
    text = pci_class.strip().lower().removeprefix("0x")[:4]
    if text in GPU_CLASSES:
        return "gpu"
    if text in NIC_CLASSES:
        return "nic"
    return None


def same_device(a: str, b: str) -> bool:
    """Whether two functions are of one device (``0000:3b:00.0`` and ``.1``)."""
    return a.rsplit(".", 1)[0] == b.rsplit(".", 1)[0]


def is_bdf(name: str) -> bool:
    """Whether a sysfs path component is a PCI address."""
    return bool(_BDF.match(name))


@dataclass(frozen=True, slots=True)
class PciFunction:
    """What the collector read of one PCI function."""

    address: str
    pci_class: str
    config: bytes = b""
    group: str | None = None
    path: tuple[str, ...] = ()
    """The bridges above it, from the root down (their addresses)."""


@dataclass(frozen=True, slots=True)
class IommuReading:
    """Everything the posture is judged from (the collector's reading; pure input)."""

    iommus: tuple[str, ...]
    cmdline: str
    group_types: Mapping[str, str]
    """Group -> its default domain type (``DMA``, ``DMA-FQ``, ``identity``; "" unknown)."""
    group_members: Mapping[str, tuple[str, ...]]
    functions: Mapping[str, PciFunction]
    problems: tuple[str, ...] = field(default=())
    """What could not be read (files, links), each said once."""


def _bridge(address: str, functions: Mapping[str, PciFunction]) -> BridgeAcs:
    fn = functions.get(address)
    config = fn.config if fn is not None else b""
    port = port_type(config)
    # a PCIe port's ACS is in the extended space; a conventional bridge has 256 bytes
    readable = len(config) > EXT_START or (len(config) > 0x40 and not port)
    regs = acs(config) if readable else None
    return BridgeAcs(
        address=address,
        port=port,
        acs_cap=acs_bits(regs.cap) if regs is not None else None,
        acs_ctl=acs_bits(regs.ctl) if regs is not None else None,
        readable=readable,
    )


def _peers(fn: PciFunction, reading: IommuReading) -> tuple[str, ...]:
    members = reading.group_members.get(fn.group or "", ())
    out = []
    for other in members:
        if other == fn.address or same_device(other, fn.address):
            continue
        cls = reading.functions.get(other)
        if cls is not None and cls.pci_class.lower().removeprefix("0x")[:4] == BRIDGE_CLASS:
            continue
        out.append(other)
    return tuple(sorted(out))


def assess(reading: IommuReading) -> IommuPosture:
    """The node's posture from its reading (pure; docs/security.md "DMA isolation")."""
    args = iommu_args(reading.cmdline)
    tenant = sorted(
        (fn for fn in reading.functions.values() if device_kind(fn.pci_class) is not None),
        key=lambda f: f.address,
    )
    devices = tuple(
        IommuDevice(
            address=fn.address,
            kind=device_kind(fn.pci_class) or "",
            group=fn.group,
            domain=reading.group_types.get(fn.group or "", "") if fn.group else "",
            peers=_peers(fn, reading) if fn.group else (),
            ats=ats_enabled(fn.config) if len(fn.config) > EXT_START else None,
            path=tuple(_bridge(b, reading.functions) for b in fn.path),
        )
        for fn in tenant
    )
    domains = {d.domain for d in devices if d.domain}
    mode = _mode(reading, domains)
    common = {
        "mode": mode,
        "iommus": reading.iommus,
        "cmdline": args,
        "groups": len(reading.group_members),
        "devices": devices,
    }
    off = _off_reasons(reading, args, devices)
    if off:
        return IommuPosture(posture="off", reasons=tuple(off), **common)  # type: ignore[arg-type]
    shared, unknown = _shared_reasons(devices)
    notes = [f"ATS enabled on {d.kind.upper()} {d.address}" for d in devices if d.ats]
    if shared:
        posture = "shared"
    elif unknown:
        posture = "unknown"
    else:
        posture = "isolated"
    reasons = (*shared, *unknown, *notes, *reading.problems)
    return IommuPosture(posture=posture, reasons=reasons, **common)  # type: ignore[arg-type]


def _mode(reading: IommuReading, domains: set[str]) -> str:
    if not reading.iommus and not reading.group_members:
        return "off"
    if "identity" in domains or passthrough_by_args(iommu_args(reading.cmdline)):
        return "identity"
    if "DMA" in domains:
        return "dma"
    if "DMA-FQ" in domains:
        return "dma-fq"
    return next(iter(sorted(d.lower() for d in domains)), "dma")


def _off_reasons(
    reading: IommuReading, args: Sequence[str], devices: Iterable[IommuDevice]
) -> list[str]:
    said = ", ".join(args) or "none"
    if not reading.iommus and not reading.group_members:
        return [f"no IOMMU: none registered (/sys/class/iommu), no groups; IOMMU args: {said}"]
    reasons = []
    if (why := passthrough_by_args(args)) is not None:
        reasons.append(f"passthrough: {why}")
    for d in devices:
        if d.group is None:
            reasons.append(f"{d.kind.upper()} {d.address} has no IOMMU group")
        elif d.domain == "identity":
            reasons.append(
                f"{d.kind.upper()} {d.address}: group {d.group} in identity (passthrough) mode"
            )
    return reasons


def _shared_reasons(devices: Iterable[IommuDevice]) -> tuple[list[str], list[str]]:
    shared: list[str] = []
    unknown: list[str] = []
    for d in devices:
        who = f"{d.kind.upper()} {d.address}"
        if d.peers:
            shared.append(f"{who} shares IOMMU group {d.group} with {', '.join(d.peers)}")
        for bridge in d.path:
            if not bridge.readable and bridge.port in ("", "downstream"):
                unknown.append(f"{who}: ACS of bridge {bridge.address} unreadable (not root?)")
                continue
            if bridge.port != "downstream":
                continue
            if bridge.acs_cap is None:
                shared.append(f"{who}: switch port {bridge.address} above it has no ACS")
            elif not Acs(_mask(bridge.acs_cap), _mask(bridge.acs_ctl or ())).redirects:
                off = [
                    b
                    for b in ACS_REDIRECT
                    if b in bridge.acs_cap and b not in (bridge.acs_ctl or ())
                ]
                shared.append(
                    f"{who}: ACS redirect off on switch port {bridge.address} above it "
                    f"({', '.join(b + '-' for b in off) or 'none of ' + '/'.join(ACS_REDIRECT)})"
                )
    return shared, unknown


def _mask(bits: Iterable[str]) -> int:
    return sum(1 << ACS_BITS.index(b) for b in bits)
