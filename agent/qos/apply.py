"""Apply one interface's plan through its backends, read it back, and judge the result.

Synchronous (the backends are); the reconciler runs it in a thread and the ``agent qos
apply`` CLI calls it directly.  Statuses (docs/qos.md):

* ``applied``: every planned part is in place and verified;
* ``partial``: some parts are in place, others are unsupported here (each with a reason);
* ``unsupported``: nothing planned could be applied on this interface;
* ``failed``: a backend refused, a part could not be planned, or the read-back differs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import msgspec

from metalguard.agent.qos import dcb_backend, mlx5_backend, tc_backend
from metalguard.agent.qos.dcb_backend import DcbError, DcbState
from metalguard.agent.qos.mlx5_backend import Mlx5Error
from metalguard.agent.qos.plan import InterfacePlan
from metalguard.agent.qos.tc_backend import TcError, TcState

Status = Literal["applied", "partial", "unsupported", "failed"]
PartStatus = Literal["applied", "unsupported", "failed"]


class QosTarget(msgspec.Struct, frozen=True, kw_only=True):
    """Where the backends act: a network namespace (None: our own) and a sysfs root."""

    netns: str | None = None
    sysfs: str = "/sys"


class PartResult(msgspec.Struct, frozen=True, kw_only=True):
    """One backend's part of a plan: tc, tc.ecn, tc.filters, dcb, mlx5."""

    part: str
    status: PartStatus
    reasons: tuple[str, ...] = ()


class Expected(msgspec.Struct, frozen=True, kw_only=True):
    """What the read-back must show after an apply (None: the part is not checked)."""

    tc: TcState | None = None
    dcb: DcbState | None = None
    mlx5: dict[str, int | None] | None = None


class InterfaceResult(msgspec.Struct, frozen=True, kw_only=True):
    """The outcome of applying (and verifying) one interface's plan."""

    interface: str
    version: int
    status: Status
    parts: tuple[PartResult, ...] = ()
    differences: tuple[str, ...] = ()
    expected: Expected = Expected()

    @property
    def reasons(self) -> list[str]:
        """Why the status is not ``applied``: unsupported and failed parts, differences."""
        out = [r for p in self.parts if p.status != "applied" for r in p.reasons]
        return out + list(self.differences)


def judge(parts: list[PartResult], differences: list[str]) -> Status:
    """The interface status from its parts and the read-back differences."""
    if differences or any(p.status == "failed" for p in parts):
        return "failed"
    applied = any(p.status == "applied" for p in parts)
    unsupported = any(p.status == "unsupported" for p in parts)
    if unsupported and not applied:
        return "unsupported"
    return "partial" if unsupported else "applied"


def apply_plan(plan: InterfacePlan, target: QosTarget) -> InterfaceResult:
    """Apply every part of ``plan``, then read back and compare."""
    parts: list[PartResult] = []
    tc_state: TcState | None = None
    dcb_state: DcbState | None = None
    mlx5_state: dict[str, int | None] | None = None
    name = plan.interface
    try:
        tc_backend.check_netns(target.netns)
    except TcError as exc:
        failed = PartResult(part="netns", status="failed", reasons=(str(exc),))
        return InterfaceResult(
            interface=name, version=plan.version, status="failed", parts=(failed,)
        )
    if plan.problems:
        parts.append(PartResult(part="plan", status="failed", reasons=plan.problems))
    if plan.tc is not None:
        try:
            outcome = tc_backend.apply(name, plan.tc, target.netns)
            tc_state = outcome.expected
            if outcome.expected.root:
                parts.append(PartResult(part="tc", status="applied"))
            if outcome.unsupported:
                parts.append(
                    PartResult(part="tc", status="unsupported", reasons=outcome.unsupported)
                )
        except TcError as exc:
            parts.append(PartResult(part="tc", status="failed", reasons=(str(exc),)))
    if plan.dcb is not None:
        try:
            why = dcb_backend.apply(name, plan.dcb, target.netns)
            if why:
                parts.append(PartResult(part="dcb", status="unsupported", reasons=(why,)))
            else:
                dcb_state = dcb_backend.expected_state(plan.dcb)
                parts.append(PartResult(part="dcb", status="applied"))
        except DcbError as exc:
            parts.append(PartResult(part="dcb", status="failed", reasons=(str(exc),)))
    if plan.mlx5 is not None:
        try:
            knobs, missing = mlx5_backend.apply(name, plan.mlx5, Path(target.sysfs))
            if knobs:
                mlx5_state = knobs
                parts.append(PartResult(part="mlx5", status="applied"))
            if missing:
                parts.append(PartResult(part="mlx5", status="unsupported", reasons=tuple(missing)))
        except Mlx5Error as exc:
            parts.append(PartResult(part="mlx5", status="failed", reasons=(str(exc),)))
    expected = Expected(tc=tc_state, dcb=dcb_state, mlx5=mlx5_state)
    differences = verify(name, expected, target) if not _failed(parts) else []
    return InterfaceResult(
        interface=name,
        version=plan.version,
        status=judge(parts, differences),
        parts=tuple(parts),
        differences=tuple(differences),
        expected=expected,
    )


def _failed(parts: list[PartResult]) -> bool:
    return any(p.status == "failed" for p in parts)


def verify(ifname: str, expected: Expected, target: QosTarget) -> list[str]:
    """Read every checked part back; the differences from ``expected`` ([] when none)."""
    out: list[str] = []
    if expected.tc is not None:
        try:
            out += tc_backend.differences(expected.tc, tc_backend.read_state(ifname, target.netns))
        except TcError as exc:
            out.append(str(exc))
    if expected.dcb is not None:
        try:
            actual = dcb_backend.read_state(ifname, target.netns)
            out += dcb_backend.differences(expected.dcb, actual)
        except DcbError as exc:
            out.append(str(exc))
    if expected.mlx5:
        actual_knobs = mlx5_backend.read_state(ifname, expected.mlx5, Path(target.sysfs))
        out += mlx5_backend.differences(expected.mlx5, actual_knobs)
    return [f"{ifname}: {d}" if not d.startswith(f"{ifname}:") else d for d in out]


def clear(ifname: str, target: QosTarget) -> None:
    """Remove what the tc backend set (the kernel's default root qdisc returns)."""
    tc_backend.clear(ifname, target.netns)
