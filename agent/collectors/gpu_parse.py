"""Pure part of the gpu collector: NVML values in, readings and NodeEvents out.

Nothing here imports NVML: :class:`NvmlValues` holds what the calls of one GPU returned
(``None`` where a call is not supported), and the functions turn it into a
:class:`proto.telemetry.GpuDevice`, or an XID number into a graded ``gpu_xid`` event.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from metalguard.proto.base import AttrValue, NodeIdentity
from metalguard.proto.events import NodeEvent
from metalguard.proto.telemetry import GpuDevice, NvLinkErrors
from metalguard.proto.xid import XidEntry, classify


def xid_info(xid: int) -> XidEntry:
    """What NVIDIA's XID catalog says about ``xid``: its class, name, action and the
    severity of its event (``metalguard.proto.xid``; unlisted: ``contact_support``)."""
    return classify(xid)


THROTTLE_REASONS: Final[dict[int, str]] = {
    0x001: "gpu_idle",
    0x002: "applications_clocks_setting",
    0x004: "sw_power_cap",
    0x008: "hw_slowdown",
    0x010: "sync_boost",
    0x020: "sw_thermal_slowdown",
    0x040: "hw_thermal_slowdown",
    0x080: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
"""nvmlClocksThrottleReason* (nvmlClocksEventReason*) bits by name."""

GPU_IDLE_BIT: Final = 0x001


def throttle_names(mask: int | None) -> tuple[str, ...]:
    """Names of the bits set in a throttle-reason mask (unknown bits as ``bit<N>``)."""
    if not mask:
        return ()
    names = []
    for bit in range(mask.bit_length()):
        flag = 1 << bit
        if mask & flag:
            names.append(THROTTLE_REASONS.get(flag, f"bit{bit}"))
    return tuple(names)


def pcie_downgraded(
    gen: int | None,
    gen_max: int | None,
    width: int | None,
    width_max: int | None,
    *,
    idle: bool,
) -> bool:
    """A link narrower than its max, or slower than its max while the GPU is busy.

    An idle GPU drops its link generation to save power, so a lower generation counts
    only when the GPU is not idle; a lower width always counts.
    """
    if width is not None and width_max is not None and 0 < width < width_max:
        return True
    return not idle and gen is not None and gen_max is not None and 0 < gen < gen_max


@dataclass(frozen=True, slots=True)
class NvmlValues:
    """What NVML answered for one GPU; ``None`` where a call is unsupported or failed."""

    index: int
    uuid: str = ""
    name: str = ""
    pci_address: str = ""
    temperature_c: float | None = None
    power_mw: int | None = None
    ecc_sbe_volatile: int | None = None
    ecc_dbe_volatile: int | None = None
    ecc_sbe_aggregate: int | None = None
    ecc_dbe_aggregate: int | None = None
    retired_pages_sbe: int | None = None
    retired_pages_dbe: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows: tuple[int, int, int, int] | None = None
    """nvmlDeviceGetRemappedRows: (correctable, uncorrectable, pending, failure)."""
    pcie_replay_count: int | None = None
    pcie_link_gen: int | None = None
    pcie_link_gen_max: int | None = None
    pcie_link_width: int | None = None
    pcie_link_width_max: int | None = None
    nvlinks: dict[int, dict[str, int | None]] = field(default_factory=dict)
    """Per active link: ``replay``, ``recovery``, ``crc_flit``, ``crc_data``."""
    throttle_mask: int | None = None


def text(value: bytes | str) -> str:
    """NVML strings: bytes in older bindings, str in newer ones."""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def pci_address(bus_id: str) -> str:
    """NVML's ``00000000:41:00.0`` as sysfs writes it, ``0000:41:00.0``."""
    domain, sep, rest = bus_id.strip().lower().partition(":")
    if not sep:
        return bus_id.strip().lower()
    return f"{domain[-4:].rjust(4, '0')}:{rest}"


def _nonneg(value: int | None) -> int | None:
    return value if value is not None and value >= 0 else None


def _sum(a: int | None, b: int | None) -> int | None:
    return None if a is None and b is None else (a or 0) + (b or 0)


def gpu_device(v: NvmlValues, xids: tuple[int, ...] = ()) -> GpuDevice:
    """The GpuDevice reading of one GPU's NVML values and the XIDs the agent holds for it
    (``agent.collectors.gpu_xids``)."""
    rows = v.remapped_rows
    idle = bool(v.throttle_mask and v.throttle_mask & GPU_IDLE_BIT)
    return GpuDevice(
        index=v.index,
        uuid=v.uuid,
        name=v.name,
        pci_address=v.pci_address,
        temperature_c=v.temperature_c,
        power_w=v.power_mw / 1000.0 if v.power_mw is not None else None,
        ecc_corrected=_nonneg(v.ecc_sbe_volatile),
        ecc_uncorrected=_nonneg(v.ecc_dbe_volatile),
        retired_pages=_nonneg(_sum(v.retired_pages_sbe, v.retired_pages_dbe)),
        xid_errors=xids,
        ecc_sbe_volatile=_nonneg(v.ecc_sbe_volatile),
        ecc_dbe_volatile=_nonneg(v.ecc_dbe_volatile),
        ecc_sbe_aggregate=_nonneg(v.ecc_sbe_aggregate),
        ecc_dbe_aggregate=_nonneg(v.ecc_dbe_aggregate),
        retired_pages_sbe=_nonneg(v.retired_pages_sbe),
        retired_pages_dbe=_nonneg(v.retired_pages_dbe),
        retired_pages_pending=v.retired_pages_pending,
        remapped_rows_correctable=_nonneg(rows[0]) if rows else None,
        remapped_rows_uncorrectable=_nonneg(rows[1]) if rows else None,
        row_remap_pending=bool(rows[2]) if rows else None,
        row_remap_failure=bool(rows[3]) if rows else None,
        pcie_replay_count=_nonneg(v.pcie_replay_count),
        pcie_link_gen=_nonneg(v.pcie_link_gen),
        pcie_link_gen_max=_nonneg(v.pcie_link_gen_max),
        pcie_link_width=_nonneg(v.pcie_link_width),
        pcie_link_width_max=_nonneg(v.pcie_link_width_max),
        pcie_downgraded=pcie_downgraded(
            v.pcie_link_gen,
            v.pcie_link_gen_max,
            v.pcie_link_width,
            v.pcie_link_width_max,
            idle=idle,
        ),
        nvlinks=tuple(
            NvLinkErrors(
                link=link,
                replay=_nonneg(c.get("replay")),
                recovery=_nonneg(c.get("recovery")),
                crc_flit=_nonneg(c.get("crc_flit")),
                crc_data=_nonneg(c.get("crc_data")),
            )
            for link, c in sorted(v.nvlinks.items())
        ),
        throttle_reasons=throttle_names(v.throttle_mask),
    )


def xid_event(
    xid: int,
    *,
    node: NodeIdentity,
    ts: float,
    event_id: str,
    gpu_index: int | None,
    uuid: str = "",
    pci_address: str = "",
) -> NodeEvent:
    """The ``gpu_xid`` NodeEvent of one XID critical error, graded by NVIDIA's XID catalog
    (:func:`xid_info`)."""
    info = xid_info(xid)
    device = f"gpu{gpu_index}" if gpu_index is not None else (uuid or "gpu")
    attributes: dict[str, AttrValue] = {
        "xid": xid,
        "name": info.name,
        "action": info.action,
        "class": info.xid_class,
        "known": info.listed,
        "index": gpu_index,
        "uuid": uuid,
        "pci_address": pci_address,
    }
    return NodeEvent(
        node=node,
        event_id=event_id,
        ts=ts,
        kind="gpu_xid",
        source="gpu",
        device=device,
        severity=info.severity,
        message=f"XID {xid} on {device}: {info.name} ({info.action})",
        attributes=attributes,
    )
