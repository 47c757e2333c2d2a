"""Pure parsing for the ``netdev`` collector: sysfs statistics, ``ethtool -S`` output,
tc class handles and the ECN-mark counters of leaf qdiscs."""

from __future__ import annotations

import fnmatch
import re
import struct
from collections.abc import Iterable, Mapping

STAT_FILES = (
    "rx_bytes",
    "tx_bytes",
    "rx_packets",
    "tx_packets",
    "rx_dropped",
    "tx_dropped",
    "rx_errors",
    "tx_errors",
)
"""The files of ``/sys/class/net/<if>/statistics`` the collector reads."""

DEFAULT_EXCLUDE = ("lo",)
"""Interfaces skipped unless ``netdev.exclude`` says otherwise."""

_STAT_LINE = re.compile(r"^\s*([^:]+?):\s*(\d+)\s*$")
_PRIO_PAUSE = re.compile(r"^(rx|tx)_prio(\d)_pause$")
_PHY_PAUSE = re.compile(r"^(rx|tx)_pause_ctrl_phy$")
_GLOBAL_PAUSE = re.compile(r"^(rx|tx)_(?:global_)?pause(?:_frames)?$")
_COUNTER = re.compile(r"^\d+$")


def parse_counter(text: str) -> int:
    """A decimal counter from a sysfs file; ValueError for anything else."""
    value = text.strip()
    if not _COUNTER.match(value):
        raise ValueError(f"not a counter: {value[:40]!r}")
    return int(value)


def parse_ethtool_stats(text: str) -> dict[str, int]:
    """Every ``name: value`` counter of ``ethtool -S IF`` output (other lines ignored).

    ``no stats available`` (and any output without counters) gives ``{}``.
    """
    counters: dict[str, int] = {}
    for line in text.splitlines():
        match = _STAT_LINE.match(line)
        if match is not None:
            counters[match[1]] = int(match[2])
    return counters


def pause_counters(stats: Mapping[str, int]) -> dict[str, int]:
    """The pause-frame counters among ethtool statistics (durations and transitions too)."""
    return {name: n for name, n in stats.items() if "pause" in name}


def pause_totals(pause: Mapping[str, int]) -> tuple[int | None, int | None]:
    """(received, sent) pause frames; None for a direction the NIC does not count.

    mlx5 counts every pause frame at the PHY (``rx_pause_ctrl_phy``) and per priority
    (``rx_prio3_pause``): the PHY counter wins, else the per-priority ones are summed,
    else a global counter (``rx_pause``, ``rx_global_pause``) is used. Durations and
    transitions are not frames and never count.
    """

    def total(direction: str) -> int | None:
        phy = [n for k, n in pause.items() if (m := _PHY_PAUSE.match(k)) and m[1] == direction]
        if phy:
            return sum(phy)
        prio = [n for k, n in pause.items() if (m := _PRIO_PAUSE.match(k)) and m[1] == direction]
        if prio:
            return sum(prio)
        glob = [n for k, n in pause.items() if (m := _GLOBAL_PAUSE.match(k)) and m[1] == direction]
        return sum(glob) if glob else None

    return total("rx"), total("tx")


def classid(handle: int) -> str:
    """A tc handle as tc prints it: ``major:minor`` in hex (0x10010 -> ``1:10``)."""
    return f"{handle >> 16:x}:{handle & 0xFFFF:x}"


def ecn_marks(kind: str, xstats: bytes | None) -> int | None:
    """Packets ECN-marked, from a leaf qdisc's raw ``TCA_XSTATS``; None if it has none.

    ``red``: ``struct tc_red_xstats {u32 early, pdrop, other, marked}``;
    ``fq_codel``: ``struct tc_fq_codel_xstats {u32 type; u32 maxpacket, drop_overlimit,
    ecn_mark, ...}`` (type 0 = qdisc stats); ``choke``/``pie``/``fq_pie`` likewise name it.
    """
    if not xstats:
        return None
    offsets = {"red": 12, "choke": 12, "fq_codel": 12}
    offset = offsets.get(kind)
    if offset is None or len(xstats) < offset + 4:
        return None
    if kind == "fq_codel" and struct.unpack_from("=I", xstats, 0)[0] != 0:
        return None
    value: int = struct.unpack_from("=I", xstats, offset)[0]
    return value


def selected(name: str, include: Iterable[str], exclude: Iterable[str]) -> bool:
    """Whether interface ``name`` is collected: it matches an ``include`` pattern (all
    when none is given) and no ``exclude`` pattern (shell patterns, ``veth*``)."""
    patterns = tuple(include)
    if patterns and not any(fnmatch.fnmatchcase(name, p) for p in patterns):
        return False
    return not any(fnmatch.fnmatchcase(name, p) for p in exclude)
