"""A node's DMA isolation posture (docs/security.md "DMA isolation"): whether the IOMMU
keeps each GPU's and NIC's DMA inside what its tenant owns.

``posture``: ``isolated`` (the IOMMU on in a translating mode, each GPU and NIC alone in
its IOMMU group or only with its own functions, ACS redirect on every switch downstream
port above it), ``shared`` (some device shares a group with another endpoint, or a switch
port above it lets peers reach each other: ``reasons`` name them), ``off`` (no IOMMU, or
passthrough: DMA is not translated), ``unknown`` (what decides it could not be read).
"""

from __future__ import annotations

from typing import Final, Literal

from metalguard.proto.base import NonNegInt, Record

Posture = Literal["isolated", "shared", "off", "unknown"]
POSTURES: Final[tuple[Posture, ...]] = ("isolated", "shared", "off", "unknown")
ACS_BITS: Final[tuple[str, ...]] = ("SV", "TB", "RR", "CR", "UF", "EC", "DT")
"""ACS capability/control bits 0-6 (PCIe base spec 7.7.8; lspci: SrcValid, TransBlk,
ReqRedir, CmpltRedir, UpstreamFwd, EgressCtrl, DirectTrans)."""
ACS_REDIRECT: Final[tuple[str, ...]] = ("SV", "RR", "CR", "UF")
"""The bits Linux requires on a port for its devices to get groups of their own
(``REQ_ACS_FLAGS``): peer-to-peer requests and completions go up to the IOMMU."""


class BridgeAcs(Record, frozen=True):
    """One bridge on the path from the root to a device, and its ACS."""

    address: str
    port: str = ""
    """The PCIe port type: ``root``, ``upstream``, ``downstream``, ``pcie-to-pci``, ...
    ("" unknown)."""
    acs_cap: tuple[str, ...] | None = None
    """The ACS bits the port has (None: no ACS capability, or its config unreadable)."""
    acs_ctl: tuple[str, ...] | None = None
    """The ACS bits enabled."""
    readable: bool = True
    """Whether the extended config space could be read (root reads 4096 bytes)."""


class IommuDevice(Record, frozen=True):
    """A GPU or NIC a tenant may be given, and what isolates it."""

    address: str
    kind: str
    """``gpu`` or ``nic`` (from the PCI class)."""
    group: str | None = None
    """Its IOMMU group (None: none)."""
    domain: str = ""
    """The group's default domain type: ``DMA``, ``DMA-FQ``, ``identity``, ..."""
    peers: tuple[str, ...] = ()
    """The other endpoints in its group that are not its own functions."""
    ats: bool | None = None
    """Address Translation Services enabled on it (None: no ATS capability or unreadable)."""
    path: tuple[BridgeAcs, ...] = ()
    """The bridges above it, from the root down."""


class IommuPosture(Record, frozen=True):
    """The node's posture and the evidence for it (``TelemetryBatch.iommu``)."""

    posture: Posture
    mode: str = ""
    """``dma``, ``dma-fq``, ``identity`` (passthrough) or ``off``."""
    iommus: tuple[str, ...] = ()
    """The IOMMUs the kernel registered (/sys/class/iommu: ``dmar0``, ``ivhd0``)."""
    cmdline: tuple[str, ...] = ()
    """The kernel arguments that set the IOMMU (``intel_iommu=on``, ``iommu=pt``, ...)."""
    groups: NonNegInt = 0
    reasons: tuple[str, ...] = ()
    """Why it is not ``isolated`` (empty when it is); notes (ATS enabled) too."""
    devices: tuple[IommuDevice, ...] = ()
