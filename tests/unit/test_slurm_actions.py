"""The event -> Slurm action mapping (controller/slurm/actions.py): pure, idempotent,
never resuming an operator's drain, capped for automatic drains."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from metalguard.controller.slurm.actions import (
    REASON_MAX,
    Action,
    Drain,
    Evacuate,
    Resume,
    Skip,
    Trigger,
    down_changes,
    drain_cap,
    drain_reason,
    plan,
    trigger_of,
    trigger_of_record,
)
from metalguard.controller.slurm.parse import SlurmJob, SlurmNode
from metalguard.proto.base import AttrValue, NodeIdentity, Reason
from metalguard.proto.events import ControllerEvent
from metalguard.proto.nodes import NodeRecord

PREFIX = "metalguard:"
OURS = "metalguard: node.isolated: ecc"


def event(
    kind: str,
    node: str | None = "g1",
    by: str = "controller",
    attrs: dict[str, AttrValue] | None = None,
) -> ControllerEvent:
    return ControllerEvent(
        event_id=f"r1.c1.{node}:{kind}:b7",
        ts=1.0,
        region="r1",
        kind=kind,
        node=NodeIdentity(region="r1", cluster="c1", node=node) if node else None,
        reasons=(Reason(signal="edac.ue_count", value=1, rule="ecc", message="UE on DIMM_A1"),),
        attributes={"by": by, **(attrs or {})},
    )


def trig(kind: str, by: str = "controller", **attrs: AttrValue) -> Trigger:
    t = trigger_of(event(kind, by=by, attrs=attrs))
    assert t is not None
    return t


def view(*nodes: SlurmNode) -> dict[str, SlurmNode]:
    return {n.name: n for n in nodes}


def idle(name: str = "g1", reason: str = "", drained: bool = False) -> SlurmNode:
    return SlurmNode(name, "IDLE", frozenset({"DRAIN"} if drained else set()), reason)


def run_plan(
    t: Trigger, nodes: dict[str, SlurmNode], jobs: Sequence[SlurmJob] = (), name: str = "g1"
) -> tuple[Action, ...]:
    return plan(t, name, nodes, jobs, prefix=PREFIX, max_fraction=0.5, min_nodes=1)


# --- which decisions mean what -------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "by", "attrs", "intent", "automatic"),
    [
        ("node.isolated", "controller", {"action": "isolate"}, "evacuate", True),
        ("node.held", "controller", {}, "evacuate", True),
        ("node.sub_healthy", "controller", {}, "drain", True),
        ("node.maintenance", "controller", {}, "drain", True),
        ("node.maintenance", "operator:alice", {"action": "isolate"}, "evacuate", False),
        ("node.cordoned", "operator:alice", {}, "drain", False),
        ("node.returned", "controller", {"action": "release"}, "resume", True),
        ("node.uncordoned", "operator:alice", {}, "resume", False),
    ],
)
def test_decisions_map_to_intents(
    kind: str, by: str, attrs: dict[str, AttrValue], intent: str, automatic: bool
) -> None:
    t = trig(kind, by, **attrs)
    assert (t.intent, t.automatic, t.handle) == (intent, automatic, "r1.c1.g1")
    assert t.why == "UE on DIMM_A1"


@pytest.mark.parametrize(
    "kind", ["node.unreachable", "node.graded", "job.placed", "rail.tripped", "slurm.drained"]
)
def test_other_kinds_ask_nothing_of_slurm(kind: str) -> None:
    assert trigger_of(event(kind)) is None


def test_an_event_without_a_node_asks_nothing() -> None:
    assert trigger_of(event("node.isolated", node=None)) is None


def record(**fields: object) -> NodeRecord:
    reasons = (Reason(signal="edac.ue_count", value=1, rule="ecc", message="UE on DIMM_A1"),)
    base = NodeRecord(node=NodeIdentity(region="r1", cluster="c1", node="g1"), reasons=reasons)
    return msgspec.structs.replace(base, updated_ts=12.5, **fields)


@pytest.mark.parametrize(
    ("fields", "kind", "intent", "automatic", "why"),
    [
        ({"grade": "FAILING"}, "node.isolated", "evacuate", True, "UE on DIMM_A1"),
        ({"grade": "FAILING", "held": True}, "node.held", "evacuate", True, "UE on DIMM_A1"),
        ({"grade": "SUB_HEALTHY"}, "node.sub_healthy", "drain", True, "UE on DIMM_A1"),
        ({"grade": "MAINTENANCE"}, "node.maintenance", "drain", True, "UE on DIMM_A1"),
        (
            {"grade": "MAINTENANCE", "maintenance": True, "operator_reason": "PSU swap"},
            "node.maintenance",
            "evacuate",
            False,
            "PSU swap",
        ),
        (
            {"cordoned": True, "operator_reason": "burn-in"},
            "node.cordoned",
            "drain",
            False,
            "burn-in",
        ),
    ],
)
def test_records_out_of_service_reconcile_as_their_events_would(
    fields: dict[str, object], kind: str, intent: str, automatic: bool, why: str
) -> None:
    t = trigger_of_record(record(**fields))
    assert t is not None
    assert (t.kind, t.intent, t.automatic, t.why) == (kind, intent, automatic, why)
    assert t.event_id == "reconcile@12500"


@pytest.mark.parametrize("grade", ["HEALTHY", "UNREACHABLE"])
def test_records_in_service_ask_nothing_and_nothing_is_resumed(grade: str) -> None:
    assert trigger_of_record(record(grade=grade)) is None


# --- plans ---------------------------------------------------------------------------------


def test_isolation_drains_and_evacuates_the_jobs_on_the_node() -> None:
    jobs = [
        SlurmJob("7", "RUNNING", ("g1", "g2")),
        SlurmJob("8", "RUNNING", ("g2",)),
        SlurmJob("9", "PENDING", ()),
        SlurmJob("10", "RUNNING", ("g1",), requeue=False),
    ]
    actions = run_plan(trig("node.isolated"), view(idle("g1"), idle("g2")), jobs)
    assert actions == (
        Drain("g1", "metalguard: node.isolated: UE on DIMM_A1"),
        Evacuate("g1", ("7",)),
        Skip("g1", "job 10 is not requeueable: left to Slurm"),
    )


def test_sub_healthy_drains_softly_and_leaves_jobs_running() -> None:
    jobs = [SlurmJob("7", "RUNNING", ("g1",))]
    actions = run_plan(trig("node.sub_healthy"), view(idle("g1"), idle("g2")), jobs)
    assert actions == (Drain("g1", "metalguard: node.sub_healthy: UE on DIMM_A1"),)


def test_repeated_isolation_does_not_stack() -> None:
    nodes = view(idle("g1", OURS, drained=True), idle("g2"))
    requeued = [SlurmJob("7", "PENDING", ())]
    assert run_plan(trig("node.isolated"), nodes, requeued) == ()


def test_an_operators_drain_is_kept_but_jobs_still_move() -> None:
    nodes = view(idle("g1", "disk swap", drained=True), idle("g2"))
    actions = run_plan(trig("node.isolated"), nodes, [SlurmJob("7", "RUNNING", ("g1",))])
    assert actions == (
        Skip("g1", "already drained by someone else (disk swap): kept"),
        Evacuate("g1", ("7",)),
    )


def test_resume_only_what_metalguard_drained() -> None:
    assert run_plan(trig("node.returned"), view(idle("g1", OURS, drained=True))) == (Resume("g1"),)
    by_hand = view(idle("g1", "disk swap", drained=True))
    assert run_plan(trig("node.uncordoned", "operator:bob"), by_hand) == (
        Skip("g1", "drained by someone else (disk swap): not resumed"),
    )
    no_reason = view(idle("g1", "", drained=True))
    assert isinstance(run_plan(trig("node.returned"), no_reason)[0], Skip)
    assert run_plan(trig("node.returned"), view(idle("g1"))) == ()


def test_a_lookalike_reason_is_not_ours() -> None:
    """The prefix must start the reason: an operator quoting metalguard is not metalguard."""
    quoting = view(idle("g1", "see metalguard: isolated earlier", drained=True))
    assert isinstance(run_plan(trig("node.returned"), quoting)[0], Skip)


def test_a_node_slurm_does_not_know_is_skipped() -> None:
    assert run_plan(trig("node.isolated"), view(idle("g2"))) == (
        Skip("g1", "not a node of this Slurm cluster"),
    )


def test_the_bridge_cap_refuses_automatic_drains_beyond_it() -> None:
    nodes = view(idle("g1"), idle("g2", OURS, drained=True), *(idle(f"x{i}") for i in range(8)))
    # 10 nodes x 10 % = 1, already used by g2
    capped = plan(
        trig("node.isolated"),
        "g1",
        nodes,
        [SlurmJob("7", "RUNNING", ("g1",))],
        prefix=PREFIX,
        max_fraction=0.1,
        min_nodes=1,
    )
    assert capped == (Skip("g1", "bridge cap: 1 of 10 Slurm nodes already drained (limit 1)"),)
    by_operator = plan(
        trig("node.maintenance", "operator:alice", action="isolate"),
        "g1",
        nodes,
        [],
        prefix=PREFIX,
        max_fraction=0.1,
        min_nodes=1,
    )
    assert by_operator == (Drain("g1", "metalguard: node.maintenance: UE on DIMM_A1"),)


@pytest.mark.parametrize(
    ("total", "fraction", "min_nodes", "cap"),
    [(25, 0.1, 1, 2), (5, 0.1, 1, 1), (5, 0.1, 0, 0), (100, 0.29, 1, 29), (2, 1.0, 5, 2)],
)
def test_drain_cap(total: int, fraction: float, min_nodes: int, cap: int) -> None:
    assert drain_cap(total, fraction, min_nodes) == cap


def test_drain_reason_is_one_bounded_line() -> None:
    t = dataclasses.replace(trig("node.isolated"), why="line one\nline two " + "x" * 400)
    reason = drain_reason(PREFIX, t)
    assert reason.startswith("metalguard: node.isolated: line one line two x")
    assert "\n" not in reason
    assert len(reason) == REASON_MAX


def test_down_changes_announce_each_transition_once() -> None:
    up, down = idle("g1"), SlurmNode("g2", "DOWN", frozenset({"NOT_RESPONDING"}))
    newly, back, state = down_changes(frozenset(), [up, down])
    assert (newly, back, state) == ((down,), (), frozenset({"g2"}))
    assert down_changes(state, [up, down]) == ((), (), state)
    assert down_changes(state, [up, idle("g2")]) == ((), ("g2",), frozenset())


# --- idempotence, as a property ------------------------------------------------------------


def apply(actions: Sequence[Action], nodes: dict[str, SlurmNode], jobs: list[SlurmJob]) -> None:
    """What Slurm does with the actions (the state the next plan sees)."""
    for a in actions:
        if isinstance(a, Drain):
            n = nodes[a.slurm_node]
            nodes[a.slurm_node] = dataclasses.replace(n, flags=n.flags | {"DRAIN"}, reason=a.reason)
        elif isinstance(a, Resume):
            nodes[a.slurm_node] = dataclasses.replace(
                nodes[a.slurm_node], flags=frozenset(), reason=""
            )
        elif isinstance(a, Evacuate):
            jobs[:] = [SlurmJob(j.job_id, "PENDING") if j.job_id in a.job_ids else j for j in jobs]


KINDS = ["node.isolated", "node.sub_healthy", "node.returned", "node.uncordoned", "node.held"]


@given(st.lists(st.sampled_from(KINDS), min_size=1, max_size=8), st.booleans())
def test_the_same_decision_twice_changes_nothing_the_second_time(
    kinds: list[str], hand_drained: bool
) -> None:
    nodes = view(idle("g1", "disk swap", drained=hand_drained), idle("g2"))
    jobs = [SlurmJob("7", "RUNNING", ("g1",))]
    for kind in kinds:
        t = trig(kind)
        apply(run_plan(t, nodes, jobs), nodes, jobs)
        again = run_plan(t, nodes, jobs)
        assert not [a for a in again if isinstance(a, Drain | Resume | Evacuate)], (kind, again)
        if hand_drained:
            assert nodes["g1"].reason == "disk swap"  # never overwritten, never resumed
            assert nodes["g1"].drained
