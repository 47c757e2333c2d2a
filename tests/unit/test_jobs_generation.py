"""The job manager's reading of the nodes' ``job_*`` events (``observe``, pure): an event
of an older run than the job's current generation changes nothing (a late progress of a
replaced run would overstate ``steps_redone`` at the next move); an event without a
generation (an older agent) counts for the current run."""

from __future__ import annotations

import msgspec
import pytest

from metalguard.controller.jobs import machine as m
from metalguard.controller.jobs.manager import event_generation, observe
from metalguard.proto.base import AttrValue, NodeIdentity
from metalguard.proto.events import NodeEvent
from metalguard.proto.jobs import Job, JobStatus
from tests.support.clock import T0

NODES = ("r.c.n1", "r.c.n2")
HEALTHY = dict.fromkeys(NODES, "HEALTHY")
TIMINGS = m.Timings(checkpoint_deadline_s=10, stop_deadline_s=10)


def second_run() -> JobStatus:
    """A job in its second generation on NODES, members at step 40."""
    job = msgspec.convert({"job_id": "j1", "name": "t", "nodes": 2, "command": "python"}, Job)
    s = m.placed(m.submitted(job, T0).status, NODES, T0, "rack").status
    first = m.advance(s, m.World(T0, HEALTHY, {}, timings=TIMINGS))
    assert first.status.generation == 1
    members = tuple(msgspec.structs.replace(x, step=40) for x in first.status.members)
    return msgspec.structs.replace(first.status, generation=2, members=members, steps_redone=7)


def event(kind: str, generation: int | None, **attrs: AttrValue) -> NodeEvent:
    if generation is not None:
        attrs["generation"] = generation
    return NodeEvent(
        node=NodeIdentity(region="r", cluster="c", node="n1"),
        event_id="e1",
        ts=T0,
        kind=kind,
        source="workload",
        device="j1",
        attributes={"job_id": "j1", "rank": 0, **attrs},
    )


@pytest.mark.parametrize(
    "late",
    [
        event("job_progress", 1, step=900),
        event("job_checkpointed", 1, step=900, path="/ckpt/900"),
        event("job_exited", 1, exit_code=1, step=900),
        event("job_progress", 0, step=900),
    ],
    ids=["progress", "checkpoint", "exit", "generation-0"],
)
def test_a_late_event_of_an_older_run_changes_nothing(late: NodeEvent) -> None:
    status = second_run()
    after = observe(status, "r.c.n1", late, T0 + 5)
    assert after == status
    assert after.steps_redone == 7
    assert max(x.step for x in after.members) == 40
    assert after.last_checkpoint is None


def test_an_event_of_the_current_run_counts() -> None:
    status = second_run()
    progressed = observe(status, "r.c.n1", event("job_progress", 2, step=55), T0 + 5)
    assert progressed.members[0].step == 55
    exited = observe(status, "r.c.n1", event("job_exited", 2, exit_code=3), T0 + 5)
    assert exited.members[0].exit_code == 3


def test_an_event_without_a_generation_counts_for_the_current_run() -> None:
    status = second_run()
    progressed = observe(status, "r.c.n1", event("job_progress", None, step=55), T0 + 5)
    assert progressed.members[0].step == 55
    assert event_generation(event("job_progress", None), 2) == 2
    flag = msgspec.structs.replace(event("job_progress", None), attributes={"generation": True})
    assert event_generation(flag, 2) == 2
    assert event_generation(event("job_progress", 1), 2) == 1
