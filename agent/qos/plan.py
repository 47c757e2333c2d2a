"""Profile -> plan per interface: pure functions, no I/O (docs/qos.md).

The tc part is an htb root ``1:`` with one root class ``1:1`` at the link rate and one
class ``1:<10+i>`` per traffic class (rate = its share of the link, ceil = the link rate,
htb prio 0 when strict), a pfifo leaf (or RED with ECN where the class asks for it) and
u32 filters matching each mapped DSCP (IPv4 TOS and IPv6 traffic class) to its class.
Unmapped DSCP lands in the class serving priority 0 (the htb default).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec

from metalguard.proto.qos import DEFAULT_PRIORITY, QosProfile

ROOT_HANDLE = "1:"
ROOT_CLASS = "1:1"
FIRST_MINOR = 0x10
MIN_RATE_KBIT = 8
AVPKT = 1000
LEAF_LIMIT_PKTS = 1000


class InterfaceInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What the planner needs to know about one interface."""

    name: str
    driver: str = ""
    pci_class: str = ""
    speed_mbit: int | None = None
    """None when the interface reports no speed."""


class RedParams(msgspec.Struct, frozen=True, kw_only=True):
    """RED with ECN marking on a class's leaf."""

    min_bytes: int
    max_bytes: int
    limit_bytes: int
    probability: float
    burst_pkts: int
    avpkt: int = AVPKT


class HtbClass(msgspec.Struct, frozen=True, kw_only=True):
    """One htb class (a traffic class) and its leaf."""

    name: str
    classid: str
    leaf_handle: str
    priorities: tuple[int, ...]
    rate_kbit: int
    ceil_kbit: int
    prio: int
    red: RedParams | None = None


class DscpFilter(msgspec.Struct, frozen=True, kw_only=True):
    """A u32 filter sending one DSCP to a class (for IPv4 and IPv6)."""

    dscp: int
    classid: str


class TcPlan(msgspec.Struct, frozen=True, kw_only=True):
    """The htb tree of one interface."""

    link_kbit: int
    default_classid: str
    classes: tuple[HtbClass, ...]
    filters: tuple[DscpFilter, ...]


class DcbPlan(msgspec.Struct, frozen=True, kw_only=True):
    """PFC, ETS and the DSCP app table, for the NIC's DCB interface."""

    trust: str
    pfc_priorities: tuple[int, ...]
    prio_tc: dict[int, int]
    """priority -> traffic class index (ETS)."""
    tc_bw: tuple[int, ...]
    """ETS bandwidth per traffic class index (strict classes get 0)."""
    tc_strict: tuple[bool, ...]
    dscp_prio: dict[int, int]


class Mlx5Plan(msgspec.Struct, frozen=True, kw_only=True):
    """DCQCN knobs under ``/sys/class/net/<if>/ecn/roce_np|roce_rp/``."""

    np: dict[str, int]
    rp: dict[str, int]


class InterfacePlan(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a profile asks of one interface; a None part is not asked for."""

    interface: str
    version: int
    tc: TcPlan | None = None
    dcb: DcbPlan | None = None
    mlx5: Mlx5Plan | None = None
    problems: tuple[str, ...] = ()
    """Why a part could not be planned (e.g. no link speed)."""


def select_interfaces(
    profile: QosProfile, interfaces: Iterable[InterfaceInfo], override: Sequence[str] = ()
) -> list[InterfaceInfo]:
    """The interfaces a profile applies to: ``override`` names (config / CLI) first, then
    the profile's names, else its driver / PCI class match; none when nothing is said."""
    available = list(interfaces)
    match = profile.interfaces
    if override or match.names:
        wanted = list(override or match.names)
        by_name = {i.name: i for i in available}
        return [by_name.get(n) or InterfaceInfo(name=n) for n in wanted]
    if not match.driver and not match.pci_class:
        return []
    return [
        i
        for i in available
        if (not match.driver or i.driver == match.driver)
        and (not match.pci_class or _pci_class_matches(match.pci_class, i.pci_class))
    ]


def _pci_class_matches(want: str, have: str) -> bool:
    """``0x0207`` matches ``0x020700`` (a class prefix), case-insensitively."""
    w = want.lower().removeprefix("0x")
    h = have.lower().removeprefix("0x")
    return bool(h) and h.startswith(w)


def plan_interface(profile: QosProfile, iface: InterfaceInfo) -> InterfacePlan:
    """The plan for one interface (assumes a profile without ``profile_problems``)."""
    problems: list[str] = []
    tc = _tc_plan(profile, iface, problems) if profile.traffic_class else None
    return InterfacePlan(
        interface=iface.name,
        version=profile.version,
        tc=tc,
        dcb=_dcb_plan(profile),
        mlx5=_mlx5_plan(profile),
        problems=tuple(problems),
    )


def plan_all(
    profile: QosProfile, interfaces: Iterable[InterfaceInfo], override: Sequence[str] = ()
) -> list[InterfacePlan]:
    """Plans for every interface the profile selects."""
    return [plan_interface(profile, i) for i in select_interfaces(profile, interfaces, override)]


def link_rate_mbit(profile: QosProfile, iface: InterfaceInfo) -> int | None:
    """The interface's reported speed, else the profile's ``link_rate_mbit``."""
    if iface.speed_mbit is not None and iface.speed_mbit > 0:
        return iface.speed_mbit
    return profile.link_rate_mbit


def _tc_plan(profile: QosProfile, iface: InterfaceInfo, problems: list[str]) -> TcPlan | None:
    rate = link_rate_mbit(profile, iface)
    if rate is None:
        problems.append(
            f"{iface.name}: tc: the interface reports no speed and the profile sets no "
            "link_rate_mbit"
        )
        return None
    link_kbit = rate * 1000
    classes: list[HtbClass] = []
    by_priority: dict[int, str] = {}
    default = ""
    for i, tc in enumerate(profile.traffic_class):
        minor = FIRST_MINOR + i
        classid = f"1:{minor:x}"
        class_kbit = max(MIN_RATE_KBIT, round(link_kbit * tc.bandwidth_percent / 100))
        red = None
        if tc.ecn is not None:
            red = _red(tc.ecn.min_kb, tc.ecn.max_kb, tc.ecn.probability)
        classes.append(
            HtbClass(
                name=tc.name,
                classid=classid,
                leaf_handle=f"{minor:x}:",
                priorities=tuple(tc.priorities),
                rate_kbit=class_kbit,
                ceil_kbit=link_kbit,
                prio=0 if tc.strict else 1,
                red=red,
            )
        )
        for prio in tc.priorities:
            by_priority[prio] = classid
        if DEFAULT_PRIORITY in tc.priorities:
            default = classid
    filters = tuple(
        DscpFilter(dscp=dscp, classid=by_priority[prio])
        for dscp, prio in sorted(profile.dscp_map.items())
        if prio in by_priority
    )
    if profile.trust != "dscp":
        filters = ()
    return TcPlan(
        link_kbit=link_kbit,
        default_classid=default or classes[-1].classid,
        classes=tuple(classes),
        filters=filters,
    )


def _red(min_kb: int, max_kb: int, probability: float) -> RedParams:
    lo, hi = min_kb * 1024, max_kb * 1024
    return RedParams(
        min_bytes=lo,
        max_bytes=hi,
        limit_bytes=4 * hi,
        probability=probability,
        burst_pkts=(2 * lo + hi) // (3 * AVPKT) + 1,
    )


def _dcb_plan(profile: QosProfile) -> DcbPlan | None:
    if not (profile.pfc_priorities or profile.traffic_class or profile.dscp_map):
        return None
    prio_tc: dict[int, int] = {}
    for index, tc in enumerate(profile.traffic_class):
        for prio in tc.priorities:
            prio_tc[prio] = index
    return DcbPlan(
        trust=profile.trust,
        pfc_priorities=tuple(sorted(profile.pfc_priorities)),
        prio_tc=prio_tc,
        tc_bw=tuple(
            0 if tc.strict else round(tc.bandwidth_percent) for tc in profile.traffic_class
        ),
        tc_strict=tuple(tc.strict for tc in profile.traffic_class),
        dscp_prio=dict(sorted(profile.dscp_map.items())),
    )


def _mlx5_plan(profile: QosProfile) -> Mlx5Plan | None:
    d = profile.dcqcn
    if d is None or not (d.np or d.rp):
        return None
    return Mlx5Plan(np=dict(sorted(d.np.items())), rp=dict(sorted(d.rp.items())))


def u32_ipv4_key(dscp: int) -> str:
    """The u32 key matching a DSCP in the IPv4 TOS byte (first header word)."""
    return f"0x{dscp << 18:08x}/0x00fc0000+0"


def u32_ipv6_key(dscp: int) -> str:
    """The u32 key matching a DSCP in the IPv6 traffic class (first header word)."""
    return f"0x{dscp << 22:08x}/0x0fc00000+0"


def render_plan(plans: Sequence[InterfacePlan]) -> str:
    """A human-readable plan (``agent qos apply --dry-run``)."""
    lines: list[str] = []
    for p in plans:
        lines.append(f"interface {p.interface} (profile version {p.version})")
        for problem in p.problems:
            lines.append(f"  ! {problem}")
        if p.tc is not None:
            t = p.tc
            lines.append(f"  tc: htb root {ROOT_HANDLE} default {t.default_classid}")
            lines.append(f"    class {ROOT_CLASS} rate {t.link_kbit}kbit")
            for c in t.classes:
                leaf = (
                    f"red min {c.red.min_bytes} max {c.red.max_bytes} "
                    f"probability {c.red.probability:g} ecn"
                    if c.red
                    else f"pfifo limit {LEAF_LIMIT_PKTS}"
                )
                lines.append(
                    f"    class {c.classid} {c.name!r} priorities {list(c.priorities)} "
                    f"rate {c.rate_kbit}kbit ceil {c.ceil_kbit}kbit prio {c.prio}; "
                    f"leaf {c.leaf_handle} {leaf}"
                )
            for f in t.filters:
                lines.append(f"    filter u32 dscp {f.dscp} -> {f.classid}")
        if p.dcb is not None:
            d = p.dcb
            lines.append(
                f"  dcb: trust {d.trust}; pfc {list(d.pfc_priorities)}; "
                f"ets prio->tc {d.prio_tc} bw {list(d.tc_bw)}; app dscp->prio {d.dscp_prio}"
            )
        if p.mlx5 is not None:
            lines.append(f"  mlx5: roce_np {p.mlx5.np}; roce_rp {p.mlx5.rp}")
    if not plans:
        lines.append("no interface selected (set interfaces in the profile or the config)")
    return "\n".join(lines) + "\n"
