"""Pure parsing for the ``rdma`` collector: the texts of one InfiniBand/RoCE port's sysfs
files in, an :class:`RdmaPort` and the files that held no value out.

The kernel's forms (drivers/infiniband/core/sysfs.c): ``state`` and ``phys_state`` read
``4: ACTIVE`` / ``5: LinkUp`` (a number, a colon, a name that may hold spaces:
``7: Phy Test``); ``rate`` reads ``200 Gb/sec (4X HDR)`` or ``2.5 Gb/sec (1X SDR)``;
every counter file one decimal number, except on devices without a performance
management agent, which write ``N/A (no PMA)``: that file is an issue, never a number.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from metalguard.proto.telemetry import RdmaPort

COUNTER_BITS: Final[dict[str, int]] = {
    "symbol_error": 16,
    "link_error_recovery": 8,
    "link_downed": 8,
    "port_rcv_errors": 16,
    "port_rcv_remote_physical_errors": 16,
    "port_rcv_switch_relay_errors": 16,
    "port_xmit_discards": 16,
    "port_xmit_constraint_errors": 8,
    "port_rcv_constraint_errors": 8,
    "local_link_integrity_errors": 4,
    "excessive_buffer_overrun_errors": 4,
    "VL15_dropped": 16,
    "port_xmit_data": 32,
    "port_rcv_data": 32,
    "port_xmit_packets": 32,
    "port_rcv_packets": 32,
    "port_xmit_wait": 32,
    "unicast_xmit_packets": 64,
    "unicast_rcv_packets": 64,
    "multicast_xmit_packets": 64,
    "multicast_rcv_packets": 64,
}
"""Widths of the ``counters/`` files (IBA PortCounters, PortCountersExtended): a PMA
counter stops at its maximum, it does not wrap.  ``counters_ext/`` counters are 64-bit."""

EXT_BITS: Final = 64
"""The width of every ``counters_ext/`` counter."""

DATA_WORD_BYTES: Final = 4
"""``port_rcv_data``/``port_xmit_data`` count 4-octet words (IBA: "divided by 4")."""

UINT64_MAX: Final = (1 << 64) - 1
"""The largest value the wire format carries."""

BYTES_FROM: Final = {
    "rx_bytes": ("port_rcv_data", "port_rcv_data_64"),
    "tx_bytes": ("port_xmit_data", "port_xmit_data_64"),
}
"""The derived byte counts and their sources: the 64-bit ``counters_ext/`` file where
there is one (kernels before 4.5), else the ``counters/`` one."""

_STATE_RE = re.compile(r"^\s*(\d+)\s*:\s*(\S(?:.*\S)?)\s*$")
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*Gb/sec\b")
_COUNTER_RE = re.compile(r"^\d+$")

Issue = tuple[str, str]
"""A file that held no value: (its path below the device's directory, message)."""


def parse_state(text: str) -> tuple[int, str]:
    """(id, name) from ``4: ACTIVE`` or ``7: Phy Test``; ValueError for anything else."""
    match = _STATE_RE.match(text)
    if match is None:
        raise ValueError(f"not a port state: {text.strip()[:40]!r}")
    return int(match[1]), match[2]


def parse_rate(text: str) -> float | None:
    """Gb/s from ``200 Gb/sec (4X HDR)``; None for an empty file; ValueError otherwise."""
    if not text.strip():
        return None
    match = _RATE_RE.match(text)
    if match is None:
        raise ValueError(f"not a rate: {text.strip()[:40]!r}")
    return float(match[1])


def parse_counter(text: str) -> int | None:
    """A counter's raw value; None for an empty file; ValueError for ``N/A (no PMA)`` and
    anything else that is not one unsigned 64-bit decimal number."""
    value = text.strip()
    if not value:
        return None
    if not _COUNTER_RE.match(value) or int(value) > UINT64_MAX:
        raise ValueError(f"not a counter: {value[:40]!r}")
    return int(value)


def parse_counters(files: Mapping[str, str], folder: str) -> tuple[dict[str, int], list[Issue]]:
    """Every counter of one folder (``ports/1/counters``), keyed by kernel name, and the
    files that held no number (their issue paths start with ``folder``)."""
    counters: dict[str, int] = {}
    issues: list[Issue] = []
    for name, text in files.items():
        try:
            value = parse_counter(text)
        except ValueError as exc:
            issues.append((f"{folder}/{name}", str(exc)))
            continue
        if value is not None:
            counters[name] = value
    return counters, issues


def saturated(counters: Mapping[str, int], counters_ext: Mapping[str, int]) -> tuple[str, ...]:
    """Names of the counters at their width's maximum (``counters/`` names by
    :data:`COUNTER_BITS`, then ``counters_ext/`` names at 64 bits), sorted."""
    found = {n for n, v in counters.items() if n in COUNTER_BITS and v == _max(COUNTER_BITS[n])}
    found |= {n for n, v in counters_ext.items() if v == _max(EXT_BITS)}
    return tuple(sorted(found))


def _max(bits: int) -> int:
    return (1 << bits) - 1


def data_bytes(
    counters: Mapping[str, int], counters_ext: Mapping[str, int], name: str, ext_name: str
) -> int | None:
    """Octets from a data counter in 4-octet words: ``counters_ext/<ext_name>`` x 4 where
    it exists (the 64-bit counter of kernels before 4.5, whose ``counters/`` one is 32-bit
    and stops at its maximum), else ``counters/<name>`` x 4 (64-bit backed since 4.5);
    None when neither is there (or the product does not fit 64 bits)."""
    words = counters_ext.get(ext_name, counters.get(name))
    if words is None or words * DATA_WORD_BYTES > UINT64_MAX:
        return None
    return words * DATA_WORD_BYTES


@dataclass(frozen=True, slots=True)
class DeviceFiles:
    """The texts read from one device's directory (None: the file is absent)."""

    name: str
    board_id: str | None = None
    fw_ver: str | None = None
    hca_type: str | None = None
    hw_counters: Mapping[str, str] = field(default_factory=dict)
    """``<device>/hw_counters/*`` by file name."""


@dataclass(frozen=True, slots=True)
class PortFiles:
    """The texts read from one port's directory (None: the file is absent)."""

    port: int
    state: str | None = None
    phys_state: str | None = None
    rate: str | None = None
    link_layer: str | None = None
    counters: Mapping[str, str] = field(default_factory=dict)
    counters_ext: Mapping[str, str] = field(default_factory=dict)
    hw_counters: Mapping[str, str] = field(default_factory=dict)
    netdev: str = ""
    """The bound network interface, as the reader found it ("" when none)."""


def parse_device_counters(device: DeviceFiles) -> tuple[dict[str, int], list[Issue]]:
    """The device-level ``hw_counters/`` and their issues (parsed once per device)."""
    return parse_counters(device.hw_counters, "hw_counters")


def parse_port(
    device: DeviceFiles,
    files: PortFiles,
    device_hw_counters: Mapping[str, int] | None = None,
) -> tuple[RdmaPort, list[Issue]]:
    """One port's reading from its files' texts, plus the files that held no value.

    ``device_hw_counters``: the device-level counters already parsed (by
    :func:`parse_device_counters`); None parses them here, issues included.  A state,
    phys_state or rate that does not parse is an issue and an empty/null field; the
    other fields still stand.
    """
    issues: list[Issue] = []
    base = f"ports/{files.port}"
    state_id, state = _state(files.state, f"{base}/state", issues)
    phys_id, phys = _state(files.phys_state, f"{base}/phys_state", issues)
    rate: float | None = None
    if files.rate is not None:
        try:
            rate = parse_rate(files.rate)
        except ValueError as exc:
            issues.append((f"{base}/rate", str(exc)))
    counters, bad = parse_counters(files.counters, f"{base}/counters")
    issues += bad
    counters_ext, bad = parse_counters(files.counters_ext, f"{base}/counters_ext")
    issues += bad
    hw, bad = parse_counters(files.hw_counters, f"{base}/hw_counters")
    issues += bad
    if device_hw_counters is None:
        device_hw_counters, bad = parse_device_counters(device)
        issues += bad
    port = RdmaPort(
        device=device.name,
        port=files.port,
        state=state,
        state_id=state_id,
        phys_state=phys,
        phys_state_id=phys_id,
        rate_gbps=rate,
        link_layer=(files.link_layer or "").strip(),
        netdev=files.netdev,
        board_id=(device.board_id or "").strip(),
        fw_ver=(device.fw_ver or "").strip(),
        hca_type=(device.hca_type or "").strip(),
        counters=counters,
        counters_ext=counters_ext,
        hw_counters=hw,
        device_hw_counters=dict(device_hw_counters),
        saturated=saturated(counters, counters_ext),
        rx_bytes=data_bytes(counters, counters_ext, *BYTES_FROM["rx_bytes"]),
        tx_bytes=data_bytes(counters, counters_ext, *BYTES_FROM["tx_bytes"]),
    )
    return port, issues


def _state(text: str | None, path: str, issues: list[Issue]) -> tuple[int | None, str]:
    if text is None or not text.strip():
        return None, ""
    try:
        return parse_state(text)
    except ValueError as exc:
        issues.append((path, str(exc)))
        return None, ""


def parse_netdev_name(text: str) -> str:
    """A ``gid_attrs/ndevs/<i>`` file's interface name ("" when it holds none)."""
    value = text.strip()
    return value if value and not any(c.isspace() for c in value) else ""


def choose_netdev(port: int, gid_netdev: str, candidates: Mapping[str, int | None]) -> str:
    """The interface a port is bound to.

    ``gid_netdev``: the name in ``ports/<port>/gid_attrs/ndevs/0`` (RoCE: the default GID's
    interface), which wins.  ``candidates``: the interfaces of the device's parent
    (``<device>/device/net/*``) with their ``dev_port`` (0-based port index; None when
    unreadable).  The one whose ``dev_port`` is ``port - 1``; else the only one when none
    says its port; else "" (no guessing between several).
    """
    if gid_netdev:
        return gid_netdev
    matches = [name for name, dev_port in candidates.items() if dev_port == port - 1]
    if len(matches) == 1:
        return matches[0]
    if len(candidates) == 1 and all(d is None for d in candidates.values()):
        return next(iter(candidates))
    return ""
