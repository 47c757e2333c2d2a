"""Network health: per-interface counters, tc class statistics and PFC pause counters.

Every cycle (it is cheap): ``class/net/<if>/statistics`` for rx/tx bytes, packets, drops
and errors; the tc classes of each interface over netlink (pyroute2) with bytes, packets,
drops, overlimits and the ECN marks of RED/fq_codel leaves; and ``ethtool -S IF`` for the
pause counters of NICs that expose them. A missing ethtool, ``no stats available`` or an
interface without classes gives no counters, never an error.

Options (``[collect.options]``, docs/collectors.md): ``netdev.include`` / ``netdev.exclude``
(shell patterns; default all but ``lo``), ``netdev.ethtool`` (``devices``: interfaces with
a device behind them, the default; ``all``; ``none``), ``netdev.tc`` (default true),
``netdev.lossless_classes`` (classids counted as lossless, e.g. ``["1:10"]``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from metalguard.agent.collectors.base import BatchField, Collected, CollectorSettings, register
from metalguard.agent.collectors.netdev_parse import (
    DEFAULT_EXCLUDE,
    STAT_FILES,
    classid,
    ecn_marks,
    parse_counter,
    parse_ethtool_stats,
    pause_counters,
    pause_totals,
    selected,
)
from metalguard.agent.sysfs import ReadStatus, SysfsReader, run_scan
from metalguard.proto.telemetry import CollectorError, NetInterface, TcClassStats
from metalguard.runtime.deadlines import within

log = logging.getLogger(__name__)

NAME = "netdev"
NET_DIR = "class/net"
ETHTOOL_TIMEOUT_S = 2.0

EthtoolMode = Literal["devices", "all", "none"]


@dataclass(frozen=True, slots=True)
class ClassLabel:
    """What a tc class serves, as the QoS reconciler that made it knows."""

    name: str
    lossless: bool = False


_LABELS: dict[str, dict[str, ClassLabel]] = {}


def set_class_labels(interface: str, labels: Mapping[str, ClassLabel]) -> None:
    """Name the tc classes of ``interface`` (by classid) in later readings; the agent's
    QoS reconciler calls it after applying a profile (an empty mapping forgets them)."""
    if labels:
        _LABELS[interface] = dict(labels)
    else:
        _LABELS.pop(interface, None)


@dataclass(frozen=True, slots=True)
class _Sysfs:
    name: str
    counters: dict[str, int]
    has_device: bool


def scan_interfaces(
    reader: SysfsReader, include: Sequence[str], exclude: Sequence[str]
) -> tuple[list[_Sysfs], list[CollectorError]]:
    """The selected interfaces' statistics files and whether a device backs them
    (blocking I/O). A missing statistics file is no value; an unparsable one an error."""
    errors: list[CollectorError] = []
    listing = reader.listdir(NET_DIR)
    if listing.status is ReadStatus.MISSING:
        return [], errors
    if listing.error is not None:
        errors.append(
            CollectorError(collector=NAME, path=reader.display(NET_DIR), message=listing.error)
        )
    found = []
    for name in listing.names:
        if not selected(name, include, exclude):
            continue
        base = f"{NET_DIR}/{name}"
        if not reader.is_dir(base):  # bonding_masters and other plain files
            continue
        counters: dict[str, int] = {}
        for file, result in reader.read_files(f"{base}/statistics", STAT_FILES).items():
            if result.status is ReadStatus.OK and result.text is not None:
                try:
                    counters[file] = parse_counter(result.text)
                except ValueError as exc:
                    path = reader.display(f"{base}/statistics/{file}")
                    errors.append(CollectorError(collector=NAME, path=path, message=str(exc)))
            elif result.status is ReadStatus.ERROR:
                path = reader.display(f"{base}/statistics/{file}")
                errors.append(CollectorError(collector=NAME, path=path, message=result.error or ""))
        has_device = reader.readlink(f"{base}/device") is not None
        found.append(_Sysfs(name, counters, has_device))
    return found, errors


async def read_ethtool(ethtool: str, interface: str) -> dict[str, int]:
    """``ethtool -S interface`` counters; {} when it fails, times out or has no stats."""
    try:
        proc = await asyncio.create_subprocess_exec(
            ethtool,
            "-S",
            interface,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
    except OSError:
        return {}
    try:
        out, _ = await within(proc.communicate(), ETHTOOL_TIMEOUT_S)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        return {}
    if proc.returncode != 0:
        return {}
    return parse_ethtool_stats(out.decode("utf-8", "replace"))


async def read_tc(names: Sequence[str]) -> tuple[dict[str, list[TcClassStats]], str | None]:
    """The tc classes of the named interfaces of this network namespace, with the ECN
    marks of their leaf qdiscs; (what was read, an error message or None)."""
    from pyroute2 import AsyncIPRoute  # heavy: imported only when the collector runs

    found: dict[str, list[TcClassStats]] = {}
    try:
        async with AsyncIPRoute() as ipr:
            links = [link async for link in await ipr.link("dump")]
            indexes = {link.get_attr("IFLA_IFNAME"): int(link["index"]) for link in links}
            for name in names:
                index = indexes.get(name)
                if index is None:
                    continue
                classes = [c async for c in await ipr.tc("dump-class", index=index)]
                if not classes:
                    continue
                qdiscs = [q async for q in await ipr.tc("dump", index=index)]
                found[name] = class_stats(classes, qdiscs)
    except Exception as exc:  # netlink errors, a vanished interface: the rest still counts
        return found, f"tc statistics: {type(exc).__name__}: {exc}"
    return found, None


def class_stats(classes: Sequence[Any], qdiscs: Sequence[Any]) -> list[TcClassStats]:
    """TcClassStats from pyroute2 tcmsg class and qdisc messages (no I/O)."""
    leaves: dict[int, Any] = {}
    for q in qdiscs:
        leaves.setdefault(int(q.get("parent") or 0), q)
    out = []
    for c in sorted(classes, key=lambda c: int(c.get("handle") or 0)):
        handle = int(c.get("handle") or 0)
        stats2 = c.get_attr("TCA_STATS2")
        basic = (stats2.get_attr("TCA_STATS_BASIC") if stats2 else None) or {}
        queue = (stats2.get_attr("TCA_STATS_QUEUE") if stats2 else None) or {}
        leaf = leaves.get(handle)
        marks = None
        if leaf is not None:
            marks = leaf_marks(str(leaf.get_attr("TCA_KIND") or ""), leaf.get_attr("TCA_XSTATS"))
        out.append(
            TcClassStats(
                classid=classid(handle),
                kind=str(c.get_attr("TCA_KIND") or ""),
                bytes=int(basic.get("bytes", 0)),
                packets=int(basic.get("packets", 0)),
                drops=int(queue.get("drops", 0)),
                overlimits=int(queue.get("overlimits", 0)),
                ecn_marks=marks,
            )
        )
    return out


def leaf_marks(kind: str, xstats: Any) -> int | None:
    """ECN marks from a leaf qdisc's TCA_XSTATS as pyroute2 gives it: decoded fields
    (``marked`` of choke, ``ecn_mark`` of fq_codel), or raw bytes / a hex string for the
    kinds it has no plugin for (red)."""
    if isinstance(xstats, Mapping):
        for field in ("marked", "ecn_mark"):
            value = xstats.get(field)
            if isinstance(value, int):
                return value
        return None
    return ecn_marks(kind, _raw(xstats))


def _raw(xstats: Any) -> bytes | None:
    """Undecoded TCA_XSTATS as bytes (pyroute2 shows them as ``00:01:...``)."""
    if isinstance(xstats, bytes | bytearray):
        return bytes(xstats)
    if isinstance(xstats, str):
        with contextlib.suppress(ValueError):
            return bytes.fromhex(xstats.replace(":", "").removeprefix("0x"))
    return None


def interface(
    sysfs: _Sysfs,
    ethtool_stats: Mapping[str, int],
    classes: Sequence[TcClassStats],
    labels: Mapping[str, ClassLabel],
    lossless: Sequence[str],
) -> NetInterface:
    """One interface's reading from its parts (pure)."""
    pause = pause_counters(ethtool_stats)
    rx_pause, tx_pause = pause_totals(pause)
    named = []
    for tc in classes:
        label = labels.get(tc.classid)
        named.append(
            TcClassStats(
                classid=tc.classid,
                kind=tc.kind,
                name=label.name if label else "",
                lossless=(label.lossless if label else False) or tc.classid in lossless,
                bytes=tc.bytes,
                packets=tc.packets,
                drops=tc.drops,
                overlimits=tc.overlimits,
                ecn_marks=tc.ecn_marks,
            )
        )
    c = sysfs.counters
    return NetInterface(
        name=sysfs.name,
        rx_bytes=c.get("rx_bytes"),
        tx_bytes=c.get("tx_bytes"),
        rx_packets=c.get("rx_packets"),
        tx_packets=c.get("tx_packets"),
        rx_dropped=c.get("rx_dropped"),
        tx_dropped=c.get("tx_dropped"),
        rx_errors=c.get("rx_errors"),
        tx_errors=c.get("tx_errors"),
        rx_pause=rx_pause,
        tx_pause=tx_pause,
        pause=pause,
        tc_classes=tuple(named),
    )


def _options(options: Mapping[str, object]) -> dict[str, object]:
    """``netdev.*`` options, given as dotted keys or as a ``[collect.options.netdev]``
    table, keyed ``netdev.<key>``."""
    table = options.get(NAME)
    nested = {f"{NAME}.{k}": v for k, v in table.items()} if isinstance(table, dict) else {}
    return {**nested, **{k: v for k, v in options.items() if k.startswith(f"{NAME}.")}}


def _strings(value: object, default: Sequence[str], key: str) -> tuple[str, ...]:
    if value is None:
        return tuple(default)
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ValueError(f"collect.options: {key}: expected a list of strings")


@register(NAME, default_interval_s=5)
class NetdevCollector:
    """Interface counters, tc class statistics and PFC pause counters."""

    name = NAME
    field: BatchField = "net"

    def __init__(self, settings: CollectorSettings, *, reader: SysfsReader | None = None) -> None:
        options = _options(settings.options)
        self._reader = reader or SysfsReader(settings.sysfs)
        self._include = _strings(options.get("netdev.include"), (), "netdev.include")
        self._exclude = _strings(options.get("netdev.exclude"), DEFAULT_EXCLUDE, "netdev.exclude")
        self._lossless = _strings(
            options.get("netdev.lossless_classes"), (), "netdev.lossless_classes"
        )
        live = settings.sysfs == Path("/sys")  # tc and ethtool see the live kernel only
        mode = options.get("netdev.ethtool", "devices" if live else "none")
        if mode not in ("devices", "all", "none"):
            raise ValueError("collect.options: netdev.ethtool: expected devices, all or none")
        self._ethtool_mode: EthtoolMode = mode
        self._ethtool = str(options.get("netdev.ethtool_path", "ethtool"))
        self._tc = bool(options.get("netdev.tc", live))

    async def collect(self) -> Collected:
        """Read every selected interface once."""
        found, errors = await run_scan(
            lambda r: scan_interfaces(r, self._include, self._exclude), self._reader
        )
        classes: dict[str, list[TcClassStats]] = {}
        if self._tc:
            classes, problem = await read_tc([s.name for s in found])
            if problem:
                errors.append(CollectorError(collector=NAME, message=problem))
        ethtool = self._ethtool_path()
        stats: list[dict[str, int]] = []
        for s in found:
            wanted = ethtool is not None and (self._ethtool_mode == "all" or s.has_device)
            stats.append(await read_ethtool(ethtool, s.name) if wanted and ethtool else {})
        items = tuple(
            interface(s, st, classes.get(s.name, ()), _LABELS.get(s.name, {}), self._lossless)
            for s, st in zip(found, stats, strict=True)
        )
        return Collected(field=self.field, items=items, errors=tuple(errors))

    def _ethtool_path(self) -> str | None:
        if self._ethtool_mode == "none":
            return None
        return shutil.which(self._ethtool)
