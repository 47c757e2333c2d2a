"""DCQCN checked against its own counters (docs/qos.md, "DCQCN against its counters").

A profile that enables ECN or DCQCN expects the NIC's congestion control to act on the
marks the switches set.  The mlx5 congestion counters of an RDMA port
(``hw_counters/``; the kernel's ``IB/mlx5: Support congestion related counters``) say
whether it does:

* ``np_ecn_marked_roce_packets``: CE-marked RoCE packets the notification point received;
* ``np_cnp_sent``: CNPs the notification point sent in answer to them;
* ``rp_cnp_handled``: CNPs the reaction point handled (it slowed the flow down);
* ``rp_cnp_ignored``: CNPs the reaction point received and ignored (mlx5 counts a
  received CNP as one or the other: there is no separate "received" counter).

Between two readings of a port, marks that grew while no CNP was sent mean the
notification point marks but sends no CNPs; CNPs ignored that grew while none was handled
mean CNPs arrive and the reaction point never acts on them.  :func:`check_port` is the
pure judgement of two readings; :class:`DcqcnWatch` keeps the previous reading of every
port and the verdict per interface (``RdmaPort.netdev``) between readings.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final, Literal

from metalguard.proto.qos import QosProfile
from metalguard.proto.telemetry import QosInterfaceStatus, RdmaPort

Condition = Literal["np_no_cnp", "rp_cnp_unhandled"]
"""A DCQCN problem the counters show (docs/qos.md)."""

MARKED: Final = "np_ecn_marked_roce_packets"
CNP_SENT: Final = "np_cnp_sent"
CNP_HANDLED: Final = "rp_cnp_handled"
CNP_IGNORED: Final = "rp_cnp_ignored"
COUNTERS: Final = (MARKED, CNP_SENT, CNP_HANDLED, CNP_IGNORED)
CITED: Final[dict[str, tuple[str, str]]] = {
    "np_no_cnp": (MARKED, CNP_SENT),
    "rp_cnp_unhandled": (CNP_IGNORED, CNP_HANDLED),
}
"""The counters each condition is judged by."""

MIN_GROWTH: Final = 10
"""Marks (or ignored CNPs) that must arrive between two readings before their missing
answer counts: a few stray packets read a moment apart from their answer prove nothing."""

DEGRADABLE: Final = frozenset({"applied", "partial"})
"""Statuses a counter problem turns into ``degraded``; the others (``failed``, ``drift``,
``unsupported``: the profile is not in place) keep theirs and gain the reasons."""


def ecn_enabled(profile: QosProfile | None) -> bool:
    """Whether ``profile`` enables ECN marking or DCQCN: a traffic class with ``ecn``,
    or a ``[dcqcn]`` section."""
    if profile is None:
        return False
    return profile.dcqcn is not None or any(tc.ecn is not None for tc in profile.traffic_class)


def port_name(port: RdmaPort) -> str:
    """``<device>/<port>``, as NodeTopology.rdma_ports names ports."""
    return f"{port.device}/{port.port}"


def counter(port: RdmaPort, name: str) -> int | None:
    """A vendor counter of the port: its port-level ``hw_counters``, else the device's."""
    value = port.hw_counters.get(name)
    return value if value is not None else port.device_hw_counters.get(name)


@dataclass(frozen=True, slots=True)
class Finding:
    """One problem of one port between two readings, its message naming the counters."""

    condition: Condition
    message: str


@dataclass(frozen=True, slots=True)
class PortCheck:
    """What two readings of one port show.

    ``problems``: the conditions found; ``working``: the conditions the counters showed
    working (marks answered by CNPs, CNPs handled), which clear an earlier finding;
    ``reset``: a counter went down (driver reload, counters cleared): nothing is judged.
    A condition in neither had no traffic to judge it by.
    """

    problems: tuple[Finding, ...] = ()
    working: frozenset[Condition] = frozenset()
    reset: bool = False


def check_port(before: RdmaPort, after: RdmaPort, min_growth: int = MIN_GROWTH) -> PortCheck:
    """Judge DCQCN on one port from two successive readings (pure)."""
    old = {name: counter(before, name) for name in COUNTERS}
    new = {name: counter(after, name) for name in COUNTERS}
    growth: dict[str, int] = {}
    for name in COUNTERS:
        a, b = old[name], new[name]
        if a is None or b is None:
            continue
        if b < a:
            return PortCheck(reset=True)
        growth[name] = b - a
    where = port_name(after)
    problems: list[Finding] = []
    working: set[Condition] = set()
    marked, sent = growth.get(MARKED), growth.get(CNP_SENT)
    if marked is not None and sent is not None:
        if marked >= min_growth and sent == 0:
            problems.append(
                Finding(
                    "np_no_cnp",
                    f"{where}: {MARKED} +{marked} but {CNP_SENT} +0: the notification "
                    "point receives ECN-marked packets but sends no CNPs",
                )
            )
        elif marked > 0 and sent > 0:
            working.add("np_no_cnp")
    ignored, handled = growth.get(CNP_IGNORED), growth.get(CNP_HANDLED)
    if ignored is not None and handled is not None:
        if ignored >= min_growth and handled == 0:
            problems.append(
                Finding(
                    "rp_cnp_unhandled",
                    f"{where}: {CNP_IGNORED} +{ignored} but {CNP_HANDLED} +0: CNPs are "
                    "received and never handled by the reaction point",
                )
            )
        elif handled > 0:
            working.add("rp_cnp_unhandled")
    return PortCheck(problems=tuple(problems), working=frozenset(working))


@dataclass(slots=True)
class _PortState:
    reading: RdmaPort
    findings: dict[Condition, str] = field(default_factory=dict)


class DcqcnWatch:
    """The previous reading of every RDMA port and the DCQCN findings still standing.

    A finding stands until the counters show that condition working again (a later
    interval with marks answered by CNPs, or CNPs handled), the counters reset, the port
    disappears or the profile no longer enables ECN/DCQCN; an interval without traffic
    keeps it.  The first reading of a port only sets its baseline.
    """

    def __init__(self, min_growth: int = MIN_GROWTH) -> None:
        self.min_growth = min_growth
        self._ports: dict[tuple[str, int], _PortState] = {}

    def observe(self, ports: Iterable[RdmaPort], enabled: bool) -> None:
        """Take a new reading of the node's ports (``enabled``: the applied profile
        enables ECN/DCQCN; when it does not, nothing is flagged)."""
        seen: dict[tuple[str, int], _PortState] = {}
        for port in ports:
            key = (port.device, port.port)
            state = self._ports.get(key)
            if state is None or state.reading.netdev != port.netdev:
                seen[key] = _PortState(port)
                continue
            result = check_port(state.reading, port, self.min_growth)
            findings = {} if result.reset else dict(state.findings)
            for condition in result.working:
                findings.pop(condition, None)
            for finding in result.problems:
                findings[finding.condition] = finding.message
            seen[key] = _PortState(port, findings if enabled else {})
        self._ports = seen  # a port gone from the reading is forgotten

    def findings(self) -> dict[str, dict[str, str]]:
        """Interface (the ports' netdev) -> ``<device>/<port>:<condition>`` -> message,
        for the interfaces with findings standing."""
        out: dict[str, dict[str, str]] = {}
        for key in sorted(self._ports):
            state = self._ports[key]
            if state.findings and state.reading.netdev:
                where = port_name(state.reading)
                found = out.setdefault(state.reading.netdev, {})
                for condition in sorted(state.findings):
                    found[f"{where}:{condition}"] = state.findings[condition]
        return out

    def degraded(self) -> dict[str, tuple[str, ...]]:
        """Interface -> the messages of its findings, for those with any."""
        return {name: tuple(found.values()) for name, found in self.findings().items()}


def counters_cited(keys: Iterable[str]) -> list[str]:
    """The counter names behind findings keyed ``<device>/<port>:<condition>``, once
    each, in order."""
    out: list[str] = []
    for key in keys:
        for name in CITED.get(key.rsplit(":", 1)[-1], ()):
            if name not in out:
                out.append(name)
    return out


def with_degraded(
    statuses: Iterable[QosInterfaceStatus], degraded: Mapping[str, tuple[str, ...]]
) -> tuple[QosInterfaceStatus, ...]:
    """The reconciler's verdicts with the counter findings folded in (pure): an
    ``applied`` or ``partial`` interface with findings becomes ``degraded``, the findings
    first in its reasons; other statuses keep theirs and gain the findings as reasons.
    Interfaces the reconciler does not manage are left out (the profile is not theirs)."""
    out: list[QosInterfaceStatus] = []
    for status in statuses:
        found = degraded.get(status.interface, ())
        if not found:
            out.append(status)
            continue
        out.append(
            QosInterfaceStatus(
                interface=status.interface,
                version=status.version,
                status="degraded" if status.status in DEGRADABLE else status.status,
                reasons=(*found, *status.reasons),
            )
        )
    return tuple(out)
