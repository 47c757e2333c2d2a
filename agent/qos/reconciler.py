"""The agent's QoS reconciler: keep every selected interface at the desired profile.

Each pass plans the current profile for the selected interfaces (pure), applies a plan
that changed, and otherwise reads the state back: a difference is reported as
``qos_drift`` and repaired by re-applying.  Every apply is reported as a NodeEvent
(``qos_applied`` / ``qos_partial`` / ``qos_unsupported`` / ``qos_failed``); a failed
apply restores the last plan that verified (or, when none did, the kernel's default).
Backends are synchronous and run in a worker thread.

With a profile that enables ECN/DCQCN, each fresh reading of the RDMA ports
(:meth:`QosReconciler.observe_rdma`) is checked against the congestion counters
(agent/qos/dcqcn_check.py): an applied interface whose ports show DCQCN not working is
``degraded`` (``qos_degraded``) until they show it working again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import msgspec

from metalguard.agent.collectors.netdev import ClassLabel, set_class_labels
from metalguard.agent.qos.apply import InterfaceResult, QosTarget, apply_plan, clear, verify
from metalguard.agent.qos.dcqcn_check import (
    DEGRADABLE,
    DcqcnWatch,
    counters_cited,
    ecn_enabled,
    with_degraded,
)
from metalguard.agent.qos.interfaces import list_interfaces
from metalguard.agent.qos.plan import InterfaceInfo, InterfacePlan, plan_all
from metalguard.agent.qos.tc_backend import TcError
from metalguard.proto.base import AttrValue, NodeIdentity
from metalguard.proto.events import NodeEvent
from metalguard.proto.qos import QosProfile, profile_problems
from metalguard.proto.telemetry import QosInterfaceStatus, RdmaPort
from metalguard.runtime.deadlines import wait_event

log = logging.getLogger(__name__)

EVENT_KINDS = {
    "applied": "qos_applied",
    "partial": "qos_partial",
    "unsupported": "qos_unsupported",
    "failed": "qos_failed",
    "drift": "qos_drift",
    "degraded": "qos_degraded",
}
"""NodeEvent kinds per status (a NodeEvent kind is one subject token: no dots)."""
_SEVERITY = {
    "applied": "info",
    "partial": "warning",
    "unsupported": "warning",
    "failed": "critical",
    "drift": "warning",
    "degraded": "warning",
}

Emit = Callable[[NodeEvent], Awaitable[None]]
Lister = Callable[[], list[InterfaceInfo]]


class _Applied(msgspec.Struct, kw_only=True):
    plan: InterfacePlan
    result: InterfaceResult


class QosReconciler:
    """Applies the desired QosProfile on this node and keeps it there."""

    def __init__(
        self,
        identity: NodeIdentity,
        emit: Emit,
        *,
        target: QosTarget | None = None,
        interfaces: Sequence[str] = (),
        interval_s: float = 30.0,
        lister: Lister | None = None,
        wall_clock: Callable[[], float] = time.time,
        new_id: Callable[[], str] = lambda: uuid.uuid4().hex,
    ) -> None:
        """``interfaces`` overrides the profile's selection; ``lister`` lists the node's
        interfaces (default: netlink + sysfs of ``target``)."""
        self.identity = identity
        self._emit = emit
        target = target or QosTarget()
        self.target = target
        self.override = tuple(interfaces)
        self.interval_s = interval_s
        self._lister = lister or (lambda: list_interfaces(target.netns, Path(target.sysfs)))
        self._wall = wall_clock
        self._new_id = new_id
        self._profile: QosProfile | None = None
        self._source = ""
        self._wake = asyncio.Event()
        self._applied: dict[str, _Applied] = {}
        """What is on each interface now (after a failure: the restored plan)."""
        self._failed: dict[str, _Applied] = {}
        """The desired plan that failed, per interface (retried when the plan changes)."""
        self._list_error = ""
        self._dcqcn = DcqcnWatch()
        self._reported: dict[str, frozenset[str]] = {}
        """The DCQCN findings last reported per degraded interface."""
        self.passes = 0
        """Completed reconcile passes (tests wait on it)."""

    # --- inputs ---------------------------------------------------------------------------
    async def set_profile(self, profile: QosProfile | None, source: str = "") -> None:
        """Take a new desired profile (None: none any more; what is applied stays)."""
        if profile is not None and (problems := profile_problems(profile)):
            await self._event("failed", "", f"profile {source or ''} refused", problems, profile)
            return
        self._profile, self._source = profile, source
        self._wake.set()

    async def report_invalid(self, source: str, reasons: list[str]) -> None:
        """A profile that could not be decoded: reported, the applied one stays."""
        await self._event("failed", "", f"profile at {source} is invalid", reasons, None)

    @property
    def profile(self) -> QosProfile | None:
        """The desired profile (None before the first one arrives)."""
        return self._profile

    def status(self) -> dict[str, InterfaceResult]:
        """The last result per interface (a failed desired plan shows as failed)."""
        out = {name: a.result for name, a in self._applied.items()}
        out.update({name: a.result for name, a in self._failed.items()})
        return out

    def verdicts(self) -> tuple[QosInterfaceStatus, ...]:
        """The batch's form of :meth:`status` (``TelemetryBatch.qos``), sorted by
        interface, with the DCQCN counter findings folded in (``degraded``)."""
        plain = (
            QosInterfaceStatus(
                interface=r.interface, version=r.version, status=r.status, reasons=tuple(r.reasons)
            )
            for _, r in sorted(self.status().items())
        )
        return with_degraded(plain, self._dcqcn.degraded())

    async def observe_rdma(self, ports: Sequence[RdmaPort]) -> None:
        """Take a fresh reading of the node's RDMA ports: the ports bound to an interface
        this reconciler manages are checked against the previous reading; an interface
        that becomes degraded (or whose findings change) is reported as ``qos_degraded``,
        one that recovers with its own status again."""
        status = self.status()
        self._dcqcn.observe((p for p in ports if p.netdev in status), ecn_enabled(self._profile))
        findings = self._dcqcn.findings()
        for name in sorted(set(findings) | set(self._reported)):
            result = status.get(name)
            found = findings.get(name, {})
            if result is None or result.status not in DEGRADABLE:
                self._reported.pop(name, None)  # not in place: its own event said so
                continue
            if not found:
                if self._reported.pop(name, None) is not None:
                    await self._event(
                        result.status,
                        name,
                        f"DCQCN counters on {name} show congestion control working again",
                        result.reasons,
                    )
                continue
            if self._reported.get(name) == frozenset(found):
                continue
            self._reported[name] = frozenset(found)
            reasons = list(found.values())
            await self._event(
                "degraded",
                name,
                f"profile version {result.version} is in place on {name} but its DCQCN "
                "counters show congestion control not working",
                reasons,
                extra={"counters": " ".join(counters_cited(found))},
            )

    def class_labels(self) -> dict[str, dict[str, tuple[str, bool]]]:
        """Per interface, htb classid -> (traffic class name, lossless: serves a PFC
        priority), for the classes in place now (network telemetry labels its tc stats)."""
        out: dict[str, dict[str, tuple[str, bool]]] = {}
        for name, applied in self._applied.items():
            tc, dcb = applied.plan.tc, applied.plan.dcb
            pfc = set(dcb.pfc_priorities) if dcb is not None else set()
            if tc is not None:
                out[name] = {c.classid: (c.name, bool(pfc & set(c.priorities))) for c in tc.classes}
        return out

    # --- loop -----------------------------------------------------------------------------
    async def run(self) -> None:
        """Reconcile on every profile change and every ``interval_s`` until cancelled."""
        while True:
            self._wake.clear()
            try:
                await self.reconcile()
            except Exception:  # one bad pass must not end the loop
                log.exception("QoS reconcile pass failed")
            await wait_event(self._wake, self.interval_s)

    async def reconcile(self) -> list[InterfaceResult]:
        """One pass over every selected interface; returns this pass's results."""
        profile = self._profile
        results: list[InterfaceResult] = []
        if profile is not None:
            try:
                infos = await asyncio.to_thread(self._lister)
            except (TcError, OSError) as exc:
                if str(exc) != self._list_error:  # once per distinct problem
                    self._list_error = str(exc)
                    await self._event("failed", "", "cannot list the interfaces", [str(exc)])
                self.passes += 1
                return results
            self._list_error = ""
            for plan in plan_all(profile, infos, self.override):
                results.append(await self._reconcile_one(plan))
        self.passes += 1
        return results

    async def _reconcile_one(self, plan: InterfacePlan) -> InterfaceResult:
        name = plan.interface
        failed = self._failed.get(name)
        if failed is not None and failed.plan == plan:
            # Retried when the plan changes; meanwhile keep the restored state in place.
            current = self._applied.get(name)
            if current is not None and await self._drifted(current):
                await self._apply(current.plan)
            return failed.result
        self._failed.pop(name, None)
        prev = self._applied.get(name)
        if prev is not None and prev.plan == plan and not await self._drifted(prev):
            return prev.result
        return await self._apply(plan)

    async def _drifted(self, current: _Applied) -> bool:
        name = current.plan.interface
        diffs = await asyncio.to_thread(verify, name, current.result.expected, self.target)
        if diffs:
            await self._event("drift", name, "state drifted from the plan; re-applying", diffs)
        return bool(diffs)

    async def _apply(self, plan: InterfacePlan) -> InterfaceResult:
        name = plan.interface
        result = await asyncio.to_thread(apply_plan, plan, self.target)
        if result.status != "failed":
            self._applied[name] = _Applied(plan=plan, result=result)
            self._label(name)
            await self._report(result)
            return result
        self._failed[name] = _Applied(plan=plan, result=result)
        good = self._applied.get(name)
        restored: int | None = None
        if good is not None and good.plan != plan:
            again = await asyncio.to_thread(apply_plan, good.plan, self.target)
            self._applied[name] = _Applied(plan=good.plan, result=again)
            restored = good.plan.version
        else:
            self._applied.pop(name, None)
            with contextlib.suppress(Exception):
                await asyncio.to_thread(clear, name, self.target)
        self._label(name)
        await self._report(result, restored_version=restored)
        return result

    def _label(self, name: str) -> None:
        """Tell the netdev collector what the classes now on ``name`` serve."""
        labels = self.class_labels().get(name, {})
        set_class_labels(
            name, {cid: ClassLabel(label, lossless) for cid, (label, lossless) in labels.items()}
        )

    async def _report(
        self, result: InterfaceResult, *, restored_version: int | None = None
    ) -> None:
        verb = {
            "applied": "applied",
            "partial": "partly applied",
            "unsupported": "not supported here",
            "failed": "failed",
        }[result.status]
        message = f"profile version {result.version} {verb} on {result.interface}"
        extra: dict[str, AttrValue] = {}
        if result.status == "failed":
            extra["restored_version"] = restored_version
            message += (
                f" (restored version {restored_version})"
                if restored_version is not None
                else " (back to the kernel's default)"
            )
        await self._event(result.status, result.interface, message, result.reasons, extra=extra)

    async def _event(
        self,
        status: str,
        device: str,
        message: str,
        reasons: Sequence[str],
        profile: QosProfile | None = None,
        *,
        extra: dict[str, AttrValue] | None = None,
    ) -> None:
        shown = profile or self._profile
        version = shown.version if shown is not None else None
        attrs: dict[str, AttrValue] = {
            "status": status,
            "profile_version": version,
            "profile_key": self._source,
            "reasons": "\n".join(reasons),
        }
        if status == "drift":
            attrs["differences"] = "\n".join(reasons)
        attrs.update(extra or {})
        event = NodeEvent(
            node=self.identity,
            event_id=self._new_id(),
            ts=self._wall(),
            kind=EVENT_KINDS[status],
            source="qos",
            device=device,
            severity=_SEVERITY[status],
            message=message + (f": {'; '.join(reasons)}" if reasons else ""),
            attributes=attrs,
        )
        log.log(logging.INFO if status == "applied" else logging.WARNING, "%s", event.message)
        try:
            await self._emit(event)
        except Exception:
            log.exception("cannot publish the QoS event %s", event.kind)
