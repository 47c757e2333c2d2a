"""The tc backend: apply an htb plan through pyroute2 and read the state back.

Synchronous (pyroute2's IPRoute cannot be made inside a running event loop): the
reconciler calls it through ``asyncio.to_thread``.  pyroute2 has no RED plugin, so the
RED leaves go through iproute2's ``tc``; u32 keys are read back with ``tc -j`` because
pyroute2 decodes them wrongly (../shared/NOTES.md).  A qdisc or filter kind the kernel
lacks is reported as unsupported, never raised.
"""

from __future__ import annotations

import errno
import json
import subprocess
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from metalguard.agent.qos.plan import (
    LEAF_LIMIT_PKTS,
    ROOT_CLASS,
    ROOT_HANDLE,
    HtbClass,
    TcPlan,
    u32_ipv4_key,
    u32_ipv6_key,
)

TC_TIMEOUT_S = 10.0
ETH_P_IP = 0x0800
ETH_P_IPV6 = 0x86DD
_UNSUPPORTED = ("unknown", "not supported", "no such file")


class TcError(RuntimeError):
    """Applying or reading tc state failed; the message says what and why."""


class ClassStats(msgspec.Struct, frozen=True, kw_only=True):
    """Counters of one htb class."""

    bytes: int = 0
    packets: int = 0
    drops: int = 0
    overlimits: int = 0


class TcState(msgspec.Struct, frozen=True, kw_only=True):
    """The part of an interface's tc state that a plan determines."""

    root: str = ""
    """``htb 1:`` or the kind and handle of whatever root qdisc is there ("" for none)."""
    default_classid: str = ""
    classes: dict[str, tuple[int, int, int]] = {}
    """classid -> (rate kbit, ceil kbit, htb prio)."""
    leaves: dict[str, str] = {}
    """parent classid -> leaf qdisc kind."""
    filters: frozenset[tuple[str, int, str]] = frozenset()
    """(ip | ipv6, DSCP, classid) of every u32 DSCP filter under the root."""


class TcOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """What an apply achieved: the state to expect and the parts the kernel lacks."""

    expected: TcState
    unsupported: tuple[str, ...] = ()


def _handle(value: int) -> str:
    return f"{value >> 16:x}:{value & 0xFFFF:x}" if value & 0xFFFF else f"{value >> 16:x}:"


NETNS_DIR = Path("/run/netns")


def check_netns(netns: str | None) -> None:
    """TcError unless ``netns`` (when given) is an existing named namespace: pyroute2
    would silently create a missing one."""
    if netns and not (NETNS_DIR / netns).exists():
        raise TcError(f"no network namespace {netns!r} ({NETNS_DIR / netns} is missing)")


@contextmanager
def _ipr(netns: str | None) -> Iterator[Any]:
    check_netns(netns)
    try:
        ipr = IPRoute(netns=netns) if netns else IPRoute()
    except (OSError, NetlinkError) as exc:
        raise TcError(
            f"cannot open netlink{f' in netns {netns}' if netns else ''}: {exc}"
        ) from None
    try:
        yield ipr
    finally:
        ipr.close()


def _index(ipr: Any, ifname: str) -> int:
    found = ipr.link_lookup(ifname=ifname)
    if not found:
        raise TcError(f"{ifname}: no such interface")
    return int(found[0])


def _tc_cmd(netns: str | None, args: list[str]) -> subprocess.CompletedProcess[str]:
    cmd = ["tc", *(["-n", netns] if netns else []), *args]
    try:
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=TC_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return subprocess.CompletedProcess(cmd, 127, "", str(exc))


def expected_state(plan: TcPlan, red_classes: Collection[str]) -> TcState:
    """The state a plan leads to; ``red_classes``: the classes whose RED leaf the kernel
    took (the others asking for ECN keep a pfifo leaf)."""
    classes = {ROOT_CLASS: (plan.link_kbit, plan.link_kbit, 0)}
    leaves: dict[str, str] = {}
    for c in plan.classes:
        classes[c.classid] = (c.rate_kbit, c.ceil_kbit, c.prio)
        leaves[c.classid] = "red" if (c.red is not None and c.classid in red_classes) else "pfifo"
    filters = frozenset(
        (proto, f.dscp, f.classid) for f in plan.filters for proto in ("ip", "ipv6")
    )
    return TcState(
        root=f"htb {ROOT_HANDLE}",
        default_classid=plan.default_classid,
        classes=classes,
        leaves=leaves,
        filters=filters,
    )


def differences(expected: TcState, actual: TcState) -> list[str]:
    """What differs between two states, one readable line each ([] when equal).

    Rates match within 1% (htb stores them rounded)."""
    out: list[str] = []
    if expected.root != actual.root:
        out.append(f"root qdisc: expected {expected.root!r}, found {actual.root or 'none'!r}")
        return out
    if expected.default_classid != actual.default_classid:
        out.append(
            f"htb default: expected {expected.default_classid}, found {actual.default_classid}"
        )
    for cid, (rate, ceil, prio) in expected.classes.items():
        got = actual.classes.get(cid)
        if got is None:
            out.append(f"class {cid}: missing")
            continue
        if not _close(rate, got[0]) or not _close(ceil, got[1]) or prio != got[2]:
            out.append(
                f"class {cid}: expected rate {rate}kbit ceil {ceil}kbit prio {prio}, "
                f"found rate {got[0]}kbit ceil {got[1]}kbit prio {got[2]}"
            )
    for cid in sorted(set(actual.classes) - set(expected.classes)):
        out.append(f"class {cid}: not in the plan")
    for cid, kind in expected.leaves.items():
        if actual.leaves.get(cid) != kind:
            out.append(f"leaf of {cid}: expected {kind}, found {actual.leaves.get(cid, 'none')}")
    for proto, dscp, cid in sorted(expected.filters - actual.filters):
        out.append(f"filter {proto} dscp {dscp} -> {cid}: missing")
    for proto, dscp, cid in sorted(actual.filters - expected.filters):
        out.append(f"filter {proto} dscp {dscp} -> {cid}: not in the plan")
    return out


def _close(want: int, got: int) -> bool:
    return abs(want - got) <= max(1, want // 100)


def read_state(ifname: str, netns: str | None = None) -> TcState:
    """The interface's current root qdisc, htb classes, leaves and DSCP filters."""
    with _ipr(netns) as ipr:
        try:
            index = _index(ipr, ifname)
            qdiscs = list(ipr.get_qdiscs(index=index))
            classes = list(ipr.get_classes(index=index))
        except NetlinkError as exc:
            raise TcError(f"{ifname}: cannot read tc state: {exc}") from None
    root = ""
    default = ""
    leaves: dict[str, str] = {}
    for q in qdiscs:
        kind = q.get_attr("TCA_KIND") or ""
        if q["parent"] == 0xFFFFFFFF:
            root = f"{kind} {_handle(q['handle'])}"
            if kind == "htb":
                init = q.get_attr("TCA_OPTIONS").get_attr("TCA_HTB_INIT") or {}
                default = f"1:{int(init.get('defcls', 0)):x}"
        elif q["parent"] != 0xFFFFFFF1:  # not ingress/clsact
            leaves[_handle(q["parent"])] = kind
    if not root.startswith("htb "):
        return TcState(root=root)
    parsed: dict[str, tuple[int, int, int]] = {}
    for c in classes:
        if c.get_attr("TCA_KIND") != "htb":
            continue
        opts = c.get_attr("TCA_OPTIONS")
        parms = opts.get_attr("TCA_HTB_PARMS")
        rate = opts.get_attr("TCA_HTB_RATE64") or parms["rate"]
        ceil = opts.get_attr("TCA_HTB_CEIL64") or parms["ceil"]
        parsed[_handle(c["handle"])] = (rate * 8 // 1000, ceil * 8 // 1000, int(parms["prio"]))
    return TcState(
        root=root,
        default_classid=default,
        classes=parsed,
        leaves=leaves,
        filters=frozenset(_read_filters(ifname, netns)),
    )


def _read_filters(ifname: str, netns: str | None) -> Iterator[tuple[str, int, str]]:
    done = _tc_cmd(netns, ["-j", "filter", "show", "dev", ifname, "parent", ROOT_HANDLE])
    if done.returncode != 0:
        raise TcError(f"{ifname}: tc filter show failed: {done.stderr.strip()}")
    try:
        entries = json.loads(done.stdout or "[]")
    except json.JSONDecodeError as exc:
        raise TcError(f"{ifname}: tc -j filter show: not JSON: {exc}") from None
    for entry in entries:
        opts = entry.get("options") or {}
        match = opts.get("match")
        if entry.get("kind") != "u32" or not match or "flowid" not in opts:
            continue
        proto = entry.get("protocol", "")
        dscp = _dscp_of(proto, match)
        if dscp is not None:
            yield (proto, dscp, opts["flowid"])


def _dscp_of(proto: str, match: dict[str, Any]) -> int | None:
    """The DSCP a u32 match selects (keys of the first header word only)."""
    try:
        shift = 8 * int(match.get("off", 0))
        value = int(str(match["value"]), 16) >> shift
        mask = int(str(match["mask"]), 16) >> shift
    except (KeyError, ValueError):
        return None
    if proto == "ip" and mask == 0x00FC0000:
        return (value >> 18) & 0x3F
    if proto == "ipv6" and mask == 0x0FC00000:
        return (value >> 22) & 0x3F
    return None


def clear(ifname: str, netns: str | None = None) -> None:
    """Delete the root qdisc (back to the kernel's default); no error when none."""
    with _ipr(netns) as ipr:
        index = _index(ipr, ifname)
        try:
            ipr.tc("del", index=index, handle=ROOT_HANDLE, parent=0xFFFFFFFF)
        except NetlinkError as exc:
            if exc.code not in (errno.ENOENT, errno.EINVAL):
                raise TcError(f"{ifname}: cannot delete the root qdisc: {exc}") from None


def apply(ifname: str, plan: TcPlan, netns: str | None = None) -> TcOutcome:
    """Replace the interface's root qdisc with the plan's htb tree.

    Raises TcError when the kernel refuses something it supports; returns the parts it
    lacks (htb, u32, RED) as ``unsupported``."""
    unsupported: list[str] = []
    clear(ifname, netns)
    with _ipr(netns) as ipr:
        index = _index(ipr, ifname)
        minor = int(plan.default_classid.split(":")[1], 16)
        try:
            ipr.tc("add", "htb", index=index, handle=ROOT_HANDLE, default=minor)
        except NetlinkError as exc:
            if exc.code in (errno.ENOENT, errno.EOPNOTSUPP):
                return TcOutcome(
                    expected=TcState(), unsupported=(f"{ifname}: tc: htb qdisc unavailable: {exc}",)
                )
            raise TcError(f"{ifname}: cannot add the htb root: {exc}") from None
        try:
            ipr.tc(
                "add-class",
                "htb",
                index=index,
                handle=ROOT_CLASS,
                parent=ROOT_HANDLE,
                rate=f"{plan.link_kbit}kbit",
                ceil=f"{plan.link_kbit}kbit",
            )
            for c in plan.classes:
                ipr.tc(
                    "add-class",
                    "htb",
                    index=index,
                    handle=c.classid,
                    parent=ROOT_CLASS,
                    rate=f"{c.rate_kbit}kbit",
                    ceil=f"{c.ceil_kbit}kbit",
                    prio=c.prio,
                )
        except NetlinkError as exc:
            raise TcError(f"{ifname}: cannot add htb classes: {exc}") from None
        red_classes: set[str] = set()
        red_missing = ""
        for c in plan.classes:
            if c.red is not None:
                problem = red_missing or _add_red(ifname, c, netns)
                if problem:
                    red_missing = problem  # the kernel lacks it: not tried again
                    unsupported.append(f"{ifname}: tc: ECN marking of class {c.name!r}: {problem}")
                else:
                    red_classes.add(c.classid)
                    continue
            try:
                ipr.tc(
                    "add",
                    "pfifo",
                    index=index,
                    handle=c.leaf_handle,
                    parent=c.classid,
                    limit=LEAF_LIMIT_PKTS,
                )
            except NetlinkError as exc:
                raise TcError(f"{ifname}: cannot add the leaf of {c.classid}: {exc}") from None
        filters_ok = True
        for f in plan.filters:
            for proto, key, pref in (
                (ETH_P_IP, u32_ipv4_key(f.dscp), 1),
                (ETH_P_IPV6, u32_ipv6_key(f.dscp), 2),
            ):
                try:
                    ipr.tc(
                        "add-filter",
                        "u32",
                        index=index,
                        parent=ROOT_HANDLE,
                        prio=pref,
                        protocol=proto,
                        target=f.classid,
                        keys=[key],
                    )
                except NetlinkError as exc:
                    if exc.code in (errno.ENOENT, errno.EOPNOTSUPP):
                        unsupported.append(f"{ifname}: tc: u32 filter unavailable: {exc}")
                        filters_ok = False
                        break
                    raise TcError(
                        f"{ifname}: cannot add the filter for DSCP {f.dscp}: {exc}"
                    ) from None
            if not filters_ok:
                break
    expected = expected_state(plan, red_classes)
    if not filters_ok:
        expected = msgspec.structs.replace(expected, filters=frozenset())
    return TcOutcome(expected=expected, unsupported=tuple(unsupported))


def _add_red(ifname: str, c: HtbClass, netns: str | None) -> str:
    """Add the RED leaf through iproute2; "" when done, else why the kernel cannot."""
    red = c.red
    assert red is not None
    done = _tc_cmd(
        netns,
        [
            "qdisc", "replace", "dev", ifname, "parent", c.classid, "handle", c.leaf_handle,
            "red", "limit", str(red.limit_bytes), "min", str(red.min_bytes),
            "max", str(red.max_bytes), "avpkt", str(red.avpkt), "burst", str(red.burst_pkts),
            "probability", f"{red.probability:g}", "bandwidth", f"{c.rate_kbit}kbit", "ecn",
        ],
    )  # fmt: skip
    if done.returncode == 0:
        return ""
    reason = (done.stderr or done.stdout).strip() or f"tc exited {done.returncode}"
    if any(word in reason.lower() for word in _UNSUPPORTED) or done.returncode == 127:
        return f"RED qdisc unavailable ({reason})"
    raise TcError(f"{ifname}: cannot add RED under {c.classid}: {reason}")


def class_stats(ifname: str, netns: str | None = None) -> dict[str, ClassStats]:
    """Per-class counters (bytes, packets, drops, overlimits) of the interface."""
    out: dict[str, ClassStats] = {}
    with _ipr(netns) as ipr:
        index = _index(ipr, ifname)
        for c in ipr.get_classes(index=index):
            stats = c.get_attr("TCA_STATS2")
            if stats is None:
                continue
            basic = stats.get_attr("TCA_STATS_BASIC") or {}
            queue = stats.get_attr("TCA_STATS_QUEUE") or {}
            out[_handle(c["handle"])] = ClassStats(
                bytes=int(basic.get("bytes", 0)),
                packets=int(basic.get("packets", 0)),
                drops=int(queue.get("drops", 0)),
                overlimits=int(queue.get("overlimits", 0)),
            )
    return out
