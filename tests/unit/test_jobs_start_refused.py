"""Refused starts in the job state machine (pure, over injected time): a refused start
counts as a restart with exponential backoff; a permanent cause fails the job at once with
one ``job.failed``; the agent's refusal carries its cause (errno name, ``permanent``)."""

from __future__ import annotations

import errno
import itertools

import msgspec
import pytest

from metalguard.agent.workload.reports import refusal
from metalguard.controller.jobs import machine as m
from metalguard.proto.events import CommandReply
from metalguard.proto.jobs import Job, JobStatus
from tests.support.clock import T0

NODES = ("r.c.n1", "r.c.n2")
HEALTHY = {n: "HEALTHY" for n in NODES}
TIMINGS = m.Timings(
    stop_deadline_s=10, start_deadline_s=30, restart_backoff_s=1.0, restart_backoff_max_s=8.0
)
ENOENT = "cannot run 'examples/trainer.py': [Errno 2] No such file or directory"


def job(**kw: object) -> Job:
    base: dict[str, object] = {"job_id": "j1", "name": "t", "nodes": 2, "command": "x"}
    return msgspec.convert(base | kw, Job)


def starting(j: Job) -> JobStatus:
    """A job just placed on NODES at T0: its starts not yet answered."""
    s = m.submitted(j, T0).status
    return m.placed(s, NODES, T0, "rack").status


def reply(cid: str, ok: bool = True, message: str = "", **result: object) -> CommandReply:
    return CommandReply(command_id=cid, ts=T0, ok=ok, message=message, result=result)  # type: ignore[arg-type]


class Fleet:
    """Answers every command the machine sends: starts as ``answer`` says, stops ok."""

    def __init__(self, refuse: dict[str, object] | None, message: str = ENOENT) -> None:
        self.refuse = refuse
        self.message = message
        self.replies: dict[str, CommandReply] = {}
        self.starts_sent = 0

    def answer(self, step: m.Step) -> None:
        for send in step.sends:
            if send.command_id in self.replies:
                continue
            if send.verb == "start":
                self.starts_sent += 1
                if self.refuse is not None:
                    self.replies[send.command_id] = reply(
                        send.command_id, False, self.message, **self.refuse
                    )
                    continue
            self.replies[send.command_id] = reply(send.command_id)


def run(
    status: JobStatus, fleet: Fleet, until: float, dt: float = 0.25
) -> tuple[JobStatus, list[m.Emit]]:
    """Advance every ``dt`` seconds of injected time until ``until`` (or the job ends)."""
    emits: list[m.Emit] = []
    now = T0
    while now <= until and status.state not in ("failed", "succeeded", "cancelled"):
        step = m.advance(status, m.World(now, HEALTHY, fleet.replies, timings=TIMINGS))
        emits += step.emits
        fleet.answer(step)
        status = step.status
        now += dt
    return status, emits


@pytest.mark.parametrize(
    ("restart", "wait"),
    [(0, 0.0), (1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (5, 8.0), (10_000, 8.0)],
)
def test_backoff_doubles_up_to_its_cap(restart: int, wait: float) -> None:
    assert m.backoff_s(restart, TIMINGS) == wait


@pytest.mark.parametrize(
    ("refuse", "max_restarts", "state", "starts", "crashed"),
    [
        # permanent: failed at once, never tried again
        ({"cause": "ENOENT", "errno": 2, "permanent": True}, 3, "failed", 2, 0),
        ({"cause": "ENOEXEC", "permanent": True}, 0, "failed", 2, 0),
        ({"cause": "bad_args", "permanent": True}, 5, "failed", 2, 0),
        # transient (or an older agent that says nothing): restarts, then the budget
        ({"cause": "EAGAIN", "permanent": False}, 2, "failed", 6, 3),
        ({}, 0, "failed", 2, 1),
        ({}, 3, "failed", 8, 4),
        # never refused: it runs
        (None, 3, "running", 2, 0),
    ],
)
def test_refused_starts_table(
    refuse: dict[str, object] | None, max_restarts: int, state: str, starts: int, crashed: int
) -> None:
    fleet = Fleet(refuse)
    status, emits = run(starting(job(max_restarts=max_restarts)), fleet, until=T0 + 120)
    kinds = [e.kind for e in emits]
    assert status.state == state
    assert fleet.starts_sent == starts
    assert kinds.count("job.crashed") == crashed
    assert kinds.count("job.failed") == (1 if state == "failed" else 0)
    if state == "failed":
        assert ENOENT in status.reason
        assert kinds[-1] == "job.failed"
        failed = emits[-1]
        assert ENOENT in str(failed.attributes["reason"])
        if refuse and refuse.get("permanent"):
            assert "permanent" in status.reason
        else:
            assert f"restart budget of {max_restarts} spent" in status.reason
            assert status.crashes == max_restarts + 1
            assert status.restarts == max_restarts


def test_a_transient_refusal_waits_the_backoff_before_each_try() -> None:
    fleet = Fleet({"cause": "EAGAIN", "permanent": False})
    status = starting(job(max_restarts=3))
    tries: list[float] = []
    now = T0
    while status.state != "failed" and now < T0 + 60:
        step = m.advance(status, m.World(now, HEALTHY, fleet.replies, timings=TIMINGS))
        if any(s.verb == "start" and s.command_id not in fleet.replies for s in step.sends):
            tries.append(now - T0)
        fleet.answer(step)
        status = step.status
        now += 0.125
    gaps = [b - a for a, b in itertools.pairwise(tries)]
    # the first try, then one after 1, 2 and 4 s (the stop in between is answered at once)
    assert len(tries) == 4
    for gap, wait in zip(gaps, (1.0, 2.0, 4.0), strict=True):
        assert wait <= gap < wait + 0.5
    assert status.state == "failed"


def test_a_refusal_reports_its_cause_and_nodes_and_the_status_its_wait() -> None:
    fleet = Fleet({"cause": "EAGAIN"}, message="busy")
    status = starting(job())
    step = m.advance(status, m.World(T0, HEALTHY, {}, timings=TIMINGS))
    fleet.answer(step)
    step = m.advance(step.status, m.World(T0 + 0.1, HEALTHY, fleet.replies, timings=TIMINGS))
    crashed = [e for e in step.emits if e.kind == "job.crashed"]
    assert len(crashed) == 1
    assert crashed[0].attributes == {
        "start_refused": True,
        "nodes": "r.c.n1,r.c.n2",
        "cause": "EAGAIN",
        "generation": 1,
    }
    assert step.status.crashes == 1
    assert step.status.move is not None
    assert step.status.move.not_before_ts == T0 + 0.1 + 1.0
    assert "start refused on r.c.n1, r.c.n2: busy" in step.status.history[-1].reason


def test_one_permanent_refusal_stops_the_members_that_started() -> None:
    status = starting(job())
    first = m.advance(status, m.World(T0, HEALTHY, {}, timings=TIMINGS))
    r0, r1 = (s.command_id for s in first.sends)
    replies = {r0: reply(r0), r1: reply(r1, False, ENOENT, cause="ENOENT", permanent=True)}
    step = m.advance(first.status, m.World(T0 + 1, HEALTHY, replies, timings=TIMINGS))
    assert [(s.verb, s.node) for s in step.sends] == [("stop", "r.c.n1"), ("stop", "r.c.n2")]
    assert step.status.state == "rescheduling"
    replies |= {s.command_id: reply(s.command_id) for s in step.sends}
    end = m.advance(step.status, m.World(T0 + 2, HEALTHY, replies, timings=TIMINGS))
    assert end.status.state == "failed"
    assert [e.kind for e in end.emits] == ["job.stopped", "job.failed"]
    again = m.advance(end.status, m.World(T0 + 3, HEALTHY, replies, timings=TIMINGS))
    assert again.emits == ()
    assert again.sends == ()


def test_a_cancel_during_the_backoff_ends_the_job_at_once() -> None:
    fleet = Fleet({"cause": "EAGAIN"})
    status, _ = run(starting(job()), fleet, until=T0 + 0.5)
    assert status.move is not None
    assert status.move.not_before_ts > T0 + 0.5
    status = m.request_cancel(status, T0 + 0.5)
    step = m.advance(status, m.World(T0 + 0.6, HEALTHY, fleet.replies, timings=TIMINGS))
    assert step.status.state == "cancelled"
    assert [e.kind for e in step.emits] == ["job.cancelled"]
    assert step.sends == ()


@pytest.mark.parametrize(
    ("code", "cause", "permanent"),
    [
        (errno.ENOENT, "ENOENT", True),
        (errno.EACCES, "EACCES", True),
        (errno.ENOEXEC, "ENOEXEC", True),
        (errno.ENOTDIR, "ENOTDIR", True),
        (errno.EAGAIN, "EAGAIN", False),
        (errno.ENOMEM, "ENOMEM", False),
        (None, "OSError", False),
    ],
)
def test_the_agents_refusal_cause(code: int | None, cause: str, permanent: bool) -> None:
    exc = OSError(code, "x") if code is not None else OSError("no errno")
    result = refusal(exc)
    assert result == {"cause": cause, "errno": code, "permanent": permanent}
