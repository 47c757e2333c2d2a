"""A node's jobs counted by two sources (docs/lifecycle.md "The job count"): the native
job manager (``NodeRecord.running_jobs``) and the Slurm bridge (``slurm_jobs``, from its
``slurm_jobs`` NodeEvents, docs/slurm.md). Neither overwrites the other; a SUB_HEALTHY
node enters MAINTENANCE once their sum is known to be 0. Also the bridge's pure count per
Slurm node, its poll (fake Slurm tools, fake JetStream) and the region controller's
refusal of a count it cannot read."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext

from metalguard.controller.core.decide import decide_running, slurm_job_count
from metalguard.controller.core.lifecycle import (
    LifecycleConfig,
    Observation,
    observe,
    unfinished_jobs,
    update_jobs,
)
from metalguard.controller.region import RegionController
from metalguard.controller.slurm.actions import job_count_changes, jobs_per_node
from metalguard.controller.slurm.bridge import JOBS_RESYNC_S, SlurmBridge
from metalguard.controller.slurm.config import BridgeConfig
from metalguard.controller.slurm.parse import SlurmJob, SlurmNode
from metalguard.controller.slurm.runner import SlurmCommandError
from metalguard.controller.slurm.tools import SlurmTools
from metalguard.controller.state.store import NodeStore
from metalguard.proto.base import AttrValue, NodeIdentity, Reason
from metalguard.proto.codec import decode
from metalguard.proto.events import SLURM_JOBS_KIND, ControllerEvent, NodeEvent
from metalguard.proto.nodes import NodeRecord
from metalguard.proto.subjects import Subjects
from tests.support.clock import T0, ManualClock

CFG = LifecycleConfig(sub_healthy_drain_after_s=3600.0)
NODE = NodeIdentity(region="r1", cluster="c1", node="n1")
LINK = Reason(signal="pcie.link_downgrade", value="x8", rule="link_downgrade", message="x8")


def sub_healthy_batch(ts: float, seq: int) -> Observation:
    return Observation(
        ts=ts, seq=seq, score=70.0, grade="SUB_HEALTHY", reasons=(LINK,), interval_s=10.0
    )


def sub_healthy(*, running_jobs: int | None, slurm_jobs: int | None) -> NodeRecord:
    """A node that entered SUB_HEALTHY at t=10 with these counts."""
    record = NodeRecord(
        node=NODE, interval_s=10.0, running_jobs=running_jobs, slurm_jobs=slurm_jobs
    )
    record = observe(record, sub_healthy_batch(10.0, 1), CFG).record
    assert record.grade == "SUB_HEALTHY"
    return record


# --- the lifecycle over both sources -------------------------------------------------


@pytest.mark.parametrize(
    ("native", "slurm", "unfinished"),
    [
        (None, None, None),
        (0, None, 0),
        (None, 0, 0),
        (2, None, 2),
        (None, 3, 3),
        (0, 2, 2),
        (1, 2, 3),
    ],
)
def test_unfinished_jobs_sums_the_known_counts(
    native: int | None, slurm: int | None, unfinished: int | None
) -> None:
    record = NodeRecord(node=NODE, running_jobs=native, slurm_jobs=slurm)
    assert unfinished_jobs(record) == unfinished


def test_each_source_updates_its_own_count() -> None:
    record = NodeRecord(node=NODE, running_jobs=1)
    slurm = update_jobs(record, 4, 5.0, CFG, "slurm").record
    assert (slurm.running_jobs, slurm.slurm_jobs, slurm.updated_ts) == (1, 4, 5.0)
    native = update_jobs(slurm, 0, 6.0, CFG, "jobs").record
    assert (native.running_jobs, native.slurm_jobs) == (0, 4)
    assert update_jobs(native, 4, 7.0, CFG, "slurm").record is native  # unchanged: no write


def test_native_zero_and_slurm_jobs_keep_it_sub_healthy_until_slurm_says_zero() -> None:
    record = sub_healthy(running_jobs=None, slurm_jobs=2)
    # Slurm runs two jobs there; the job manager knows of none
    t = update_jobs(record, 0, 11.0, CFG, "jobs")
    assert (t.record.grade, t.decisions) == ("SUB_HEALTHY", ())
    assert (t.record.running_jobs, t.record.slurm_jobs) == (0, 2)
    record = t.record
    for k in range(2, 30):  # sub-healthy batches meanwhile drain nothing
        t = observe(record, sub_healthy_batch(10.0 * k, k), CFG)
        assert (t.record.grade, t.decisions) == ("SUB_HEALTHY", ())
        record = t.record
    # the native count changing again does not drain it while Slurm's jobs run
    t = update_jobs(record, 1, 300.0, CFG, "jobs")
    t = update_jobs(t.record, 0, 301.0, CFG, "jobs")
    assert (t.record.grade, t.decisions) == ("SUB_HEALTHY", ())
    record = update_jobs(t.record, 1, 302.0, CFG, "slurm").record
    assert record.grade == "SUB_HEALTHY"

    t = update_jobs(record, 0, 303.0, CFG, "slurm")
    assert t.record.grade == "MAINTENANCE"
    assert (t.record.running_jobs, t.record.slurm_jobs) == (0, 0)
    (decision,) = t.decisions
    assert decision.kind == "node.maintenance"
    assert decision.message == "sub-healthy and its last job ended"
    assert decision.action is None  # nothing left to move: a drain
    last = decision.reasons[-1]
    assert (last.signal, last.rule, last.message) == (
        "lifecycle.running_jobs",
        "sub_healthy_drain",
        "its last job ended",
    )


def test_slurm_zero_alone_drains_it_when_the_job_manager_never_counted() -> None:
    record = sub_healthy(running_jobs=None, slurm_jobs=1)
    t = update_jobs(record, 0, 20.0, CFG, "slurm")
    assert t.record.grade == "MAINTENANCE"
    assert t.record.running_jobs is None


def test_native_jobs_keep_it_sub_healthy_when_slurm_says_zero() -> None:
    record = sub_healthy(running_jobs=1, slurm_jobs=1)
    t = update_jobs(record, 0, 20.0, CFG, "slurm")
    assert (t.record.grade, t.decisions) == ("SUB_HEALTHY", ())


def test_both_counts_unknown_keep_it_sub_healthy() -> None:
    record = sub_healthy(running_jobs=None, slurm_jobs=None)
    for k in range(2, 30):
        t = observe(record, sub_healthy_batch(10.0 * k, k), CFG)
        assert (t.record.grade, t.decisions) == ("SUB_HEALTHY", ())
        record = t.record
    assert unfinished_jobs(record) is None


def test_a_known_zero_over_both_sources_drains_it_at_the_next_batch() -> None:
    record = sub_healthy(running_jobs=0, slurm_jobs=0)
    t = observe(record, sub_healthy_batch(20.0, 2), CFG)
    assert t.record.grade == "MAINTENANCE"
    still = sub_healthy(running_jobs=0, slurm_jobs=1)
    assert observe(still, sub_healthy_batch(20.0, 2), CFG).record.grade == "SUB_HEALTHY"


def test_decide_running_from_slurm_tags_its_events_and_skips_unknown_nodes() -> None:
    records = {NODE.handle: sub_healthy(running_jobs=0, slurm_jobs=1)}
    out = decide_running(
        records, {NODE.handle: 0, "r1.c1.unknown": 0}, 40.0, CFG, source="slurm", tag="eX"
    )
    assert set(out.records) == {NODE.handle}
    assert out.records[NODE.handle].grade == "MAINTENANCE"
    (event,) = out.events
    assert event.event_id == f"{NODE.handle}:node.maintenance:eX"
    assert event.message == "sub-healthy and its last job ended"
    default = decide_running(records, {NODE.handle: 0}, 40.0, CFG, source="slurm")
    assert default.events[0].event_id == f"{NODE.handle}:node.maintenance:sj40000"
    native = decide_running(records, {NODE.handle: 5}, 40.0, CFG)
    assert native.records[NODE.handle].running_jobs == 5
    assert native.records[NODE.handle].slurm_jobs == 1


# --- the slurm_jobs NodeEvent, read by the controller ----------------------------------


def jobs_event(running: AttrValue, kind: str = SLURM_JOBS_KIND, **more: AttrValue) -> NodeEvent:
    attributes: dict[str, AttrValue] = {"slurm_node": "n1", "jobs": "", **more}
    if running is not None:
        attributes["running"] = running
    return NodeEvent(
        node=NODE,
        event_id="slurm_jobs-1",
        ts=1.0,
        kind=kind,
        source="slurm",
        severity="info",
        attributes=attributes,
    )


@pytest.mark.parametrize(("running", "count"), [(0, 0), (1, 1), (250, 250)])
def test_a_slurm_jobs_event_carries_its_count(running: int, count: int) -> None:
    assert slurm_job_count(jobs_event(running)) == count


@pytest.mark.parametrize("running", [-1, 1.5, 2.0, "3", True, None])
def test_a_count_that_is_not_an_integer_at_least_zero_is_refused(running: AttrValue) -> None:
    assert slurm_job_count(jobs_event(running)) is None


def test_another_kind_carries_no_slurm_count() -> None:
    assert slurm_job_count(jobs_event(1, kind="slurm_up")) is None


@dataclass
class RecordsOnly:
    """A store of which the controller may read ``records`` only (a round would need
    more: any other use fails the test)."""

    records: dict[str, NodeRecord] = field(default_factory=dict)


def controller(records: dict[str, NodeRecord]) -> RegionController:
    store = cast(NodeStore, RecordsOnly(records))
    return RegionController(cast(JetStreamContext, object()), store, Subjects(), "r1")


@pytest.mark.parametrize("running", [-3, "two", 1.5, None])
async def test_the_controller_logs_and_drops_a_count_it_cannot_read(
    running: AttrValue, caplog: pytest.LogCaptureFixture
) -> None:
    region = controller({NODE.handle: sub_healthy(running_jobs=None, slurm_jobs=1)})
    with caplog.at_level(logging.WARNING, logger="metalguard.controller.region"):
        await region.on_node_event(jobs_event(running), 5.0)
        assert await region.report_slurm_jobs(jobs_event(running), 5.0) == ()
    (line, *_) = [r.getMessage() for r in caplog.records]
    assert f"ignoring slurm_jobs event slurm_jobs-1 of {NODE.handle}" in line
    assert f"is {running!r}, not a count of jobs" in line
    assert region.store.records[NODE.handle].slurm_jobs == 1


async def test_the_controller_skips_an_unknown_node_and_an_unchanged_count() -> None:
    region = controller({NODE.handle: sub_healthy(running_jobs=None, slurm_jobs=1)})
    other = NodeEvent(
        node=NodeIdentity(region="r1", cluster="c1", node="n9"),
        event_id="slurm_jobs-2",
        ts=1.0,
        kind=SLURM_JOBS_KIND,
        attributes={"running": 0},
    )
    assert await region.report_slurm_jobs(other, 5.0) == ()
    assert await region.report_slurm_jobs(jobs_event(1), 5.0) == ()


# --- the bridge's count per Slurm node ------------------------------------------------


def job(job_id: str, state: str, *nodes: str) -> SlurmJob:
    return SlurmJob(job_id=job_id, state=state, nodes=nodes)


SLURM_NODES = (SlurmNode("g1", "MIXED"), SlurmNode("g2", "IDLE"), SlurmNode("g3", "ALLOCATED"))


def test_jobs_per_node_counts_the_active_jobs_on_every_listed_node() -> None:
    jobs = [
        job("10", "RUNNING", "g1", "g3"),  # a 2-node job counts on both
        job("9", "RUNNING", "g1"),
        job("11", "COMPLETING", "g3"),  # still holds the node (epilog)
        job("12", "SUSPENDED", "g3"),
        job("13", "PENDING"),
        job("14", "COMPLETED", "g2"),  # kept for MinJobAge, gone from the node
        job("15", "CANCELLED", "g2"),
        job("16", "RUNNING", "elsewhere"),  # a node sinfo does not list
        job("7_3", "RUNNING", "g1"),  # an array task
    ]
    assert jobs_per_node(SLURM_NODES, jobs) == {
        "g1": ("7_3", "9", "10"),
        "g2": (),
        "g3": ("10", "11", "12"),
    }


def test_jobs_per_node_with_no_jobs_says_zero_for_each_node() -> None:
    assert jobs_per_node(SLURM_NODES, ()) == {"g1": (), "g2": (), "g3": ()}


def test_job_count_changes_all_at_first_then_only_counts_that_changed() -> None:
    current = {"g1": ("1",), "g2": (), "g3": ("2", "3")}
    assert job_count_changes(None, current) == current
    assert job_count_changes({"g1": 1, "g2": 0, "g3": 2}, current) == {}
    # the same count with another job is no change; a node not announced before is
    assert job_count_changes({"g1": 1, "g3": 1}, {"g1": ("9",), "g2": (), "g3": ("2", "3")}) == {
        "g2": (),
        "g3": ("2", "3"),
    }


# --- the bridge's poll ----------------------------------------------------------------


@dataclass
class FakeTools:
    """Slurm's view as the test sets it; ``squeue_fails``: jobs() raises."""

    nodes_: tuple[SlurmNode, ...] = SLURM_NODES
    jobs_: tuple[SlurmJob, ...] = ()
    squeue_fails: bool = False

    async def nodes(self) -> tuple[SlurmNode, ...]:
        return self.nodes_

    async def jobs(self) -> tuple[SlurmJob, ...]:
        if self.squeue_fails:
            raise SlurmCommandError(("squeue", "--json"), 4, "slurmctld not responding")
        return self.jobs_


@dataclass
class FakeJs:
    """Records what is published; ``failing``: subjects whose publish times out."""

    published: list[tuple[str, bytes]] = field(default_factory=list)
    failing: set[str] = field(default_factory=set)

    async def publish(self, subject: str, data: bytes, **_: Any) -> None:
        if subject in self.failing:
            raise NatsTimeoutError
        self.published.append((subject, data))

    def take(self) -> tuple[dict[str, NodeEvent], list[str]]:
        """The slurm_jobs events by node, and the kinds of the control events; cleared."""
        counts: dict[str, NodeEvent] = {}
        failures: list[str] = []
        for subject, data in self.published:
            if ".evt." in subject:
                event = decode(data, NodeEvent)
                assert event.kind == SLURM_JOBS_KIND, event
                counts[event.node.node] = event
            else:
                failures.append(decode(data, ControllerEvent).kind)
        self.published.clear()
        return counts, failures


def new_bridge(tools: FakeTools, js: FakeJs, clock: ManualClock | None = None) -> SlurmBridge:
    cfg = BridgeConfig(region="r1", cluster="c1")
    return SlurmBridge(
        cast(JetStreamContext, js),
        Subjects(),
        cfg,
        cast(SlurmTools, tools),
        clock=clock or ManualClock(),
    )


def running(counts: dict[str, NodeEvent]) -> dict[str, AttrValue]:
    return {name: event.attributes["running"] for name, event in counts.items()}


async def test_the_first_poll_announces_every_node_then_only_changes() -> None:
    tools, js = FakeTools(jobs_=(job("5", "RUNNING", "g1"), job("6", "RUNNING", "g1"))), FakeJs()
    bridge = new_bridge(tools, js)
    await bridge.poll_once()
    counts, others = js.take()
    assert others == []
    assert running(counts) == {"g1": 2, "g2": 0, "g3": 0}
    g1 = counts["g1"]
    assert (g1.source, g1.device, g1.severity) == ("slurm", "g1", "info")
    assert g1.attributes == {"slurm_node": "g1", "running": 2, "jobs": "5,6"}
    assert g1.message == "Slurm runs 2 jobs on g1 (5, 6)"
    assert js.published == []

    await bridge.poll_once()  # nothing changed: nothing announced
    assert js.take() == ({}, [])

    tools.jobs_ = (job("6", "RUNNING", "g1"), job("7", "RUNNING", "g2"))
    await bridge.poll_once()
    counts, _ = js.take()
    assert running(counts) == {"g1": 1, "g2": 1}


async def test_a_failed_squeue_announces_no_count() -> None:
    tools, js = FakeTools(jobs_=(job("5", "RUNNING", "g1"),)), FakeJs()
    bridge = new_bridge(tools, js)
    await bridge.poll_once()
    js.take()

    tools.squeue_fails = True
    tools.jobs_ = ()
    await bridge.poll_once()
    counts, others = js.take()
    assert counts == {}  # not "0 jobs on g1": Slurm could not be read
    assert others == ["slurm.command_failed"]

    tools.squeue_fails = False  # the job ended meanwhile: announced once read
    await bridge.poll_once()
    counts, _ = js.take()
    assert running(counts) == {"g1": 0}


async def test_a_first_poll_whose_squeue_fails_announces_nothing() -> None:
    tools, js = FakeTools(squeue_fails=True), FakeJs()
    bridge = new_bridge(tools, js)
    await bridge.poll_once()
    assert js.take() == ({}, ["slurm.command_failed"])
    tools.squeue_fails = False
    await bridge.poll_once()
    counts, _ = js.take()
    assert running(counts) == {"g1": 0, "g2": 0, "g3": 0}


async def test_a_count_not_published_is_announced_again() -> None:
    subjects = Subjects()
    tools, js = FakeTools(), FakeJs()
    js.failing = {subjects.node_event("r1", "c1", "g2", SLURM_JOBS_KIND)}
    bridge = new_bridge(tools, js)
    await bridge.poll_once()
    assert set(js.take()[0]) == {"g1", "g3"}

    tools.jobs_ = (job("5", "RUNNING", "g1"),)
    await bridge.poll_once()  # g2's count still cannot be published; g1's changed
    assert running(js.take()[0]) == {"g1": 1}

    js.failing = set()
    await bridge.poll_once()
    assert running(js.take()[0]) == {"g2": 0}


async def test_every_count_is_announced_again_at_the_resync() -> None:
    clock = ManualClock()
    tools, js = FakeTools(jobs_=(job("5", "RUNNING", "g1"),)), FakeJs()
    bridge = new_bridge(tools, js, clock)
    await bridge.poll_once()
    assert len(js.take()[0]) == 3
    clock.now = T0 + JOBS_RESYNC_S - 1
    await bridge.poll_once()
    assert js.take() == ({}, [])
    clock.now = T0 + JOBS_RESYNC_S  # nothing changed, every count again
    await bridge.poll_once()
    assert running(js.take()[0]) == {"g1": 1, "g2": 0, "g3": 0}
    clock.now = T0 + JOBS_RESYNC_S + 10
    await bridge.poll_once()
    assert js.take() == ({}, [])
