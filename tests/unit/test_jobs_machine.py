"""The job state machine and job validation: pure, over injected time."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest
from msgspec.structs import replace

from metalguard.controller.jobs import machine as m
from metalguard.controller.jobs.spec import JobRejectedError, parse_job
from metalguard.controller.jobs.straggler_watch import JOB_SLOWED
from metalguard.proto.codec import decode, encode
from metalguard.proto.events import CommandReply
from metalguard.proto.jobs import JOB_EVENT_KINDS, CheckpointRef, Job, JobStatus
from tests.support.clock import T0

NODES = ("r.c.n1", "r.c.n2")
HEALTHY = {"r.c.n1": "HEALTHY", "r.c.n2": "HEALTHY", "r.c.n3": "HEALTHY", "r.c.n4": "HEALTHY"}
TIMINGS = m.Timings(checkpoint_deadline_s=10, stop_deadline_s=10)


def job(**kw: object) -> Job:
    base: dict[str, object] = {"job_id": "j1", "name": "t", "nodes": 2, "command": "python"}
    return msgspec.convert(base | kw, Job)


def world(now: float, grades: dict[str, str] | None = None, **replies: CommandReply) -> m.World:
    return m.World(now=now, grades=grades or HEALTHY, replies=replies, timings=TIMINGS)


def ok(cid: str, **result: object) -> CommandReply:
    return CommandReply(command_id=cid, ts=T0, ok=True, result=result)  # type: ignore[arg-type]


def answer_all(sent: m.Step, **result: object) -> dict[str, CommandReply]:
    return {s.command_id: ok(s.command_id, **result) for s in sent.sends}


def running(j: Job | None = None) -> JobStatus:
    """A job started on NODES at T0 (every start answered)."""
    s = m.submitted(j or job(), T0).status
    s = m.placed(s, NODES, T0, "rack").status
    first = m.advance(s, world(T0))
    assert [x.verb for x in first.sends] == ["start", "start"]
    done = m.advance(first.status, m.World(T0, HEALTHY, answer_all(first), timings=TIMINGS))
    assert done.status.state == "running"
    return done.status


def kinds(step: m.Step) -> list[str]:
    return [e.kind for e in step.emits]


def test_a_started_job_records_generation_members_and_start_args() -> None:
    s = m.submitted(job(args=("--steps", "5"), env={"A": "1"}), T0).status
    placed = m.placed(s, NODES, T0, "rack")
    step = m.advance(placed.status, world(T0))
    assert step.status.generation == 1
    assert step.status.placement == NODES
    start = step.sends[1]
    assert start.command_id == "j1.g1.start.r1"
    assert start.args["rank"] == 1
    assert start.args["world_size"] == 2
    assert start.args["args"] == ["--steps", "5"]
    assert start.args["env"] == ["A=1"]
    assert start.args["resume_from"] == ""
    assert kinds(placed) == ["job.placed"]


def test_fault_checkpoints_stops_and_waits_for_a_placement_without_the_node() -> None:
    s = running()
    s = m.observe_member(s, "r.c.n1", 1, T0 + 5, step=40)
    bad = HEALTHY | {"r.c.n2": "FAILING"}
    step = m.advance(s, world(T0 + 6, bad))
    assert step.status.state == "checkpointing"
    assert step.status.move is not None
    assert step.status.move.exclude == ("r.c.n2",)
    assert {x.verb for x in step.sends} == {"checkpoint"}
    replies = answer_all(step, step=41, path="/ck/ckpt-41")
    step2 = m.advance(step.status, m.World(T0 + 7, bad, replies, timings=TIMINGS))
    assert step2.status.move is not None
    assert step2.status.move.phase == "stopping"
    assert step2.status.move.checkpoint == CheckpointRef(path="/ck/ckpt-41", step=41, ts=T0 + 7)
    assert {x.verb for x in step2.sends} == {"stop"}
    assert "job.checkpointed" in kinds(step2)
    replies |= answer_all(step2)
    step3 = m.advance(step2.status, m.World(T0 + 8, bad, replies, timings=TIMINGS))
    assert step3.status.move is not None
    assert step3.status.move.phase == "placing"
    assert m.needs_placement(step3.status)
    assert "job.stopped" in kinds(step3)
    # the queue pass places it on two other nodes; the starts resume from the checkpoint
    step4 = m.placed(step3.status, ("r.c.n3", "r.c.n4"), T0 + 9)
    step5 = m.advance(step4.status, m.World(T0 + 9, bad, replies, timings=TIMINGS))
    assert {x.args["resume_from"] for x in step5.sends} == {"/ck/ckpt-41"}
    replies |= answer_all(step5)
    step6 = m.advance(step5.status, m.World(T0 + 10, bad, replies, timings=TIMINGS))
    s6 = step6.status
    assert s6.state == "running"
    assert s6.generation == 2
    assert s6.restarts == 1
    assert s6.resumed_from_step == 41
    assert s6.steps_redone == 0
    assert s6.downtime_s == 4.0
    assert kinds(step6) == ["job.started", "job.rescheduled"]
    rescheduled = step6.emits[1].attributes
    assert rescheduled["from"] == "r.c.n1,r.c.n2"
    assert rescheduled["to"] == "r.c.n3,r.c.n4"


def test_checkpoint_deadline_falls_back_to_the_last_periodic_checkpoint() -> None:
    s = m.observe_checkpoint(running(), CheckpointRef(path="/ck/10", step=10, ts=T0))
    s = m.observe_member(s, "r.c.n1", 1, T0 + 1, step=25)
    bad = HEALTHY | {"r.c.n1": "FAILING"}
    step = m.advance(s, world(T0 + 2, bad))
    assert step.status.state == "checkpointing"
    late = m.advance(step.status, world(T0 + 2 + TIMINGS.checkpoint_deadline_s, bad))
    move = late.status.move
    assert move is not None
    assert move.phase == "stopping"
    assert not move.fresh
    assert move.checkpoint is not None
    assert move.checkpoint.step == 10


def test_a_dead_node_skips_the_checkpoint_and_counts_as_stopped() -> None:
    s = m.observe_checkpoint(running(), CheckpointRef(path="/ck/10", step=10, ts=T0))
    s = m.observe_member(s, "r.c.n2", 1, T0 + 1, step=30)
    dead = HEALTHY | {"r.c.n2": "UNREACHABLE"}
    step = m.advance(s, world(T0 + 2, dead))
    assert step.status.move is not None
    assert step.status.move.cause == "lost"
    assert [(x.verb, x.node) for x in step.sends] == [("stop", "r.c.n1")]
    step2 = m.advance(step.status, m.World(T0 + 3, dead, answer_all(step), timings=TIMINGS))
    assert m.needs_placement(step2.status)
    placed = m.placed(step2.status, ("r.c.n3", "r.c.n4"), T0 + 4)
    starts = m.advance(placed.status, world(T0 + 4, dead))
    done = m.advance(starts.status, m.World(T0 + 5, dead, answer_all(starts), timings=TIMINGS))
    assert done.status.resumed_from_step == 10
    assert done.status.steps_redone == 20
    assert kinds(done) == ["job.started", "job.rescheduled", "job.lost_progress"]


def test_the_move_is_finished_from_the_stored_status_after_a_restart() -> None:
    s = running()
    step = m.advance(s, world(T0 + 1, HEALTHY | {"r.c.n2": "FAILING"}))
    stored = decode(encode(step.status), JobStatus)  # what MG_JOBS holds
    again = m.advance(stored, world(T0 + 2, HEALTHY | {"r.c.n2": "FAILING"}))
    assert [x.command_id for x in again.sends] == [x.command_id for x in step.sends]


def test_hang_restarts_on_the_same_nodes_from_the_periodic_checkpoint() -> None:
    s = running(job(hang_timeout=5.0))
    s = m.observe_checkpoint(s, CheckpointRef(path="/ck/3", step=3, ts=T0))
    s = m.observe_member(s, "r.c.n1", 1, T0 + 1, step=4)
    s = m.observe_member(s, "r.c.n2", 1, T0 + 4, step=6)
    assert m.advance(s, world(T0 + 5.5)).status.state == "running"
    step = m.advance(s, world(T0 + 6))
    assert kinds(step)[0] == "job.hung"
    assert step.emits[0].attributes["last_steps"] == "0=4,1=6"
    assert {x.verb for x in step.sends} == {"stop"}
    assert step.status.crashes == 1
    step2 = m.advance(step.status, m.World(T0 + 7, HEALTHY, answer_all(step), timings=TIMINGS))
    assert step2.status.placement == NODES
    assert step2.status.generation == 2
    assert {x.args["resume_from"] for x in step2.sends} == {"/ck/3"}


def test_a_job_without_hang_timeout_is_judged_by_the_default_once_it_reports_progress() -> None:
    timings = m.Timings(checkpoint_deadline_s=10, stop_deadline_s=10, hang_timeout_s=60.0)
    s = running(job())  # no hang_timeout: the controller's default
    assert s.job is not None
    assert s.job.hang_timeout is None
    # no member has reported a step yet: the default is not armed (a workload that never
    # reports progress is not called hung)
    quiet = m.advance(s, m.World(T0 + 600, HEALTHY, timings=timings))
    assert quiet.status.state == "running"
    s = m.observe_member(s, "r.c.n1", 1, T0 + 1, step=4)
    s = m.observe_member(s, "r.c.n2", 1, T0 + 1, step=4)
    assert m.advance(s, m.World(T0 + 60, HEALTHY, timings=timings)).status.state == "running"
    # on a SUB_HEALTHY node too: its jobs run on, so they are judged there
    sub_healthy = {**HEALTHY, "r.c.n2": "SUB_HEALTHY"}
    step = m.advance(s, m.World(T0 + 61, sub_healthy, timings=timings))
    assert kinds(step)[0] == "job.hung"
    assert step.emits[0].attributes["by_default"] is True
    assert step.emits[0].attributes["hang_timeout"] == 60.0
    assert "the controller's default" in step.emits[0].message


@pytest.mark.parametrize(("hang_timeout", "hung"), [(0.0, False), (30.0, True), (None, False)])
def test_a_jobs_own_hang_timeout_wins_and_zero_is_off(
    hang_timeout: float | None, hung: bool
) -> None:
    timings = m.Timings(hang_timeout_s=3600.0)
    s = running(job(hang_timeout=hang_timeout))
    s = m.observe_member(s, "r.c.n1", 1, T0 + 1, step=4)
    step = m.advance(s, m.World(T0 + 40, HEALTHY, timings=timings))
    assert (kinds(step)[:1] == ["job.hung"]) is hung


def test_a_crashing_job_fails_after_its_restart_budget() -> None:
    s = running(job(max_restarts=1))
    replies: dict[str, CommandReply] = {}
    seen: list[str] = []
    for generation in (1, 2):
        s = m.observe_member(s, "r.c.n1", generation, T0 + generation, exit_code=1)
        for _ in range(3):  # crash -> stop -> start (or failed)
            step = m.advance(s, m.World(T0 + generation, HEALTHY, replies, timings=TIMINGS))
            replies |= answer_all(step)
            seen += kinds(step)
            s = step.status
        assert s.generation == 2
    assert seen.count("job.crashed") == 2
    assert s.state == "failed"
    assert "restart budget of 1 spent" in s.reason
    assert seen[-1] == "job.failed"


def test_a_crash_names_its_cause_when_the_node_knows_it() -> None:
    """docs/kmsg.md: a member the OOM killer killed crashes the job with that cause."""
    s = running(job(max_restarts=1))
    s = m.observe_member(s, "r.c.n1", 1, T0 + 1, exit_code=-9, exit_cause="oom-killed")
    assert s.members[0].exit_cause == "oom-killed"
    step = m.advance(s, m.World(T0 + 1, HEALTHY, {}, timings=TIMINGS))
    (crashed,) = [e for e in step.emits if e.kind == "job.crashed"]
    assert crashed.attributes["cause"] == "oom-killed"
    plain = m.observe_member(running(job()), "r.c.n1", 1, T0 + 1, exit_code=1)
    (other,) = [e for e in m.advance(plain, world(T0 + 1)).emits if e.kind == "job.crashed"]
    assert "cause" not in other.attributes


def test_success_needs_every_member_and_keeps_rank_0s_digest() -> None:
    s = running()
    s = m.observe_member(s, "r.c.n1", 1, T0 + 1, exit_code=0, digest="abc")
    assert m.advance(s, world(T0 + 1)).status.state == "running"
    s = m.observe_member(s, "r.c.n2", 1, T0 + 2, exit_code=0, digest="abc")
    step = m.advance(s, world(T0 + 2))
    assert step.status.state == "succeeded"
    assert step.status.digest == "abc"
    assert kinds(step) == ["job.finished"]


def test_stale_reports_of_an_older_generation_are_ignored() -> None:
    s = running()
    assert m.observe_member(s, "r.c.n1", 0, T0 + 1, exit_code=1) == s


def test_preemption_checkpoints_stops_and_requeues() -> None:
    s = running(job(preemptible=True))
    step = m.preempt(s, T0 + 1, "j-big")
    assert kinds(step) == ["job.preempted"]
    step = m.advance(step.status, world(T0 + 1))
    replies = answer_all(step, step=7, path="/ck/7")
    step = m.advance(step.status, m.World(T0 + 2, HEALTHY, replies, timings=TIMINGS))
    replies |= answer_all(step)
    step = m.advance(step.status, m.World(T0 + 3, HEALTHY, replies, timings=TIMINGS))
    s = step.status
    assert s.state == "queued"
    assert s.placement == ()
    assert m.needs_placement(s)
    assert s.last_checkpoint is not None
    assert s.last_checkpoint.step == 7
    back = m.placed(s, ("r.c.n3", "r.c.n4"), T0 + 10)
    starts = m.advance(back.status, world(T0 + 10))
    assert {x.args["resume_from"] for x in starts.sends} == {"/ck/7"}


def test_cancel_of_a_running_job_stops_it() -> None:
    s = m.request_cancel(running(), T0 + 1)
    step = m.advance(s, world(T0 + 1))
    assert {x.verb for x in step.sends} == {"stop"}
    step = m.advance(step.status, m.World(T0 + 2, HEALTHY, answer_all(step), timings=TIMINGS))
    assert step.status.state == "cancelled"
    assert "job.cancelled" in kinds(step)


def test_cancel_of_a_job_waiting_to_be_placed_again_ends_it() -> None:
    """A move stopped the members and waits for the queue pass (no room): a cancel then
    ends the job at once (the queue pass skips a job with a cancel requested)."""
    bad = HEALTHY | {"r.c.n2": "FAILING"}
    step = m.advance(running(), world(T0 + 6, bad))
    replies = answer_all(step, step=1, path="/ck/ckpt-1")
    step = m.advance(step.status, m.World(T0 + 7, bad, replies, timings=TIMINGS))
    replies |= answer_all(step)
    step = m.advance(step.status, m.World(T0 + 8, bad, replies, timings=TIMINGS))
    assert step.status.move is not None
    assert step.status.move.phase == "placing"
    waiting = m.request_cancel(step.status, T0 + 9)
    assert not m.needs_placement(waiting)
    ended = m.advance(waiting, m.World(T0 + 9, bad, replies, timings=TIMINGS))
    assert ended.status.state == "cancelled"
    assert ended.status.move is None
    assert "job.cancelled" in kinds(ended)


@pytest.mark.parametrize(
    ("raw", "reasons"),
    [
        ({"name": "x"}, ["command: must not be empty (the program each member runs)"]),
        ({"name": "x", "command": "p", "nodes": 0, "bogus": 1}, ["bogus: unknown key", "nodes"]),
        ({"command": "p", "max_spread": "planet"}, ["max_spread", "name: missing (required)"]),
        ({"name": "x", "command": "p", "env": {"MG_RANK": "1"}}, ["env.MG_RANK"]),
        ({"name": "x", "command": "p", "hang_timeout": -1}, ["hang_timeout"]),
        ([1], ["the job must be an object"]),
    ],
)
def test_invalid_jobs_are_rejected_with_every_reason(raw: object, reasons: list[str]) -> None:
    with pytest.raises(JobRejectedError) as info:
        parse_job(raw, T0)
    for expected in reasons:
        assert any(r.startswith(expected) for r in info.value.reasons), info.value.reasons
    assert len(info.value.reasons) == len(reasons)


def test_a_valid_job_gets_an_id_and_its_submission_time() -> None:
    parsed = parse_job({"name": "x", "command": "python", "args": ["a"]}, T0)
    assert parsed.job_id.startswith("j-")
    assert parsed.submitted_ts == T0
    assert replace(parsed, job_id="j", submitted_ts=0) == job(
        job_id="j", name="x", nodes=1, args=("a",)
    )


def test_a_node_lost_while_starting_moves_the_job_again() -> None:
    s = m.submitted(job(), T0).status
    s = m.placed(s, NODES, T0, "rack").status
    starts = m.advance(s, world(T0))
    one = {starts.sends[0].command_id: ok(starts.sends[0].command_id)}
    dead = HEALTHY | {"r.c.n2": "UNREACHABLE"}
    step = m.advance(starts.status, m.World(T0 + 1, dead, one, timings=TIMINGS))
    assert step.status.move is not None
    assert step.status.move.exclude == ("r.c.n2",)
    assert [(x.verb, x.node) for x in step.sends] == [("stop", "r.c.n1")]


def test_a_start_never_answered_moves_the_job_after_the_deadline() -> None:
    s = m.submitted(job(), T0).status
    s = m.placed(s, NODES, T0, "rack").status
    starts = m.advance(s, world(T0))
    one = {starts.sends[0].command_id: ok(starts.sends[0].command_id)}
    assert m.advance(starts.status, m.World(T0 + 1, HEALTHY, one, timings=TIMINGS)).sends
    late = T0 + TIMINGS.start_deadline_s
    step = m.advance(starts.status, m.World(late, HEALTHY, one, timings=TIMINGS))
    assert step.status.move is not None
    assert step.status.move.exclude == ("r.c.n2",)


def test_every_job_event_kind_is_documented() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "protocol.md").read_text()
    missing = [k for k in sorted(JOB_EVENT_KINDS) if f"`{k}`" not in doc]
    assert not missing
    source = Path(m.__file__).read_text()
    # the machine's, and the straggler watch's whole-job slowdown (the job manager's)
    emitted = set(re.findall(r'"((?:job|tenant)\.[a-z_]+)"', source))
    emitted |= {"job.failed", "job.cancelled"}
    emitted |= {JOB_SLOWED}
    assert emitted == JOB_EVENT_KINDS


def _in_phase(phase: str, cause: str = "node_failing") -> JobStatus:
    """A running job on NODES whose move (off r.c.n2, or a restart) is in ``phase``."""
    s = running(job(hang_timeout=5.0))
    s = m.observe_checkpoint(s, CheckpointRef(path="/ck/5", step=5, ts=T0))
    if cause == "hang":
        step = m.advance(s, world(T0 + 10))  # no progress for 10 s: hung, stopping
    else:
        step = m.advance(s, world(T0, HEALTHY | {"r.c.n2": "FAILING"}))
    status = step.status
    assert status.move is not None
    if phase == "stopping" and status.move.phase == "checkpointing":
        status = m.advance(status, world(T0 + TIMINGS.checkpoint_deadline_s, FAILED2)).status
    assert status.move is not None
    assert status.move.phase == phase
    return msgspec.structs.replace(
        status, move=msgspec.structs.replace(status.move, phase_ts=T0 + 100)
    )


FAILED2 = HEALTHY | {"r.c.n2": "FAILING"}


@pytest.mark.parametrize(
    ("phase", "cause", "answered", "dt", "phase_after", "verbs"),
    [
        ("checkpointing", "node_failing", False, 1, "checkpointing", {"checkpoint"}),
        ("checkpointing", "node_failing", True, 1, "stopping", {"stop"}),
        ("checkpointing", "node_failing", False, 10, "stopping", {"stop"}),
        ("stopping", "node_failing", False, 1, "stopping", {"stop"}),
        ("stopping", "node_failing", True, 1, "placing", set()),
        ("stopping", "node_failing", False, 10, "placing", set()),
        ("stopping", "hang", True, 1, "starting", {"start"}),
    ],
)
def test_move_phases_table(
    phase: str, cause: str, answered: bool, dt: float, phase_after: str, verbs: set[str]
) -> None:
    status = _in_phase(phase, cause)
    grades = HEALTHY if cause == "hang" else FAILED2
    pending = m.advance(status, world(T0 + 100, grades))
    replies = answer_all(pending, step=9, path="/ck/9") if answered else {}
    step = m.advance(status, m.World(T0 + 100 + dt, grades, replies, timings=TIMINGS))
    move = step.status.move
    assert move is not None
    assert move.phase == phase_after
    assert {x.verb for x in step.sends} == verbs
