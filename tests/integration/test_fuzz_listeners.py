"""The listeners tests/integration/test_fuzz_subjects.py does not cover, fed the same bad
messages (tests/support/harness/garbage.py) between valid ones on the session nats-server
(issue 16, item 5): the bmc-proxy's BMC verbs on ``<p>.cmd.<r>.<c>.<n>.bmc_*`` (against
the Redfish emulator), the job manager's ``<p>.evt.<r>.*.*.*`` job events, and the two
readers of the control stream ``<p>.ctl.<r>.>`` (the events API's source and the Slurm
bridge).  Every bad message is answered with an error or counted, never executed; every
valid one is taken once; the listener keeps serving.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from nats.aio.client import Client

from metalguard.agent.bmc.commands import BmcCommandService
from metalguard.controller.api.sse import NatsEventSource
from metalguard.controller.jobs.manager import JobManager, JobSettings
from metalguard.controller.jobs.store import JobStore
from metalguard.controller.slurm.bridge import SlurmBridge
from metalguard.controller.slurm.config import BridgeConfig, JobsSection, SlurmSection
from metalguard.controller.slurm.runner import SlurmRunner
from metalguard.controller.slurm.tools import SlurmTools
from metalguard.proto.base import NodeIdentity
from metalguard.proto.codec import decode, encode
from metalguard.proto.events import (
    Command,
    CommandReply,
    CommandStatus,
    ControllerEvent,
    NodeEvent,
)
from metalguard.proto.jobs import Job, JobStatus, MemberState
from metalguard.proto.nodes import NodeRecord
from metalguard.proto.subjects import Subjects
from metalguard.proto.telemetry import TelemetryBatch
from tests.support.harness.bmc_client import command_service
from tests.support.harness.garbage import bad_messages, oversized
from tests.support.harness.redfish_emulator import RunningEmulator
from tests.support.harness.slurm_cluster import NODE as SLURM_NODE
from tests.support.harness.slurm_cluster import SlurmCluster
from tests.support.waiting import wait_for_value, wait_until

DEADLINE_S = 30.0
REPLY_S = 10.0
T0 = 1_767_225_600.0
BMC_NODE = NodeIdentity(region="eu1", cluster="trainA", node="gpu017")
"""The node of the emulator's target (tests/support/harness/bmc_client.py)."""


def batch(node: NodeIdentity) -> TelemetryBatch:
    return TelemetryBatch(node=node, seq=1, ts=T0, interval_s=5.0)


# --- the bmc-proxy's verbs ------------------------------------------------------------


@pytest.fixture
async def bmc_service(
    bmc: RunningEmulator, tmp_path: Path, nats_url: str, subjects: Subjects
) -> AsyncIterator[BmcCommandService]:
    async with command_service(bmc, tmp_path, nats_url, subjects) as svc:
        yield svc


def bmc_command(
    command_id: str,
    verb: str = "bmc_pxe_once",
    *,
    node: NodeIdentity = BMC_NODE,
    expires_ts: float | None = None,
) -> Command:
    return Command(
        command_id=command_id, ts=time.time(), node=node, verb=verb, expires_ts=expires_ts
    )


async def test_bmc_verbs_reject_every_bad_message_and_execute_each_valid_once(
    nc: Client, subjects: Subjects, bmc: RunningEmulator, bmc_service: BmcCommandService
) -> None:
    """All on ``bmc_pxe_once``: a bad message that were executed would PATCH the boot
    override, so the emulator's PATCH count is the number of valid commands."""
    other = NodeIdentity(region="eu1", cluster="trainA", node="gpu018")
    wrong = [
        bmc_command("w-node", node=other),
        bmc_command("w-region", node=NodeIdentity(region="us1", cluster="trainA", node="gpu017")),
        bmc_command("w-verb", verb="bmc_force_power_cycle"),  # on the pxe subject
        bmc_command("w-expired", expires_ts=time.time() - 1.0),
        bmc_command(""),  # no id: it could not run once
        bmc_command("  "),
    ]
    bad = [
        *bad_messages(bmc_command("p-0"), batch(BMC_NODE), 40),
        oversized(nc.max_payload, headroom=4096),
        *(encode(c) for c in wrong),
    ]
    subject = subjects.command(BMC_NODE.region, BMC_NODE.cluster, BMC_NODE.node, "bmc_pxe_once")
    for i, data in enumerate(bad):
        msg = await nc.request(subject, data, timeout=REPLY_S)
        reply = decode(msg.data, CommandReply)
        assert (reply.ok, reply.status) == (False, CommandStatus.REJECTED), (data[:80], reply)
        assert reply.message, reply
        good = await nc.request(subject, encode(bmc_command(f"p-{i}")), timeout=REPLY_S)
        answer = decode(good.data, CommandReply)
        assert (answer.ok, answer.command_id, answer.duplicate) == (True, f"p-{i}", False), answer
    assert (bmc_service.rejected, bmc_service.executed, bmc_service.failed) == (
        len(bad),
        len(bad),
        0,
    )
    assert len(bmc.emulator.patches) == len(bad)  # each valid command once, no bad one
    assert bmc.emulator.resets == []


async def test_a_bmc_command_whose_outcome_cannot_be_stored_is_still_answered(
    nc: Client,
    subjects: Subjects,
    bmc: RunningEmulator,
    bmc_service: BmcCommandService,
    tmp_path: Path,
) -> None:
    (tmp_path / "outcomes.jsonl").mkdir()  # the outcome file cannot be appended to now
    subject = subjects.command(BMC_NODE.region, BMC_NODE.cluster, BMC_NODE.node, "bmc_pxe_once")
    msg = await nc.request(subject, encode(bmc_command("s-1")), timeout=REPLY_S)
    reply = decode(msg.data, CommandReply)
    assert (reply.ok, reply.status, reply.command_id) == (False, CommandStatus.FAILED, "s-1")
    assert "internal error" in reply.message, reply
    assert bmc_service.failed == 1
    # The action did run (once); asked again, the id is answered from memory, not redone.
    again = decode((await nc.request(subject, encode(bmc_command("s-1")))).data, CommandReply)
    assert (again.ok, again.duplicate) == (True, True), again
    assert len(bmc.emulator.patches) == 1


# --- the job manager's job events -------------------------------------------------------


@dataclass
class Records:
    """The node records the manager grades members by: every node HEALTHY."""

    records: Mapping[str, NodeRecord] = field(default_factory=dict)


def ident(node: str) -> NodeIdentity:
    return NodeIdentity(region="r1", cluster="c1", node=node)


def running(job_id: str, nodes: tuple[NodeIdentity, ...]) -> JobStatus:
    job = Job(job_id=job_id, name="llm", nodes=len(nodes), command="python")
    members = tuple(MemberState(rank=i, node=n.handle) for i, n in enumerate(nodes))
    placement = tuple(n.handle for n in nodes)
    return JobStatus(
        job_id=job_id, state="running", job=job, generation=1, members=members, placement=placement
    )


def progress(node: NodeIdentity, job_id: str, step: int) -> NodeEvent:
    return NodeEvent(
        node=node,
        event_id=f"{node.node}-{job_id}-{step}",
        ts=T0 + step,
        kind="job_progress",
        attributes={"job_id": job_id, "step": step, "generation": 1},
    )


async def test_job_events_count_every_bad_message_and_take_every_valid_one(
    nc: Client, subjects: Subjects
) -> None:
    """One job per valid event, so each one's effect shows: its member's step."""
    n0, n1 = ident("n0"), ident("n1")
    js = nc.jetstream(timeout=5)
    store = await JobStore.open(js, subjects)
    sample = progress(n0, "j-0", 1)
    spoofed = [  # a node's report on another node's subject: never taken
        progress(n1, "j-0", 10_000),  # on n0's subject
        progress(ident("n9"), "j-0", 10_000),
    ]
    bad = [
        *bad_messages(sample, batch(n0), 40),
        oversized(nc.max_payload, headroom=200),
        *(encode(e) for e in spoofed),
    ]
    for i in range(len(bad) + 1):
        await store.create(running(f"j-{i}", (n0, n1)))
    records = Records({n.handle: NodeRecord(node=n) for n in (n0, n1)})
    manager = JobManager(
        nc, js, store, records, subjects, "r1", JobSettings(tick_s=60.0, progress_write_s=60.0),
        fleet=lambda _: [],
    )  # fmt: skip
    await manager.start()
    try:
        subject = subjects.node_event("r1", "c1", "n0", "job_progress")
        for i, data in enumerate(bad):
            await nc.publish(subject, data)
            await nc.publish(subject, encode(progress(n0, f"j-{i}", i + 1)))
        await nc.flush()
        await wait_until(lambda: manager.bad_events == len(bad), DEADLINE_S, "bad events counted")

        def steps(node: NodeIdentity) -> list[int]:
            jobs = [manager.jobs[f"j-{i}"] for i in range(len(bad))]
            return [next(m.step for m in s.members if m.node == node.handle) for s in jobs]

        await wait_until(
            lambda: steps(n0) == list(range(1, len(bad) + 1)), DEADLINE_S, "every valid event"
        )
        assert steps(n1) == [0] * len(bad)  # the spoofed reports changed nothing
        # And it keeps serving.
        last = f"j-{len(bad)}"
        await nc.publish(subject, encode(progress(n0, last, 7)))
        await wait_until(lambda: manager.jobs[last].members[0].step == 7, DEADLINE_S, "later")
        assert manager.bad_events == len(bad)
        assert all(s.state == "running" for s in manager.jobs.values())
    finally:
        await manager.stop()


# --- the control stream's readers -------------------------------------------------------


def decision(i: int, kind: str = "node.cordoned", node: str = "n1") -> ControllerEvent:
    return ControllerEvent(
        event_id=f"e-{i}",
        ts=T0 + i,
        region="r1",
        kind=kind,
        node=NodeIdentity(region="r1", cluster="c1", node=node),
        message=f"decision {i}",
        attributes={"by": "operator:alice"},
    )


async def test_the_events_source_skips_bad_messages_and_delivers_every_valid_one(
    nc: Client, subjects: Subjects
) -> None:
    source = NatsEventSource(nc, subjects, "r1")
    got: list[ControllerEvent] = []
    unsubscribe = await source.subscribe(lambda event, seq: got.append(event))
    js = nc.jetstream(timeout=5)
    bad = [*bad_messages(decision(0), batch(ident("n1")), 40), oversized(nc.max_payload, 200)]
    try:
        subject = subjects.control("r1", "node.cordoned")
        for i, data in enumerate(bad):
            await js.publish(subject, data)
            await js.publish(subject, encode(decision(i)))
        await wait_until(lambda: len(got) >= len(bad), DEADLINE_S, "every valid event")
        await js.publish(subject, encode(decision(len(bad))))  # and it keeps serving
        await wait_until(lambda: len(got) == len(bad) + 1, DEADLINE_S, "a later event")
        assert [e.event_id for e in got] == [f"e-{i}" for i in range(len(bad) + 1)]
    finally:
        await unsubscribe()


@pytest.mark.xdist_group("slurm")  # its real Slurm: one at a time on the host
async def test_the_slurm_bridge_acks_bad_messages_and_carries_out_every_valid_one(
    nc: Client, subjects: Subjects, slurm: SlurmCluster
) -> None:
    """Valid decisions alternate cordon (drain) and uncordon (resume) of a real Slurm's
    node; the bad ones are acknowledged (never redelivered) and change nothing."""
    js = nc.jetstream(timeout=5)
    cfg = BridgeConfig(
        region="r1",
        cluster="c1",
        slurm=SlurmSection(conf=str(slurm.conf), poll_s=0.2, attempts=2, backoff_s=0.1),
        jobs=JobsSection(checkpoint_wait_s=1.0),
    )
    bridge = SlurmBridge(js, subjects, cfg, SlurmTools(SlurmRunner(cfg.slurm), "auto"))
    await bridge.start(poll=False)
    bad = [*bad_messages(decision(0), batch(ident(SLURM_NODE)), 16), oversized(nc.max_payload, 200)]
    try:
        subject = subjects.control("r1", "node.cordoned")
        valid = 0
        for i, data in enumerate(bad):
            await js.publish(subject, data)
            if i % 3 == 0:
                kind = "node.cordoned" if valid % 2 == 0 else "node.uncordoned"
                await js.publish(
                    subjects.control("r1", kind), encode(decision(i, kind, SLURM_NODE))
                )
                valid += 1
        await wait_until(lambda: bridge.handled == valid, DEADLINE_S, "every valid decision")

        async def pending() -> tuple[int, int]:
            info = await js.consumer_info(subjects.stream_control, cfg.consumer)
            return info.num_ack_pending, info.num_pending

        await wait_for_value(pending, lambda v: v == (0, 0), DEADLINE_S, "all acknowledged")
        assert (bridge.handled, bridge.retried) == (valid, 0)
        # The last valid decision holds: a cordon left it drained, an uncordon resumed.
        assert slurm.nodes()[SLURM_NODE].drained == (valid % 2 == 1)
    finally:
        await bridge.stop()
