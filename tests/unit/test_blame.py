"""Blame for repeated failures (docs/jobs.md "Blame"): which nodes a crash or a hang points
at, the suspects among them (N different jobs within a window), and the lifecycle keeping
a suspect SUB_HEALTHY against clean telemetry until its suspicion ends or an uncordon."""

from __future__ import annotations

import pytest

from metalguard.controller.core.decide import decide_suspects
from metalguard.controller.core.lifecycle import (
    LifecycleConfig,
    Observation,
    observe,
    operator,
)
from metalguard.controller.jobs.blame import Failure, blamed_nodes, recent, suspects
from metalguard.proto.base import NodeIdentity
from metalguard.proto.jobs import MemberState
from metalguard.proto.nodes import NodeRecord

CFG = LifecycleConfig()
NODE = NodeIdentity(region="r1", cluster="c1", node="n1")
TWO = (MemberState(rank=0, node="a"), MemberState(rank=1, node="b"))
ONE = (MemberState(rank=0, node="a"),)


@pytest.mark.parametrize(
    ("kind", "attributes", "members", "blamed"),
    [
        ("job.crashed", {"node": "b"}, TWO, ("b",)),
        ("job.hung", {"nodes": "a"}, TWO, ("a",)),
        ("job.hung", {"nodes": "a,b"}, TWO, ()),  # every node failed: the job's own fault
        ("job.crashed", {"node": "a"}, ONE, ("a",)),  # one node: it is blamed
        ("job.finished", {"node": "a"}, TWO, ()),
        ("job.hung", {}, TWO, ()),
    ],
)
def test_which_nodes_a_failure_blames(
    kind: str, attributes: dict[str, str], members: tuple[MemberState, ...], blamed: tuple[str, ...]
) -> None:
    assert blamed_nodes(kind, attributes, members) == blamed


def test_n_different_jobs_within_the_window_make_a_suspect() -> None:
    failures = [
        Failure("a", "j1", 10.0),
        Failure("a", "j1", 20.0),  # the same job twice counts once
        Failure("a", "j2", 30.0),
        Failure("b", "j2", 30.0),
        Failure("a", "j3", 40.0),
        Failure("b", "j0", -100.0),  # outside the window
    ]
    assert suspects(failures, 50.0, 100.0, 3) == {"a": ("j1", "j2", "j3")}
    assert suspects(failures, 50.0, 100.0, 4) == {}
    assert len(recent(failures, 50.0, 100.0)) == 5
    assert suspects(failures, 200.0, 100.0, 3) == {}


def batch(ts: float, seq: int) -> Observation:
    return Observation(ts=ts, seq=seq, score=97.0, grade="HEALTHY", interval_s=10.0)


def test_a_suspect_is_sub_healthy_naming_the_jobs_until_its_suspicion_ends() -> None:
    record = observe(NodeRecord(node=NODE, interval_s=10.0, running_jobs=1), batch(0, 1), CFG)
    records = {NODE.handle: record.record}
    out = decide_suspects(records, {NODE.handle: ("j1", "j2", "j3")}, 1_000.0, 5.0, CFG)
    suspect = out.records[NODE.handle]
    assert suspect.grade == "SUB_HEALTHY"
    (event,) = out.events
    assert event.kind == "node.sub_healthy"
    assert "j1, j2, j3" in event.reasons[0].message
    assert event.reasons[0].signal == "jobs.failures"
    # clean telemetry does not clear it while it holds ...
    for k in range(2, 12):
        suspect = observe(suspect, batch(10.0 * k, k), CFG).record
        assert suspect.grade == "SUB_HEALTHY"
    # ... and once it has ended, N clean assessments do
    for k in range(3):
        suspect = observe(suspect, batch(1_000.0 + 10 * k, 100 + k), CFG).record
    assert suspect.grade == "HEALTHY"
    # the same blame again changes nothing
    again = decide_suspects(
        {NODE.handle: suspect}, {NODE.handle: ("j1", "j2", "j3")}, 1_000.0, 1_100.0, CFG
    )
    assert again.records == {}


def test_an_uncordon_ends_the_suspicion() -> None:
    record = NodeRecord(node=NODE, interval_s=10.0, running_jobs=0)
    out = decide_suspects({NODE.handle: record}, {NODE.handle: ("j1",)}, 1_000.0, 5.0, CFG)
    cleared = operator(out.records[NODE.handle], "uncordon", "ok", "ann", 6.0, CFG).record
    assert (cleared.grade, cleared.suspect_jobs, cleared.suspect_until) == ("HEALTHY", (), None)
    assert observe(cleared, batch(20.0, 2), CFG).record.grade == "HEALTHY"


def test_a_crash_the_oom_killer_caused_blames_no_node() -> None:
    from metalguard.controller.jobs.blame import blamed_nodes
    from metalguard.proto.base import AttrValue
    from metalguard.proto.jobs import MemberState

    members = (MemberState(rank=0, node="a"), MemberState(rank=1, node="b"))
    crashed: dict[str, AttrValue] = {"node": "b", "rank": 1, "exit_code": -9}
    assert blamed_nodes("job.crashed", crashed, members) == ("b",)
    assert blamed_nodes("job.crashed", {**crashed, "cause": "oom-killed"}, members) == ()
