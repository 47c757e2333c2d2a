"""Which readings must not wait for the next batch: pure detection of NodeEvents.

Counters (ECC, AER) raise an event when they grow between two batches of this agent
run; the first batch is the baseline, since totals read at start are history.  States
(a downgraded link, a failed SMART verdict) raise one when they become true, including
on the first batch: they are facts about now.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from metalguard.proto.base import AttrValue
from metalguard.proto.events import NodeEvent
from metalguard.proto.iommu import IommuPosture
from metalguard.proto.telemetry import (
    EdacController,
    GpuDevice,
    PcieDevice,
    SmartDevice,
    TelemetryBatch,
)

SEVERITIES = {"iommu_posture": "warning"}
"""Kinds whose events are not critical (a posture change is for the scheduler and an
operator, not a fault of the node)."""


def detect_events(
    previous: TelemetryBatch | None,
    current: TelemetryBatch,
    new_id: Callable[[], str] | None = None,
) -> list[NodeEvent]:
    """Events for what changed from ``previous`` to ``current`` (both of one node).

    ``new_id`` makes event ids (default: ``<seq>-<index>``, unique per batch).
    """
    found: list[tuple[str, str, str, str, dict[str, AttrValue]]] = []
    if previous is not None:
        found += _ecc(previous.edac, current.edac)
        found += _aer(previous.pcie, current.pcie)
    found += _links(previous.pcie if previous else (), current.pcie)
    found += _smart(previous.smart if previous else (), current.smart)
    found += _gpu(previous.gpu if previous else None, current.gpu)
    found += _iommu(previous.iommu if previous else None, current.iommu)
    return [
        NodeEvent(
            node=current.node,
            event_id=new_id() if new_id else f"{current.seq}-{i}",
            ts=current.ts,
            kind=kind,
            source=source,
            device=device,
            message=message,
            attributes=attrs,
            severity=SEVERITIES.get(kind, "critical"),
        )
        for i, (kind, source, device, message, attrs) in enumerate(found)
    ]


def _iommu(
    before: IommuPosture | None, after: IommuPosture | None
) -> Iterator[tuple[str, str, str, str, dict[str, AttrValue]]]:
    """``iommu_posture`` when the DMA isolation posture changes (not at the first reading:
    the batch carries it; docs/security.md "DMA isolation")."""
    if before is None or after is None or before.posture == after.posture:
        return
    why = "; ".join(after.reasons) or "every GPU and NIC isolated"
    yield (
        "iommu_posture",
        "iommu",
        "",
        f"DMA isolation {before.posture} -> {after.posture}: {why}"[:1000],
        {"from": before.posture, "to": after.posture, "mode": after.mode},
    )


def _grew(before: int | None, after: int | None) -> int:
    if after is None:
        return 0
    return after - (before or 0) if after > (before or 0) else 0


def _ecc(
    before: tuple[EdacController, ...], after: tuple[EdacController, ...]
) -> Iterator[tuple[str, str, str, str, dict[str, AttrValue]]]:
    old = {mc.mc: mc for mc in before}
    for mc in after:
        prev = old.get(mc.mc)
        if prev is None:
            continue
        old_dimms = {d.name: d for d in prev.dimms}
        dimm_hits = False
        for dimm in mc.dimms:
            grew = _grew(
                old_dimms[dimm.name].ue_count if dimm.name in old_dimms else 0, dimm.ue_count
            )
            if grew:
                dimm_hits = True
                yield (
                    "ecc_uncorrectable",
                    "edac",
                    dimm.label or f"mc{mc.mc}/{dimm.name}",
                    f"{grew} new uncorrectable ECC error(s) on {dimm.label or dimm.name}",
                    {"mc": mc.mc, "dimm": dimm.name, "new": grew, "ue_count": dimm.ue_count},
                )
        grew = _grew(prev.ue_count, mc.ue_count)
        if grew and not dimm_hits:
            yield (
                "ecc_uncorrectable",
                "edac",
                f"mc{mc.mc}",
                f"{grew} new uncorrectable ECC error(s) on memory controller {mc.mc}",
                {"mc": mc.mc, "new": grew, "ue_count": mc.ue_count},
            )


def _aer(
    before: tuple[PcieDevice, ...], after: tuple[PcieDevice, ...]
) -> Iterator[tuple[str, str, str, str, dict[str, AttrValue]]]:
    old = {d.address: d for d in before}
    for dev in after:
        prev = old.get(dev.address)
        if dev.aer is None or prev is None or prev.aer is None:
            continue
        for kind, new, was in (
            ("aer_fatal", dev.aer.fatal, prev.aer.fatal),
            ("aer_nonfatal", dev.aer.nonfatal, prev.aer.nonfatal),
        ):
            grown = {name: n - was.get(name, 0) for name, n in new.items() if n > was.get(name, 0)}
            if grown:
                names = ", ".join(sorted(k for k in grown if not k.startswith("TOTAL_")))
                label = "fatal" if kind == "aer_fatal" else "non-fatal"
                yield (
                    kind,
                    "pcie",
                    dev.address,
                    f"new {label} AER error(s) on {dev.address}: {names or 'TOTAL'}",
                    {f"new_{k}": v for k, v in grown.items()},
                )


def _links(
    before: tuple[PcieDevice, ...], after: tuple[PcieDevice, ...]
) -> Iterator[tuple[str, str, str, str, dict[str, AttrValue]]]:
    old = {d.address: d for d in before}
    for dev in after:
        prev = old.get(dev.address)
        if dev.downgraded and (prev is None or not prev.downgraded):
            yield (
                "link_downgrade",
                "pcie",
                dev.address,
                f"PCIe link of {dev.address} runs at {dev.current_link_speed_gts} GT/s "
                f"x{dev.current_link_width} of max {dev.max_link_speed_gts} GT/s "
                f"x{dev.max_link_width}",
                {
                    "class": dev.pci_class,
                    "current_link_speed_gts": dev.current_link_speed_gts,
                    "max_link_speed_gts": dev.max_link_speed_gts,
                    "current_link_width": dev.current_link_width,
                    "max_link_width": dev.max_link_width,
                },
            )


def _smart(
    before: tuple[SmartDevice, ...], after: tuple[SmartDevice, ...]
) -> Iterator[tuple[str, str, str, str, dict[str, AttrValue]]]:
    old = {d.device: d for d in before}
    for disk in after:
        prev = old.get(disk.device)
        if disk.passed is False and (prev is None or prev.passed is not False):
            yield (
                "smart_failed",
                "smart",
                disk.device,
                f"SMART overall health of {disk.device} ({disk.model}) is FAILED",
                {"model": disk.model, "critical_warning": disk.critical_warning},
            )


def _gpu(
    before: tuple[GpuDevice, ...] | None, after: tuple[GpuDevice, ...]
) -> Iterator[tuple[str, str, str, str, dict[str, AttrValue]]]:
    """New double-bit ECC errors (counter), row-remap failure and PCIe downgrade (states)."""
    old = {g.index: g for g in before or ()}
    for gpu in after:
        prev = old.get(gpu.index)
        device = f"gpu{gpu.index}"
        ident: dict[str, AttrValue] = {"index": gpu.index, "uuid": gpu.uuid}
        if before is not None and prev is not None:
            grew = _grew(prev.ecc_dbe_volatile, gpu.ecc_dbe_volatile)
            if grew:
                yield (
                    "gpu_ecc_dbe",
                    "gpu",
                    device,
                    f"{grew} new double-bit (uncorrectable) ECC error(s) on {device}",
                    {**ident, "new": grew, "ecc_dbe_volatile": gpu.ecc_dbe_volatile},
                )
        if gpu.row_remap_failure and (prev is None or not prev.row_remap_failure):
            yield (
                "gpu_row_remap_failure",
                "gpu",
                device,
                f"row remapping failed on {device}: the GPU needs service",
                {
                    **ident,
                    "remapped_rows_uncorrectable": gpu.remapped_rows_uncorrectable,
                    "row_remap_pending": gpu.row_remap_pending,
                },
            )
        if gpu.pcie_downgraded and (prev is None or not prev.pcie_downgraded):
            yield (
                "gpu_pcie_downgrade",
                "gpu",
                device,
                f"PCIe link of {device} runs at gen {gpu.pcie_link_gen} x{gpu.pcie_link_width}"
                f" of max gen {gpu.pcie_link_gen_max} x{gpu.pcie_link_width_max}",
                {
                    **ident,
                    "pci_address": gpu.pci_address,
                    "pcie_link_gen": gpu.pcie_link_gen,
                    "pcie_link_gen_max": gpu.pcie_link_gen_max,
                    "pcie_link_width": gpu.pcie_link_width,
                    "pcie_link_width_max": gpu.pcie_link_width_max,
                },
            )
