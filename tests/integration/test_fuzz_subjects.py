"""Every subject the controller and the agent listen on, fed bad messages between valid
ones on the session nats-server (issue 16, item 5): hypothesis-drawn bytes, truncated
valid messages, a valid message of another type, wrong-typed fields, an empty one and one
as large as the server takes. Each listener keeps serving, every bad message is counted
and dead-lettered (ingest), answered with an error (commands, forwarded jobs) or reported
(QoS profiles), and no valid message is lost.

Subjects (proto/subjects.py): ``<p>.tel.>`` and ``<p>.evt.>`` (the controller's ingest
consumers), ``<p>.cmd.<r>.<c>.<n>.<verb>`` (the agent's workload verbs),
``<p>.fed.summary.*``, ``<p>.fed.lookup.<r>``, ``<p>.fed.submit.<r>`` (federation), and
the agent's watch of its keys in ``<P>_QOS``.  The other listeners (the bmc-proxy's
verbs, the job manager's job events, the control stream's readers) are fuzzed in
tests/integration/test_fuzz_listeners.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client

from metalguard.agent.qos.watch import ProfileWatcher
from metalguard.agent.workload.commands import CommandHandler
from metalguard.agent.workload.runner import Runner, RunnerSettings
from metalguard.controller.federation.service import Federation
from metalguard.controller.ingest.consumer import Ingest, IngestSettings
from metalguard.proto.base import NodeIdentity
from metalguard.proto.codec import CodecError, decode, encode
from metalguard.proto.events import (
    Command,
    CommandReply,
    CommandStatus,
    ControllerEvent,
    NodeEvent,
)
from metalguard.proto.federation import (
    JobForward,
    JobForwardReply,
    NodeLookup,
    NodeLookupReply,
    RegionPing,
    RegionSummary,
)
from metalguard.proto.jobs import Job
from metalguard.proto.qos import QosProfile
from metalguard.proto.subjects import Subjects
from metalguard.proto.telemetry import TelemetryBatch
from tests.support.harness.garbage import bad_messages, oversized
from tests.support.waiting import wait_for_value, wait_until

REGION = "r1"
DEADLINE_S = 30.0
REPLY_S = 5.0
T0 = 1_767_225_600.0


def ident(node: str) -> NodeIdentity:
    return NodeIdentity(region=REGION, cluster="c1", node=node)


def tel(n: NodeIdentity, seq: int) -> TelemetryBatch:
    return TelemetryBatch(node=n, seq=seq, ts=1_767_225_600.0 + seq, interval_s=5.0)


def evt(n: NodeIdentity, i: int) -> NodeEvent:
    return NodeEvent(node=n, event_id=f"{n.node}-{i}", ts=1_767_225_600.0 + i, kind="aer_fatal")


class Recorder:
    """The ingest handler: what reached it."""

    def __init__(self) -> None:
        self.batches: list[TelemetryBatch] = []
        self.events: list[NodeEvent] = []

    async def on_batch(self, batch: TelemetryBatch, received_ts: float) -> None:
        self.batches.append(batch)

    async def on_node_event(self, event: NodeEvent, received_ts: float) -> None:
        self.events.append(event)


async def test_ingest_dead_letters_every_bad_message_and_loses_no_valid_one(
    nc: Client, subjects: Subjects
) -> None:
    js = nc.jetstream(timeout=5)
    rec = Recorder()
    settings = IngestSettings(
        region=REGION, fetch_timeout_s=0.2, retry_delay_s=0.2, stop_timeout_s=5.0
    )
    ing = Ingest(js, subjects, settings, rec)
    await ing.start()
    nodes = [ident(f"n{i}") for i in range(3)]
    valid_tel = [tel(n, seq) for seq in range(1, 41) for n in nodes]
    valid_evt = [evt(n, i) for i in range(10) for n in nodes]
    bad_tel = [
        *bad_messages(valid_tel[0], valid_evt[0], 80),
        oversized(nc.max_payload, headroom=0),
        oversized(nc.max_payload, headroom=200),
    ]
    bad_evt = bad_messages(valid_evt[0], valid_tel[0], 40)
    try:
        valid = iter(valid_tel)
        for i, data in enumerate(bad_tel):
            await nc.publish(subjects.telemetry(REGION, "c1", "n0"), data)
            if i % 2 == 0 and (b := next(valid, None)) is not None:
                await nc.publish(subjects.telemetry(REGION, "c1", b.node.node), encode(b))
        for b in valid:
            await nc.publish(subjects.telemetry(REGION, "c1", b.node.node), encode(b))
        events = iter(valid_evt)
        for i, data in enumerate(bad_evt):
            await nc.publish(subjects.node_event(REGION, "c1", "n1", "aer_fatal"), data)
            if i % 2 == 0 and (e := next(events, None)) is not None:
                n = e.node
                await nc.publish(subjects.node_event(REGION, n.cluster, n.node, e.kind), encode(e))
        for e in events:
            n = e.node
            await nc.publish(subjects.node_event(REGION, n.cluster, n.node, e.kind), encode(e))
        await nc.flush()

        await wait_until(lambda: len(rec.batches) == len(valid_tel), DEADLINE_S, "valid batches")
        await wait_until(lambda: len(rec.events) == len(valid_evt), DEADLINE_S, "valid events")
        tel_stream, evt_stream = subjects.stream_telemetry, subjects.stream_events

        def errors(stream: str) -> int:
            return ing.stats().streams[stream].decode_errors

        await wait_until(lambda: errors(tel_stream) == len(bad_tel), DEADLINE_S, "tel errors")
        await wait_until(lambda: errors(evt_stream) == len(bad_evt), DEADLINE_S, "evt errors")
        for stream in (tel_stream, evt_stream):
            durable = ing.durables[stream]

            async def pending(stream: str = stream, durable: str = durable) -> tuple[int, int]:
                info = await js.consumer_info(stream, durable)
                return info.num_ack_pending, info.num_pending

            await wait_for_value(pending, lambda v: v == (0, 0), DEADLINE_S, f"{stream} acked")
        # Every valid message once, each node's in order; every bad one dead-lettered.
        for n in nodes:
            assert [b.seq for b in rec.batches if b.node == n] == list(range(1, 41))
            assert [e.event_id for e in rec.events if e.node == n] == [
                f"{n.node}-{i}" for i in range(10)
            ]
        dlq = (await js.stream_info(subjects.stream_dead_letter)).state.messages
        assert dlq == len(bad_tel) + len(bad_evt)
        stats = ing.stats().streams[tel_stream]
        assert (stats.handler_errors, stats.dead_letter_failures) == (0, 0)
        # And it keeps serving.
        late = tel(nodes[0], 41)
        await nc.publish(subjects.telemetry(REGION, "c1", "n0"), encode(late))
        await wait_until(lambda: rec.batches[-1] == late, DEADLINE_S, "a later batch")
    finally:
        await ing.stop()


@pytest.fixture
async def commands(nc: Client, subjects: Subjects, tmp_path: Path) -> AsyncIterator[CommandHandler]:
    me = ident("n0")

    async def emit(event: NodeEvent) -> None:
        return None

    settings = RunnerSettings(work_dir=tmp_path / "work", socket_path=str(tmp_path / "w.sock"))
    runner = Runner(lambda: me, emit, settings)
    handler = CommandHandler(lambda: me, runner)
    await handler.subscribe(nc, subjects)
    try:
        yield handler
    finally:
        await handler.close()


async def test_workload_commands_answer_every_bad_message_with_an_error(
    nc: Client, subjects: Subjects, commands: CommandHandler
) -> None:
    me = ident("n0")

    def status(i: int) -> Command:
        return Command(command_id=f"c-{i}", ts=0.0, node=me, verb="status")

    wrong: list[dict[str, Any]] = [
        {},
        {"job_id": 5, "command": "python"},
        {"job_id": "j", "command": "python", "args": "not a list"},
        {"job_id": "j", "command": "python", "env": ["NO_EQUALS"]},
        {"job_id": "j", "command": "python", "rank": "zero"},
        {"job_id": "", "command": ""},
    ]
    wrong_args = [
        Command(command_id=f"w-{i}", ts=0.0, node=me, verb="start", args=args)
        for i, args in enumerate(wrong)
    ]
    bad = [
        *bad_messages(status(0), tel(me, 1), 60),
        oversized(nc.max_payload, headroom=4096),
        *(encode(c) for c in wrong_args),
        encode(Command(command_id="x", ts=0.0, node=me, verb="stop")),  # on `status`
        encode(Command(command_id="y", ts=0.0, node=ident("other"), verb="status")),
    ]
    subject = subjects.command(REGION, "c1", "n0", "status")
    start_subject = subjects.command(REGION, "c1", "n0", "start")
    answered_ok = 0
    for i, data in enumerate(bad):
        target = start_subject if data in {encode(c) for c in wrong_args} else subject
        reply = decode((await nc.request(target, data, timeout=REPLY_S)).data, CommandReply)
        assert not reply.ok, (data[:80], reply)
        assert reply.status == CommandStatus.REJECTED, (data[:80], reply)
        assert reply.message, reply
        good = await nc.request(subject, encode(status(i + 1)), timeout=REPLY_S)
        answer = decode(good.data, CommandReply)
        assert answer.ok, answer
        assert answer.command_id == f"c-{i + 1}", answer
        answered_ok += 1
    assert answered_ok == len(bad)
    # Executed: the valid statuses and the well-formed starts refused for their args.
    assert commands.executed == len(bad) + len(wrong_args)


class FakeJobs:
    """What the federation hands a forwarded job to: records it, answers ok."""

    def __init__(self) -> None:
        self.accepted: list[JobForward] = []

    async def accept(self, forwarded: object) -> JobForwardReply:
        assert isinstance(forwarded, JobForward)
        self.accepted.append(forwarded)
        return JobForwardReply(ok=True, region=REGION)


@pytest.fixture
async def federation(nc: Client, subjects: Subjects) -> AsyncIterator[tuple[Federation, FakeJobs]]:
    jobs = FakeJobs()
    fed = Federation(
        nc,
        subjects,
        REGION,
        records=lambda: {},
        fleet=lambda: [],
        interval_s=60.0,
        accept=jobs.accept,
        clock=lambda: T0,  # one log line per kind: the interval never passes
    )
    await fed.start()
    try:
        yield fed, jobs
    finally:
        await fed.stop()


async def test_federation_subjects_survive_bad_messages(
    nc: Client,
    subjects: Subjects,
    federation: tuple[Federation, FakeJobs],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="metalguard.controller.federation.service")
    fed, jobs = federation
    summary = RegionSummary(region="r2", ts=1.0, interval_s=5.0, nodes=3)
    job = Job(job_id="j-1", name="llm", command="python")
    forward = JobForward(job=job, origin="r2")
    lookup = NodeLookup(uuid="u-1")

    # Summaries: the bad are ignored (counted), every valid one is taken in.
    elsewhere = RegionSummary(region="r3", ts=1.0, interval_s=5.0, nodes=3)  # on r2's subject
    bad_summaries = [*bad_messages(summary, lookup, 50), encode(elsewhere)]
    for i, data in enumerate(bad_summaries):
        await nc.publish(subjects.fed_summary("r2"), data)
        await nc.publish(
            subjects.fed_summary("r2"),
            encode(RegionSummary(region="r2", ts=float(i + 2), interval_s=5.0, nodes=3)),
        )
    await nc.publish(subjects.fed_summary("r2"), oversized(nc.max_payload))
    await nc.flush()
    await wait_until(
        lambda: (
            [h.summary.ts for h in fed.view.heard(0.0) if h.summary.region == "r2"]
            == [len(bad_summaries) + 1.0]
        ),
        DEADLINE_S,
        "the last valid summary",
    )
    await wait_until(
        lambda: fed.bad_messages["summary"] == len(bad_summaries) + 1,  # the oversized too
        DEADLINE_S,
        "every bad summary counted",
    )
    assert "r3" not in fed.view.regions

    # Forwarded jobs: every bad one answered `rejected`, every valid one accepted; a job
    # that a submit here would refuse is never handed on.
    unfit = [
        Job(job_id="a.b", name="llm", command="python"),  # not a KV key nor a token
        Job(job_id="j-x", name="llm", command=" "),
        Job(job_id="j-y", name="llm", command="python", env={"MG_RANK": "3"}),
    ]
    bad_forwards = [
        *bad_messages(forward, lookup, 50),
        oversized(nc.max_payload, 4096),
        *(encode(JobForward(job=j, origin="r2")) for j in unfit),
    ]
    for i, data in enumerate(bad_forwards):
        msg = await nc.request(subjects.fed_submit(REGION), data, timeout=REPLY_S)
        reply = decode(msg.data, JobForwardReply)
        assert not reply.ok, reply
        assert reply.error == "rejected", reply
        assert reply.reasons, reply
        valid = JobForward(job=Job(job_id=f"j-{i}", name="llm", command="python"), origin="r2")
        ok = decode((await nc.request(subjects.fed_submit(REGION), encode(valid))).data)
        assert isinstance(ok, JobForwardReply)
        assert ok.ok
    assert [f.job.job_id for f in jobs.accepted] == [f"j-{i}" for i in range(len(jobs.accepted))]
    assert len(jobs.accepted) == len(bad_forwards)
    assert fed.bad_messages["submit"] == len(bad_forwards)

    # Lookups: every bad one answered `rejected` with the reason; valid ones answered.
    bad_lookups = [*bad_messages(lookup, summary, 30), oversized(nc.max_payload, 4096)]
    for data in bad_lookups:
        msg = await nc.request(subjects.fed_lookup(REGION), data, timeout=REPLY_S)
        rejected = decode(msg.data, NodeLookupReply)
        assert (rejected.found, rejected.error, rejected.region) == (False, "rejected", REGION)
        assert rejected.reasons, rejected
        assert rejected.reasons[0], rejected
        answer = decode((await nc.request(subjects.fed_lookup(REGION), encode(lookup))).data)
        assert isinstance(answer, NodeLookupReply)
        assert (answer.uuid, answer.found, answer.error) == ("u-1", False, "")
    assert fed.bad_messages["lookup"] == len(bad_lookups)
    # Logged once per kind, not once per message.
    logged = [r.getMessage() for r in caplog.records if "federation: bad" in r.getMessage()]
    assert [m.split()[2] for m in logged] == ["summary", "submit", "lookup"], logged
    asked = encode(RegionPing(region="r2", ts=1.0))
    ping = decode((await nc.request(subjects.fed_lookup(REGION), asked)).data)
    assert isinstance(ping, RegionPing)
    assert ping.region == REGION


class FakeReconciler:
    """What the QoS watcher feeds: the profiles set and the invalid values reported."""

    def __init__(self) -> None:
        self.profiles: list[QosProfile | None] = []
        self.invalid: list[tuple[str, list[str]]] = []

    async def set_profile(self, profile: QosProfile | None, source: str = "") -> None:
        self.profiles.append(profile)

    async def report_invalid(self, source: str, reasons: list[str]) -> None:
        self.invalid.append((source, reasons))


async def test_the_qos_watch_reports_bad_values_and_takes_every_valid_one(
    nc: Client, subjects: Subjects
) -> None:
    js = nc.jetstream(timeout=5)
    rec = FakeReconciler()
    watcher = ProfileWatcher(subjects, "c1", "n0", rec, retry_s=0.2)  # type: ignore[arg-type]
    kv = await js.key_value(watcher.bucket)

    async def get_js() -> object:
        return js

    task = asyncio.create_task(watcher.run(get_js))  # type: ignore[arg-type]
    try:
        profile = QosProfile(version=1)
        bad = [b for b in bad_messages(profile, tel(ident("n0"), 1), 40) if b]
        version = 1
        await kv.put("c1", encode(profile))  # the watch is live once this arrives
        await wait_until(lambda: bool(rec.profiles), DEADLINE_S, "the first profile")
        for data in bad:
            await kv.put("c1", data)
            version += 1
            await kv.put("c1", encode(QosProfile(version=version)))
        await wait_until(
            lambda: bool(rec.profiles) and getattr(rec.profiles[-1], "version", 0) == version,
            DEADLINE_S,
            "the last valid profile",
        )
        await wait_until(lambda: len(rec.invalid) == len(bad), DEADLINE_S, "bad values reported")
        assert all(reasons for _, reasons in rec.invalid)
        assert [getattr(p, "version", None) for p in rec.profiles] == list(range(1, version + 1))
        assert not task.done()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@pytest.mark.parametrize(
    "valid",
    [
        ControllerEvent(event_id="e", ts=0.0, region="r1", kind="node.cordoned"),
        Command(command_id="c", ts=0.0, node=ident("n0"), verb="status"),
        NodeLookup(uuid="u"),
        JobForward(job=Job(job_id="j", name="n", command="python"), origin="r2"),
    ],
    ids=lambda m: type(m).__name__,
)
def test_no_bad_message_is_a_valid_one(valid: msgspec.Struct) -> None:
    """A ``str | None`` field set to a string is no wrong type: such are left out."""
    for data in bad_messages(valid, RegionPing(region="r", ts=0.0), 20):
        with pytest.raises(CodecError):
            decode(data, type(valid))


def test_the_garbage_is_the_same_every_run() -> None:
    """Derandomized: a failure found here is found again."""
    first = bad_messages(NodeLookup(uuid="u"), RegionPing(region="r", ts=0.0), 20)
    assert first == bad_messages(NodeLookup(uuid="u"), RegionPing(region="r", ts=0.0), 20)
