"""Sub-healthy means "no new work; running jobs finish" (docs/lifecycle.md): the node
enters MAINTENANCE only once its count of unfinished job members is known to be 0 (the
job manager's report, ``decide_running``), or, with jobs still on it, at the drain limit
(``sub_healthy_drain_after_s``: MAINTENANCE with ``isolate``, its jobs moved)."""

from __future__ import annotations

import msgspec
import pytest

from metalguard.controller.core.decide import decide_running
from metalguard.controller.core.lifecycle import LifecycleConfig, Observation, observe
from metalguard.controller.jobs.machine import members_per_node
from metalguard.controller.slurm.actions import trigger_of
from metalguard.proto.base import NodeIdentity, Reason
from metalguard.proto.jobs import Job, JobStatus, MemberState
from metalguard.proto.nodes import NodeRecord

CFG = LifecycleConfig(sub_healthy_drain_after_s=3600.0)
NODE = NodeIdentity(region="r1", cluster="c1", node="n1")
LINK = Reason(signal="pcie.link_width", value=8, threshold=16, rule="pcie", message="x8")


def sub_healthy_batch(ts: float, seq: int) -> Observation:
    return Observation(
        ts=ts, seq=seq, score=65.0, grade="SUB_HEALTHY", reasons=(LINK,), interval_s=10.0
    )


def sub_healthy(running_jobs: int | None) -> NodeRecord:
    """A node that entered SUB_HEALTHY at t=10 with ``running_jobs`` known."""
    record = NodeRecord(node=NODE, interval_s=10.0, running_jobs=running_jobs)
    record = observe(record, sub_healthy_batch(10.0, 1), CFG).record
    assert record.grade == "SUB_HEALTHY"
    return record


@pytest.mark.parametrize("running_jobs", [None, 1, 3])
def test_a_sub_healthy_node_with_jobs_or_an_unknown_count_stays_sub_healthy(
    running_jobs: int | None,
) -> None:
    record = sub_healthy(running_jobs)
    for k in range(2, 50):  # hundreds of seconds of sub-healthy batches
        t = observe(record, sub_healthy_batch(10.0 * k, k), CFG)
        record = t.record
        assert record.grade == "SUB_HEALTHY"
        assert t.decisions == ()


def test_a_known_zero_drains_it_at_the_next_batch() -> None:
    record = sub_healthy(0)
    t = observe(record, sub_healthy_batch(20.0, 2), CFG)
    assert t.record.grade == "MAINTENANCE"
    assert [d.kind for d in t.decisions] == ["node.maintenance"]


def test_the_last_job_ending_drains_it_with_the_reason() -> None:
    record = sub_healthy(2)
    records = {NODE.handle: record}
    one_left = decide_running(records, {NODE.handle: 1}, 30.0, CFG)
    assert one_left.events == ()
    assert one_left.records[NODE.handle].running_jobs == 1
    records |= one_left.records
    ended = decide_running(records, {NODE.handle: 0, "r1.c1.unknown": 0}, 40.0, CFG)
    after = ended.records[NODE.handle]
    assert (after.grade, after.running_jobs) == ("MAINTENANCE", 0)
    (event,) = ended.events
    assert event.kind == "node.maintenance"
    assert event.message == "sub-healthy and its last job ended"
    assert event.attributes["grade_from"] == "SUB_HEALTHY"
    assert "action" not in event.attributes  # nothing to move: a drain
    assert event.reasons[-1].signal == "lifecycle.running_jobs"
    assert event.event_id == f"{NODE.handle}:node.maintenance:j40000"
    trigger = trigger_of(event)
    assert trigger is not None
    assert trigger.intent == "drain"
    # the same count again changes nothing (a repeated report)
    assert decide_running(records | ended.records, {NODE.handle: 0}, 50.0, CFG).records == {}


def test_a_count_on_a_healthy_node_only_records_it() -> None:
    record = NodeRecord(node=NODE, interval_s=10.0)
    out = decide_running({NODE.handle: record}, {NODE.handle: 0}, 5.0, CFG)
    assert out.events == ()
    assert out.records[NODE.handle].grade == "HEALTHY"
    assert out.records[NODE.handle].running_jobs == 0


def test_at_the_drain_limit_its_remaining_jobs_are_moved() -> None:
    record = sub_healthy(1)
    before = observe(record, sub_healthy_batch(10.0 + 3599.0, 2), CFG)
    assert before.record.grade == "SUB_HEALTHY"
    t = observe(before.record, sub_healthy_batch(10.0 + 3600.0, 3), CFG)
    assert t.record.grade == "MAINTENANCE"
    (decision,) = t.decisions
    assert decision.kind == "node.maintenance"
    assert decision.action == "isolate"  # the job manager and Slurm move its jobs
    assert decision.reasons[-1].rule == "sub_healthy_drain_after_s"
    assert "its remaining jobs are moved" in decision.message


def test_a_drain_limit_of_zero_never_moves_them() -> None:
    cfg = LifecycleConfig(sub_healthy_drain_after_s=0)
    record = NodeRecord(node=NODE, interval_s=10.0, running_jobs=1)
    record = observe(record, sub_healthy_batch(10.0, 1), cfg).record
    t = observe(record, sub_healthy_batch(10.0 + 10 * 86_400, 2), cfg)
    assert t.record.grade == "SUB_HEALTHY"


def status(state: str, placement: tuple[str, ...], *members: MemberState) -> JobStatus:
    job = msgspec.convert({"job_id": "j", "name": "j", "nodes": 2, "command": "x"}, Job)
    return msgspec.convert(
        {"job_id": "j", "job": msgspec.to_builtins(job), "state": state,
         "placement": placement, "members": [msgspec.to_builtins(m) for m in members]},
        JobStatus,
    )  # fmt: skip


def test_members_per_node_counts_what_has_not_finished() -> None:
    running = status(
        "running",
        ("a", "b"),
        MemberState(rank=0, node="a"),
        MemberState(rank=1, node="b", exit_code=0),
    )
    starting = status("placing", ("c", "d"))
    stopping_old = status(
        "placing", (), MemberState(rank=0, node="a"), MemberState(rank=1, node="f", exit_code=-15)
    )
    done = status("succeeded", ("e",), MemberState(rank=0, node="e"))
    queued = status("queued", ())
    counts = members_per_node([running, starting, stopping_old, done, queued])
    # b's member exited 0 while a's runs on: the job still holds b
    assert dict(counts) == {"a": 2, "b": 1, "c": 1, "d": 1}
