"""The life of an instance and of a provisioned node as pure functions (docs/provisioning.md).

An instance: ``deploying`` -> ``active`` -> (``switching`` -> ``active``)* -> ``releasing``
-> ``released``; ``deploying``/``switching`` -> ``deploy_failed`` when no ready report
came within the deploy timeout (a deploy whose request named no node is first retried on
another node, up to ``max_attempts`` nodes).  Every function here takes the time as an
argument and returns the new record and the events to announce (:class:`Step`); the
manager (controller/provision/manager.py) writes the record to KV **before** it acts, so a
restarted controller finds each step it was taking.

A node (:class:`NodeClaim`, KV ``node.<handle>``): free, or claimed by one instance; its
consecutive deploy failures are counted and at ``max_failures`` it is *flagged*: no more
deploys until an operator clears it.  Volumes (:class:`VolumeEntry`, KV ``vol.<name>``)
record which live instance uses them and whether they ever booted, so a failed deploy
deletes only the fresh volume it made (never a tenant's data).

The deploy deadline is not a field: it is the time of the instance's last transition into
``deploying``/``switching`` plus the timeout (:func:`deadline`), so a controller restarted
mid-deploy keeps it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final, Literal

import msgspec
from msgspec.structs import replace

from metalguard.controller.core.grades import why_no_new_work
from metalguard.proto.base import AttrValue
from metalguard.proto.provision import (
    Instance,
    InstanceRequest,
    InstanceState,
    InstanceTransition,
    NodeProvisionState,
    Volume,
)

HISTORY_MAX: Final = 50
BOOTING: Final = frozenset({"deploying", "switching"})
"""States waiting for the node's ready report (the deploy timeout runs)."""
LIVE: Final = frozenset({"deploying", "active", "switching", "releasing"})
"""States that hold a node, a volume and (but for releasing) an export."""


class NodeClaim(msgspec.Struct, frozen=True, kw_only=True):
    """A provisioned node's KV record (``node.<handle>``): its instance and failures."""

    node: str
    instance_id: str = ""
    """The live instance on the node ("" = free)."""
    failures: int = 0
    """Consecutive deploys that failed on it (reset by a deploy that became active)."""
    flagged: bool = False
    """``failures`` reached ``max_failures``: not deployed until cleared."""
    updated_ts: float = 0.0


class VolumeEntry(msgspec.Struct, frozen=True, kw_only=True):
    """A volume's KV record (``vol.<name>``): the volume and who uses it."""

    volume: Volume
    used_by: str = ""
    """The live instance whose root it is ("" = kept for its tenant, free)."""
    created_by: str = ""
    """The instance it was made for ("" = made by someone else)."""
    booted: bool = False
    """A node reported ready from it once: it may hold the tenant's data."""


@dataclass(frozen=True, slots=True)
class Emit:
    """An event to announce: ``kind`` (``instance.*``, ``node.provision_flagged``)."""

    kind: str
    event_id: str
    node: str = ""
    message: str = ""
    attributes: dict[str, AttrValue] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Step:
    """A new instance record and the events its transition announces."""

    instance: Instance
    emits: tuple[Emit, ...] = ()


# --- transitions ------------------------------------------------------------------------


def transition(
    inst: Instance, state: InstanceState, now: float, reason: str, **changes: object
) -> Instance:
    """``inst`` in ``state`` (with ``changes``), the move recorded in its history."""
    node = str(changes.get("node", inst.node))
    moved = InstanceTransition(ts=now, state=state, reason=reason, node=node)
    history = (*inst.history, moved)[-HISTORY_MAX:]
    return replace(inst, state=state, updated_ts=now, history=history, **changes)


def emit(inst: Instance, kind: str, message: str, **extra: AttrValue) -> Emit:
    """The event of ``inst``'s newest transition (a deterministic id: a republish of the
    same transition is the same event)."""
    last = inst.history[-1] if inst.history else None
    stamp = repr(last.ts) if last is not None else "0"
    attributes: dict[str, AttrValue] = {
        "instance": inst.instance_id,
        "tenant": inst.tenant,
        "image": inst.image,
        "volume": inst.volume,
        "node": inst.node,
        "state": inst.state,
        **extra,
    }
    return Emit(
        kind=kind,
        event_id=f"{kind}:{inst.instance_id}:{stamp}",
        node=inst.node,
        message=message,
        attributes=attributes,
    )


def new_instance(
    req: InstanceRequest, instance_id: str, volume: str, export: str, node: str, now: float
) -> Step:
    """A requested instance, deploying on ``node`` with ``volume`` exported as ``export``."""
    inst = Instance(
        instance_id=instance_id,
        tenant=req.tenant,
        image=req.image,
        volume=volume,
        state="deploying",
        node=node,
        user_data=req.user_data,
        attempts=1,
        pinned=bool(req.node),
        sensitive=req.sensitive,
        created_ts=now,
        updated_ts=now,
        export=export,
    )
    reason = f"requested on {node}" if req.node else f"requested; {node} chosen"
    inst = transition(inst, "deploying", now, reason)
    return Step(inst, (emit(inst, "instance.deploying", f"deploying {volume} on {node}"),))


def redeployed(
    inst: Instance, node: str, export: str, now: float, reason: str, *, replacing: bool = False
) -> Step:
    """``inst`` deploying again on ``node`` (the same volume, a new export): a retry after
    a failed deploy, or a replacement of a node that failed (``replacing``)."""
    previous = inst.node
    new = transition(
        inst,
        "deploying",
        now,
        reason,
        node=node,
        export=export,
        attempts=inst.attempts + 1,
        ready_ts=None,
        ready_report={},
        error="",
    )
    emits = [emit(new, "instance.deploying", f"deploying {new.volume} on {node}: {reason}")]
    if replacing:
        message = f"{previous} replaced by {node} on volume {new.volume}"
        emits.append(emit(new, "instance.replaced", message, previous_node=previous))
    return Step(new, tuple(emits))


def activated(inst: Instance, report: Mapping[str, str], now: float) -> Step:
    """``inst`` active: its node reported ready (``report``: what the image said)."""
    started = boot_started_ts(inst)
    new = transition(
        inst,
        "active",
        now,
        "the node reported ready",
        ready_ts=now,
        ready_report=dict(report),
        error="",
    )
    took = round(now - started, 3) if started is not None else None
    return Step(
        new,
        (emit(new, "instance.active", f"{new.tenant} active on {new.node}", boot_s=took),),
    )


def switching(
    inst: Instance,
    tenant: str,
    image: str,
    volume: str,
    export: str,
    user_data: str,
    now: float,
) -> Step:
    """``inst`` switching to ``tenant``'s ``volume`` (exported as ``export``) on its node."""
    before = inst.tenant
    new = transition(
        inst,
        "switching",
        now,
        f"switching from {before} ({inst.volume}) to {tenant} ({volume})",
        tenant=tenant,
        image=image,
        volume=volume,
        export=export,
        user_data=user_data,
        ready_ts=None,
        ready_report={},
        error="",
    )
    message = f"{new.node}: {before} -> {tenant}"
    return Step(new, (emit(new, "instance.switching", message, previous_tenant=before),))


def restored(current: Instance, before: Instance, now: float, reason: str) -> Instance:
    """A failed operation rolled back: ``current`` (the record it wrote) with the fields
    of ``before`` (the record it started from) again, the rollback in its history."""
    back = replace(before, history=current.history)
    return transition(back, before.state, now, f"rolled back: {reason}", error=reason)


def releasing(inst: Instance, now: float, keep_volume: bool) -> Step:
    """``inst`` releasing its node (its volume kept or deleted)."""
    what = "kept" if keep_volume else "deleted"
    new = transition(inst, "releasing", now, f"release asked (volume {what})")
    return Step(new, (emit(new, "instance.releasing", f"releasing {new.node}", keep=keep_volume),))


def released(inst: Instance, now: float, reason: str) -> Step:
    """``inst`` released: its node is free (no export)."""
    new = transition(inst, "released", now, reason, export="")
    return Step(new, (emit(new, "instance.released", f"{new.node} released: {reason}"),))


def deploy_failed(inst: Instance, now: float, reason: str) -> Step:
    """``inst`` failed for good (no node left to try, or its node was named)."""
    new = transition(inst, "deploy_failed", now, reason, export="", error=reason)
    return Step(new, (emit(new, "instance.deploy_failed", reason),))


def node_failing(inst: Instance, grade: str, now: float) -> Step | None:
    """``inst`` marked when its node left HEALTHY while it was active (None: already
    marked): the tenant may ask for a ``replace`` on the same volume."""
    message = f"node {inst.node} is {grade}: replace it to boot the volume on another node"
    if inst.error == message:
        return None
    new = transition(inst, inst.state, now, message, error=message)
    return Step(new, (emit(new, "instance.node_failing", message, grade=grade),))


# --- deadlines and decisions --------------------------------------------------------------


def boot_started_ts(inst: Instance) -> float | None:
    """When the current boot began (the last transition into deploying/switching)."""
    if inst.state not in BOOTING:
        return None
    for moved in reversed(inst.history):
        if moved.state == inst.state:
            return moved.ts
    return inst.updated_ts


def deadline(inst: Instance, timeout_s: float) -> float | None:
    """When the current boot times out (None: not booting)."""
    started = boot_started_ts(inst)
    return None if started is None else started + timeout_s


def timed_out(inst: Instance, now: float, timeout_s: float) -> bool:
    """Whether the current boot is past its deadline."""
    due = deadline(inst, timeout_s)
    return due is not None and now >= due


def ready_by_telemetry(
    inst: Instance,
    last_seen_ts: float | None,
    last_sent_ts: float | None,
    powered_on_ts: float | None,
) -> bool:
    """Whether the node's own metalguard agent reported from the new boot (an image that
    carries the agent): a batch taken in, and sent by the node, after its power cycle
    ended (``powered_on_ts``; None: not known in this process, only the ready report
    counts)."""
    if inst.state not in BOOTING or powered_on_ts is None:
        return False
    return (
        last_seen_ts is not None
        and last_sent_ts is not None
        and last_seen_ts > powered_on_ts
        and last_sent_ts > powered_on_ts
    )


def tried_nodes(inst: Instance) -> frozenset[str]:
    """The nodes this instance was deployed on (not tried again by a retry)."""
    return frozenset(t.node for t in inst.history if t.state == "deploying" and t.node)


TimeoutAction = Literal["retry", "fail"]


def on_timeout(inst: Instance, max_attempts: int) -> TimeoutAction:
    """What a timed-out boot does: a deploy whose request named no node is retried on
    another node while attempts remain; a pinned deploy or a switch fails."""
    if inst.state == "deploying" and not inst.pinned and inst.attempts < max_attempts:
        return "retry"
    return "fail"


def command_id(inst: Instance, verb: str) -> str:
    """The BMC command id of ``verb`` for the current boot: the same for a re-send (the
    bmc-proxy answers a repeat from its memory), another for the next boot; made from a
    digest of the secret export, never the secret itself."""
    digest = hashlib.sha256(inst.export.encode()).hexdigest()[:12]
    return f"{inst.instance_id}.{digest}.{verb}"


# --- nodes -------------------------------------------------------------------------------


def claim_failed(claim: NodeClaim, max_failures: int, now: float) -> tuple[NodeClaim, Emit | None]:
    """A deploy failed on the node: the claim freed, the failure counted; the event of
    its flagging when this failure reaches ``max_failures``."""
    failures = claim.failures + 1
    flag = max_failures > 0 and failures >= max_failures
    new = replace(
        claim, instance_id="", failures=failures, flagged=claim.flagged or flag, updated_ts=now
    )
    if new.flagged and not claim.flagged:
        message = f"{claim.node}: {failures} deploys in a row failed; not deployed until cleared"
        event = Emit(
            kind="node.provision_flagged",
            event_id=f"node.provision_flagged:{claim.node}:{now!r}",
            node=claim.node,
            message=message,
            attributes={"node": claim.node, "failures": failures},
        )
        return new, event
    return new, None


def why_not_deployable(
    node: str,
    grade: str | None,
    cordoned: bool,
    claim: NodeClaim | None,
    known: bool,
    *,
    held: bool = False,
    rail_flagged: bool = False,
    sensitive: bool = False,
    dma_posture: str = "",
) -> str | None:
    """Why ``node`` cannot take a new instance now (None: it can).  ``grade``: its grade
    in the controller's records (None: no record); ``cordoned``, ``held``,
    ``rail_flagged``: its flags; ``known``: it is in ``[[provision.nodes]]`` (its MAC is
    known).  Whether it takes new work at all is ``controller.core.grades``'s answer; a
    ``sensitive`` instance also needs the node's ``dma_posture`` to be ``isolated``."""
    if not known:
        return f"{node} is not a provisioned node (no [[provision.nodes]] entry with its MAC)"
    if grade is None:
        return f"{node} is unknown to the controller (no node record: its agent never reported)"
    why = why_no_new_work(grade, cordoned=cordoned, held=held, rail_flagged=rail_flagged)
    if why is not None:
        return f"{node} is {why}"
    if sensitive and dma_posture != "isolated":
        return (
            f"{node} is not DMA-isolated ({dma_posture or 'not reported'}): a sensitive "
            "instance needs an isolated node"
        )
    if claim is not None and claim.flagged:
        return f"{node} is flagged after {claim.failures} failed deploys"
    if claim is not None and claim.instance_id:
        return f"{node} is not available: instance {claim.instance_id} is on it"
    return None


def node_state(claim: NodeClaim | None, inst: Instance | None) -> NodeProvisionState:
    """What a node is for provisioning: its live instance's state, ``deploy_failed`` while
    flagged, else ``available``."""
    held = claim is not None and inst is not None and claim.instance_id == inst.instance_id
    if held and inst is not None and inst.state in LIVE:
        if inst.state in BOOTING:
            return "deploying"
        return "active" if inst.state == "active" else "releasing"
    if claim is not None and claim.flagged:
        return "deploy_failed"
    return "available"


def pick_node(candidates: Iterable[str], exclude: Iterable[str] = ()) -> list[str]:
    """The order in which free nodes are tried (sorted, ``exclude`` left out)."""
    skip = set(exclude)
    return sorted(n for n in candidates if n not in skip)


def delete_on_failure(entry: VolumeEntry | None, instance_id: str) -> bool:
    """Whether a failed step of ``instance_id`` deletes the volume: only a fresh one made
    for it that never booted (a tenant's existing volume, or one that booted, is kept)."""
    return entry is not None and entry.created_by == instance_id and not entry.booted


def orphans(
    instances: Iterable[Instance],
    volumes: Iterable[str],
    entries: Mapping[str, VolumeEntry],
    exports: Iterable[str],
    claims: Mapping[str, NodeClaim],
) -> list[str]:
    """What nothing live owns (empty: nothing orphaned): exports no live instance holds,
    volumes on disk without a record or records without a volume, claims of no live
    instance, live instances whose volume is gone."""
    live = {i.instance_id: i for i in instances if i.state in LIVE}
    owned_exports = {i.export for i in live.values() if i.export and i.state != "releasing"}
    problems = [f"export {e[:6]}... owned by no live instance" for e in exports
                if e not in owned_exports]  # fmt: skip
    disk = set(volumes)
    problems += [f"volume {v} has no record" for v in sorted(disk - set(entries))]
    problems += [f"volume record {v} has no volume" for v in sorted(set(entries) - disk)]
    for name, entry in sorted(entries.items()):
        if entry.used_by and entry.used_by not in live:
            problems.append(f"volume {name} used by {entry.used_by}, which is not live")
    for node, claim in sorted(claims.items()):
        if claim.instance_id and claim.instance_id not in live:
            problems.append(f"node {node} claimed by {claim.instance_id}, which is not live")
    for inst in live.values():
        if inst.volume not in disk:
            problems.append(f"instance {inst.instance_id}: its volume {inst.volume} is gone")
        held = claims.get(inst.node)
        if held is None or held.instance_id != inst.instance_id:
            problems.append(f"instance {inst.instance_id} does not hold {inst.node}")
    return problems
