"""The straggler path without I/O: the client's step timer, the runner's check of a timing
message, the job manager's watch, the node's mark and the planned move off it."""

from __future__ import annotations

import statistics

import msgspec
import pytest

from metalguard.agent.workload.runner import timing_attributes
from metalguard.agent.workload.timing import MAX_SAMPLES, StepTimer
from metalguard.controller.core.lifecycle import LifecycleConfig, Observation, observe, straggle
from metalguard.controller.core.stragglers import Settings
from metalguard.controller.jobs import machine as m
from metalguard.controller.jobs.straggler_watch import (
    StragglerWatch,
    WatchSettings,
    window_from,
)
from metalguard.proto.base import AttrValue, NodeIdentity, Reason
from metalguard.proto.events import CommandReply
from metalguard.proto.jobs import CheckpointRef, Job, JobStatus
from metalguard.proto.nodes import NodeRecord
from tests.support.clock import T0

NODES = ("r.c.n1", "r.c.n2", "r.c.n3", "r.c.n4")
HEALTHY = dict.fromkeys(NODES, "HEALTHY") | {"r.c.n5": "HEALTHY"}
FAST = WatchSettings(detector=Settings(persistence=3, warmup_windows=1), restart_cost_s=60)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# --- the client's step timer ------------------------------------------------------------


def test_the_timer_sends_one_window_of_medians_and_leaves_marked_steps_out() -> None:
    clock = Clock()
    timer = StepTimer(window_s=10.0, clock=clock, role=(2,))
    out = []
    for step in range(1, 42):  # the window opens as step 1 ends: 10 s is 20 steps more
        if step % 10 == 0:
            timer.mark()
            timer.add(compute_s=5.0)  # an evaluation step: long, and left out
        else:
            timer.add(compute_s=0.1 + step * 0.001, comm_s=0.02)
        clock.now += 0.5
        if (w := timer.end_step(step)) is not None:
            out.append(w)
    assert len(out) == 2  # one per 10 s, whatever the step rate
    first = out[0]
    assert first.marked == 2
    assert first.steps == 19
    assert first.role == (2,)
    assert (first.first_step, first.last_step) == (1, 21)
    assert first.compute_s == pytest.approx(statistics.median(0.1 + s * 0.001 for s in
                                                              range(1, 22) if s % 10))  # fmt: skip
    assert first.comm_s == pytest.approx(0.02)
    msg = first.message()
    assert msg["op"] == "timing"
    assert timing_attributes(msg) is not None


def test_a_window_holds_a_bounded_sample_at_any_step_rate() -> None:
    clock = Clock()
    timer = StepTimer(window_s=1.0, clock=clock)
    window = None
    for step in range(1, 60_001):
        timer.add(compute_s=0.001 if step % 2 else 0.002)
        clock.now += 1.0 / 50_000
        window = timer.end_step(step) or window
        assert len(timer._compute) < MAX_SAMPLES
    assert window is not None
    assert window.steps >= 49_000
    assert window.compute_s in (0.001, 0.002, 0.0015)


def test_a_script_that_times_nothing_sends_no_window() -> None:
    clock = Clock()
    timer = StepTimer(window_s=1.0, clock=clock)
    for step in range(10):
        clock.now += 0.5
        assert timer.end_step(step) is None


@pytest.mark.parametrize(
    "bad",
    [
        {"steps": -1},
        {"steps": True},
        {"compute_s": "fast"},
        {"compute_s": float("nan")},
        {"comm_s": -0.1},
        {"role": "0,1"},
        {"role": [0, -1]},
        {"role": list(range(9))},
    ],
)
def test_the_runner_drops_a_malformed_timing_message(bad: dict[str, object]) -> None:
    good: dict[str, object] = {
        "op": "timing", "steps": 5, "marked": 0, "first_step": 1, "last_step": 5,
        "compute_s": 0.1, "comm_s": 0.01, "elapsed_s": 1.0, "role": [0],
    }  # fmt: skip
    assert timing_attributes(good) == {
        "steps": 5, "marked": 0, "first_step": 1, "last_step": 5, "compute_s": 0.1,
        "comm_s": 0.01, "elapsed_s": 1.0, "role": "0",
    }  # fmt: skip
    assert timing_attributes(good | bad) is None


# --- the watch ------------------------------------------------------------------------


def job(**kw: object) -> Job:
    base: dict[str, object] = {
        "job_id": "j1", "name": "t", "nodes": 4, "command": "python", "timing_window_s": 10.0,
    }  # fmt: skip
    return msgspec.convert(base | kw, Job)


def running(j: Job | None = None, nodes: tuple[str, ...] = NODES) -> JobStatus:
    timings = m.Timings()
    s = m.submitted(j or job(), T0).status
    s = m.placed(s, nodes, T0, "rack").status
    first = m.advance(s, m.World(T0, HEALTHY, timings=timings))
    replies = {x.command_id: _ok(x.command_id) for x in first.sends}
    done = m.advance(first.status, m.World(T0, HEALTHY, replies, timings=timings))
    assert done.status.state == "running"
    return done.status


def _ok(cid: str) -> CommandReply:
    return CommandReply(command_id=cid, ts=T0, ok=True)


def attrs(
    compute: float, comm: float = 0.01, steps: int = 20, role: str = ""
) -> dict[str, AttrValue]:
    return {"steps": steps, "compute_s": compute, "comm_s": comm, "role": role}


def feed(watch: StragglerWatch, status: JobStatus, windows: int, slow: dict[int, float],
         records: dict[str, NodeRecord] | None = None, now: float = T0,
         roles: dict[int, str] | None = None, base: float = 0.1) -> float:  # fmt: skip
    """``windows`` rounds of every member, rank r computing base x slow[r]."""
    for _ in range(windows):
        now += 10
        for mem in status.members:
            factor = slow.get(mem.rank, 1.0)
            role = (roles or {}).get(mem.rank, "")
            w = window_from(mem.rank, mem.node, attrs(base * factor, role=role))
            assert w is not None
            watch.add(status, status.generation, w, records or {}, now)
    return now


def test_a_slow_rank_is_found_after_warmup_and_persistence_once() -> None:
    watch = StragglerWatch(FAST)
    status = running()
    feed(watch, status, 3, {2: 1.2})
    assert watch.take() == ([], [])  # warm-up + 2 slow windows: not yet
    feed(watch, status, 1, {2: 1.2}, now=T0 + 30)
    found, slowed = watch.take()
    assert [f.handle for f in found] == ["r.c.n3"]
    assert not slowed
    f = found[0]
    assert f.percent == pytest.approx(20.0)
    assert f.windows == 3
    assert f.slowness.peers == 3
    assert not f.move  # no total_steps: the remaining time is not known
    assert f.remaining_s is None
    feed(watch, status, 3, {2: 1.2}, now=T0 + 40)
    assert watch.take() == ([], [])  # said once per job, generation and node


def test_a_heavier_pipeline_stage_by_design_marks_nobody() -> None:
    watch = StragglerWatch(FAST)
    status = running()
    roles = {0: "0", 1: "1", 2: "0", 3: "1"}  # stage 1 (ranks 1, 3) is 40 % heavier
    feed(watch, status, 10, {1: 1.4, 3: 1.4}, roles=roles)
    assert watch.take() == ([], [])
    # without the roles every rank is every other's peer: stage 1 would be blamed
    unroled = StragglerWatch(FAST)
    other = running(job(job_id="j2"))
    feed(unroled, other, 10, {1: 1.4, 3: 1.4})
    assert {f.handle for f in unroled.take()[0]} == {"r.c.n2", "r.c.n4"}


def test_a_whole_job_slowdown_blames_no_node() -> None:
    watch = StragglerWatch(FAST)
    status = running()
    now = feed(watch, status, 3, {})
    feed(watch, status, 4, dict.fromkeys(range(4), 1.3), now=now)
    found, slowed = watch.take()
    assert found == []
    assert [s.job_id for s in slowed] == ["j1"]
    assert slowed[0].slowdown == pytest.approx(0.3)


def test_a_new_generation_keeps_the_jobs_baseline() -> None:
    """A move restarts the warm-up and the streaks, not the job's own baseline: the same
    job slower everywhere after it is still a whole-job slowdown."""
    watch = StragglerWatch(FAST)
    status = running()
    now = feed(watch, status, 5, {})  # warm-up + the 4 windows of the baseline
    moved = msgspec.structs.replace(status, generation=2)
    feed(watch, moved, 5, dict.fromkeys(range(4), 1.3), now=now)
    found, slowed = watch.take()
    assert found == []
    assert [(s.generation, round(s.slowdown, 2)) for s in slowed] == [(2, 0.3)]


def test_moving_pays_only_when_the_remaining_slowdown_exceeds_restart_and_lost_work() -> None:
    # 1,000 steps left of 0.11 s measured (the median rank: compute 0.1 + comm 0.01),
    # 0.11 / 1.2 s at the job's own pace: ~92 s remaining; a 20 % slowdown costs ~18 s
    # there: less than the 60 s restart: finish
    watch = StragglerWatch(FAST)
    short = running(job(total_steps=1000))
    feed(watch, short, 4, {1: 1.2})
    (f,) = watch.take()[0]
    assert f.remaining_s == pytest.approx(1000 * 0.11 / 1.2, rel=0.01)
    assert not f.move
    assert f.attributes()["action"] == "finish"
    # 100,000 steps left: ~1,830 s of slowdown > 60 s + the work since the checkpoint
    long = running(job(job_id="j2", total_steps=100_000))
    long = msgspec.structs.replace(long, last_checkpoint=CheckpointRef("/c/1", 1, T0 + 30))
    feed(watch, long, 4, {1: 1.2})
    (g,) = watch.take()[0]
    assert g.move
    assert g.lost_work_s == pytest.approx(10.0)  # T0 + 40 (the 4th window) - T0 + 30
    assert g.attributes()["action"] == "move"


def test_corroboration_and_a_lemon_raise_the_confidence() -> None:
    node = NodeIdentity(region="r", cluster="c", node="n2")
    hot = Reason(signal="gpu.throttle", value=1, message="gpu0 throttled: hw_thermal_slowdown")
    records = {"r.c.n2": NodeRecord(node=node, reasons=(hot,))}
    watch = StragglerWatch(FAST)
    first = running()
    feed(watch, first, 4, {1: 1.15}, records)
    (f,) = watch.take()[0]
    assert f.corroboration == ("gpu.throttle (gpu0 throttled: hw_thermal_slowdown)",)
    assert f.attributes()["confidence"] == "high"
    assert "corroborated by gpu.throttle" in f.reason().message
    assert f.other_jobs == ()
    second = running(job(job_id="j2"))
    feed(watch, second, 4, {1: 1.15}, now=T0 + 100)
    (g,) = watch.take()[0]
    assert g.other_jobs == ("j1",)
    assert "(a lemon)" in g.message()


def test_a_new_generation_starts_the_warmup_again_and_stale_windows_are_ignored() -> None:
    watch = StragglerWatch(FAST)
    status = running()
    feed(watch, status, 3, {0: 1.5})
    moved = msgspec.structs.replace(status, generation=2)
    # a late window of generation 1 says nothing about generation 2
    w = window_from(0, "r.c.n1", attrs(0.15))
    assert w is not None
    watch.add(moved, 1, w, {}, T0 + 35)
    feed(watch, moved, 3, {0: 1.5}, now=T0 + 40)
    assert watch.take() == ([], [])  # warm-up, then 2 slow windows of generation 2
    # a window from a node that is not the rank's is ignored
    stray = window_from(0, "r.c.n5", attrs(9.0))
    assert stray is not None
    watch.add(moved, 2, stray, {}, T0 + 75)
    assert watch.take() == ([], [])


def test_a_malformed_window_is_none() -> None:
    assert window_from(0, "n", {"steps": 3, "compute_s": 0.1}) is None
    assert window_from(0, "n", attrs(-1.0)) is None
    assert window_from(0, "n", attrs(0.1, role="a,b")) is None
    assert window_from(0, "n", {"steps": "3", "compute_s": 0.1, "comm_s": 0.0}) is None
    w = window_from(3, "n", attrs(0.1, role="1,2"))
    assert w is not None
    assert w.role == (1, 2)


# --- the node's mark and the move -----------------------------------------------------


def test_a_straggler_is_sub_healthy_until_its_mark_ends_whatever_its_telemetry() -> None:
    cfg = LifecycleConfig()
    node = NodeIdentity(region="r", cluster="c", node="n2")
    record = NodeRecord(node=node)
    why = Reason(signal="jobs.straggler", value=12.0, rule="straggler", message="slow")
    t = straggle(record, why, T0 + 100, T0, cfg)
    assert t.record.grade == "SUB_HEALTHY"
    assert t.record.straggler == why
    assert [d.grade_to for d in t.decisions] == ["SUB_HEALTHY"]
    assert straggle(t.record, why, T0 + 100, T0 + 1, cfg).record == t.record
    clean = Observation(ts=T0 + 50, seq=1, score=100.0, grade="HEALTHY", reasons=())
    kept = observe(t.record, clean, cfg).record
    assert kept.grade == "SUB_HEALTHY"
    assert why in kept.reasons
    # a node already worse keeps its grade (the mark is recorded)
    failing = msgspec.structs.replace(record, grade="FAILING")
    assert straggle(failing, why, T0 + 100, T0, cfg).record.grade == "FAILING"


def test_the_machine_moves_a_running_job_off_the_nodes_asked_with_a_fresh_checkpoint() -> None:
    status = running(job(nodes=2), NODES[:2])
    off = m.MoveOff(status.generation, ("r.c.n2",), "straggler", "straggler: r.c.n2 12 %")
    step = m.advance(status, m.World(T0 + 5, HEALTHY, moves_off={"j1": off}))
    assert step.status.state == "checkpointing"
    assert step.status.move is not None
    assert step.status.move.cause == "straggler"
    assert step.status.move.exclude == ("r.c.n2",)
    assert {x.verb for x in step.sends} == {"checkpoint"}
    # a request for an older generation is not acted on
    stale = m.MoveOff(status.generation - 1, ("r.c.n2",), "straggler", "old")
    assert m.advance(status, m.World(T0 + 5, HEALTHY, moves_off={"j1": stale})).status == status
