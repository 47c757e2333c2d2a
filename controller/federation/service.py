"""Federation over NATS: regions tell each other their state through gateways
(docs/federation.md).

Each region's controller publishes a :class:`RegionSummary` on
``<p>.fed.summary.<region>`` every ``interval_s`` (core NATS: gateways carry it to every
region that listens), answers node lookups by UUID, job lookups by id and pings on
``<p>.fed.lookup.<region>``, and takes forwarded jobs on ``<p>.fed.submit.<region>``
(the region's controllers in one queue group; the leader accepts them).
Every controller keeps the newest summary of each region it has heard (a
:class:`~metalguard.controller.federation.view.FleetView`); one older than
``STALE_INTERVALS`` of its interval is *stale* — a region cut off from the others keeps
working on its own and shows the others as stale until the gateway returns, when the
next summaries make the views converge.  The pure parts live in view.py.

A bad message on any of the three (undecodable, of another type, a summary on another
region's subject, a forwarded job that would not pass a submit here) is counted in
:attr:`Federation.bad_messages`, logged once per subject kind per ``BAD_LOG_INTERVAL_S``
and, on the two request subjects, answered ``rejected`` with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError

from metalguard.controller.federation.forwarding import RegionOffer, effective_latency, median
from metalguard.controller.federation.view import FleetView, find_uuid, summarize
from metalguard.controller.ingest.metrics import RateLimiter
from metalguard.controller.jobs.scheduler import FleetNode
from metalguard.controller.jobs.spec import job_problems
from metalguard.proto.codec import CodecError, decode, encode
from metalguard.proto.federation import (
    JobCancel,
    JobForward,
    JobForwardReply,
    JobLookup,
    JobLookupReply,
    NodeLookup,
    NodeLookupReply,
    RegionPing,
    RegionSummary,
)
from metalguard.proto.jobs import Job, JobStatus
from metalguard.proto.nodes import NodeRecord
from metalguard.proto.subjects import FedSummarySubject, SubjectError, Subjects

log = logging.getLogger(__name__)

LOOKUP_TIMEOUT_S = 1.0
"""How long a node or job lookup, and a ping, waits for each other region."""
FORWARD_TIMEOUT_S = 3.0
"""How long forwarding a job waits for the chosen region's answer (each try)."""
FORWARD_TRIES = 3
"""Tries of a forward answered ``not_leader`` (the queue group picked a follower)."""
RTT_SAMPLES = 5
"""Round trips kept per region; the measured latency is their median."""
SUBMIT_QUEUE = "metalguard-fed-submit"
BAD_LOG_INTERVAL_S = 60.0
"""Bad messages are logged once per subject kind per this interval (all are counted)."""
MAX_REASON = 300
"""The longest reason logged or answered for a bad message (characters)."""

RecordsOf = Callable[[], Mapping[str, NodeRecord]]
FleetOf = Callable[[], Iterable[FleetNode]]
JobCounts = Callable[[], tuple[int, int]]
"""(queued, running) jobs of the region."""
BusyNodes = Callable[[], Collection[str]]
"""The node handles unfinished jobs of the region hold (``view.busy_nodes``)."""
JobOf = Callable[[str], JobStatus | None]
"""This region's status of a job id (None: not here)."""
Accept = Callable[[JobForward | JobCancel], Awaitable[JobForwardReply]]
"""What this region does with a job forwarded to it, or a cancel of one of its jobs."""


class Federation:
    """Publishes this region's summary, keeps the fleet view, answers and asks node
    lookups; on one NATS connection (the controller's)."""

    def __init__(
        self,
        nc: Client,
        subjects: Subjects,
        region: str,
        records: RecordsOf,
        fleet: FleetOf,
        *,
        interval_s: float = 5.0,
        controller: str = "",
        jobs: JobCounts | None = None,
        busy: BusyNodes | None = None,
        leading: Callable[[], bool] = lambda: True,
        clock: Callable[[], float] = time.time,
        latency_ms: Mapping[str, float] | None = None,
        job_of: JobOf | None = None,
        accept: Accept | None = None,
    ) -> None:
        self._nc = nc
        self._subjects = subjects
        self.region = region
        self._records = records
        self._fleet = fleet
        self.interval_s = interval_s
        self._controller = controller
        self._jobs = jobs
        self._busy = busy
        self._leading = leading
        self._clock = clock
        self.view = FleetView()
        self.configured_latency_ms: dict[str, float] = dict(latency_ms or {})
        self._rtts: dict[str, deque[float]] = {}
        self.job_of = job_of
        self.accept = accept
        self.every_interval: Callable[[], Awaitable[None]] | None = None
        """Run by the leader after each summary (the job forwarding retry pass)."""
        self._subs: list[Subscription] = []
        self._submit_sub: Subscription | None = None
        self._task: asyncio.Task[None] | None = None
        self._published = asyncio.Event()
        self.bad_messages: dict[str, int] = {"summary": 0, "lookup": 0, "submit": 0}
        """Bad messages taken on each subject kind (ignored or answered ``rejected``)."""
        self._bad_log = RateLimiter(BAD_LOG_INTERVAL_S, clock)

    async def start(self) -> None:
        """Listen to every region's summaries, answer lookups, start publishing."""
        self._subs.append(
            await self._nc.subscribe(self._subjects.fed_summary("*"), cb=self._on_summary)
        )
        self._subs.append(
            await self._nc.subscribe(self._subjects.fed_lookup(self.region), cb=self._on_lookup)
        )
        await self._sync_submit()
        await self._nc.flush()
        self._task = asyncio.create_task(self._publish_loop(), name="federation")

    async def stop(self) -> None:
        """Stop publishing and listening (idempotent)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        subs, self._subs = self._subs, []
        if self._submit_sub is not None:
            subs.append(self._submit_sub)
            self._submit_sub = None
        for sub in subs:
            with contextlib.suppress(NatsError):
                await sub.unsubscribe()

    def summary(self) -> RegionSummary:
        """This region's summary now."""
        queued, running = self._jobs() if self._jobs is not None else (0, 0)
        return summarize(
            self.region,
            self._records(),
            self._fleet(),
            self._clock(),
            self.interval_s,
            controller=self._controller,
            queued_jobs=queued,
            running_jobs=running,
            busy=self._busy() if self._busy is not None else frozenset(),
        )

    def fleet(self) -> list[dict[str, Any]]:
        """``GET /v1/fleet``: every region heard, this one from its own state now, each
        with ``latency_ms`` (used for ``max_latency_ms``) and ``rtt_ms`` (measured)."""
        now = self._clock()
        own = msgspec.to_builtins(self.summary()) | {"age_s": 0.0, "stale": False}
        others = [r for r in self.view.snapshot(now) if r["region"] != self.region]
        rows = sorted([own, *others], key=lambda r: str(r["region"]))
        measured = self.measured_rtt_ms()
        for row in rows:
            region = str(row["region"])
            row["latency_ms"] = self.latency_ms(region)
            row["rtt_ms"] = measured.get(region)
        return rows

    def measured_rtt_ms(self) -> dict[str, float]:
        """The median measured round trip to each region pinged (milliseconds)."""
        out = {}
        for region, samples in self._rtts.items():
            value = median(samples)
            if value is not None:
                out[region] = value
        return out

    def latency_ms(self, region: str) -> float | None:
        """The latency to ``region`` used by ``max_latency_ms`` (configured, else measured)."""
        return effective_latency(
            region, self.region, self.configured_latency_ms, self.measured_rtt_ms()
        )

    def offers(self) -> list[RegionOffer]:
        """Every region this controller could place a job in, this one first."""
        offers = [RegionOffer(self.summary(), False, 0.0)]
        for row in self.view.heard(self._clock()):
            if row.summary.region != self.region:
                offers.append(
                    RegionOffer(row.summary, row.stale, self.latency_ms(row.summary.region))
                )
        return offers

    async def forward(self, region: str, job: Job) -> JobForwardReply:
        """Send ``job`` to ``region``'s leader; ``unavailable`` when nobody answers."""
        request = encode(JobForward(job=job, origin=self.region))
        reply = JobForwardReply(ok=False, region=region, error="unavailable")
        for _ in range(FORWARD_TRIES):
            try:
                msg = await self._nc.request(
                    self._subjects.fed_submit(region), request, timeout=FORWARD_TIMEOUT_S
                )
                reply = decode(msg.data, JobForwardReply)
            except (NatsError, TimeoutError, CodecError) as exc:
                log.warning("federation: forwarding %s to %s failed: %s", job.job_id, region, exc)
                return JobForwardReply(ok=False, region=region, error="unavailable")
            if reply.error != "not_leader":
                return reply
        return reply

    async def cancel_remote(self, region: str, job_id: str) -> JobForwardReply:
        """Ask ``region``'s leader to cancel its job ``job_id``."""
        request = encode(JobCancel(job_id=job_id, origin=self.region))
        try:
            msg = await self._nc.request(
                self._subjects.fed_submit(region), request, timeout=FORWARD_TIMEOUT_S
            )
            return decode(msg.data, JobForwardReply)
        except (NatsError, TimeoutError, CodecError) as exc:
            log.warning("federation: cancelling %s in %s failed: %s", job_id, region, exc)
            return JobForwardReply(ok=False, region=region, error="unavailable")

    async def find_job(self, job_id: str) -> JobLookupReply:
        """Job ``job_id``: here, else the first other region that holds it."""
        here = self.job_of(job_id) if self.job_of is not None else None
        if here is not None:
            return JobLookupReply(job_id=job_id, found=True, region=self.region, status=here)
        request = encode(JobLookup(job_id=job_id))
        for region in self.view.regions:
            if region == self.region:
                continue
            try:
                msg = await self._nc.request(
                    self._subjects.fed_lookup(region), request, timeout=LOOKUP_TIMEOUT_S
                )
                reply = decode(msg.data, JobLookupReply)
            except (NatsError, TimeoutError, CodecError) as exc:
                log.info("federation: job lookup in %s failed: %s", region, exc)
                continue
            if reply.found:
                return reply
        return JobLookupReply(job_id=job_id, found=False)

    async def ping_once(self) -> None:
        """Measure the round trip to every other region heard that is not stale."""
        now = self._clock()
        targets = [
            r.summary.region
            for r in self.view.heard(now)
            if r.summary.region != self.region and not r.stale
        ]
        await asyncio.gather(*(self._ping(region) for region in targets))

    async def _ping(self, region: str) -> None:
        request = encode(RegionPing(region=region, ts=self._clock()))
        started = time.perf_counter()
        try:
            msg = await self._nc.request(
                self._subjects.fed_lookup(region), request, timeout=LOOKUP_TIMEOUT_S
            )
            decode(msg.data, RegionPing)
        except (NatsError, TimeoutError, CodecError) as exc:
            log.info("federation: ping to %s failed: %s", region, exc)
            return
        rtt_ms = (time.perf_counter() - started) * 1000.0
        self._rtts.setdefault(region, deque(maxlen=RTT_SAMPLES)).append(rtt_ms)

    async def publish_once(self) -> None:
        """Publish this region's summary (the leader does; followers only listen)."""
        if not self._leading():
            return
        try:
            await self._nc.publish(self._subjects.fed_summary(self.region), encode(self.summary()))
        except NatsError as exc:
            log.warning("federation: summary not published: %s", exc)

    async def lookup(self, uuid: str) -> NodeLookupReply:
        """The node with ``uuid``: here, else the first other region that knows it."""
        local = find_uuid(self.region, self._records(), uuid)
        if local.found:
            return local
        request = encode(NodeLookup(uuid=uuid))
        for region in self.view.regions:
            if region == self.region:
                continue
            subject = self._subjects.fed_lookup(region)
            try:
                msg = await self._nc.request(subject, request, timeout=LOOKUP_TIMEOUT_S)
                reply = decode(msg.data, NodeLookupReply)
            except (NatsError, TimeoutError, CodecError) as exc:
                log.info("federation: lookup in %s failed: %s", region, exc)
                continue
            if reply.found:
                return reply
        return local

    async def _sync_submit(self) -> None:
        """Take forwarded jobs while leading (a follower does not hold the subscription,
        so a forward never lands on it); the queue group covers a handover's overlap."""
        leading = self._leading()
        try:
            if leading and self._submit_sub is None:
                self._submit_sub = await self._nc.subscribe(
                    self._subjects.fed_submit(self.region), queue=SUBMIT_QUEUE, cb=self._on_submit
                )
            elif not leading and self._submit_sub is not None:
                sub, self._submit_sub = self._submit_sub, None
                await sub.unsubscribe()
        except NatsError as exc:
            log.warning("federation: forwarded-job subscription not changed: %s", exc)

    async def _publish_loop(self) -> None:
        while True:
            await self._sync_submit()
            await self.publish_once()
            if self._leading():
                await self.ping_once()
                if self.every_interval is not None:
                    try:
                        await self.every_interval()
                    except Exception:  # one bad pass must not end the summaries
                        log.exception("federation: interval pass failed")
            await asyncio.sleep(self.interval_s)

    async def _on_summary(self, msg: Msg) -> None:
        try:
            parsed = self._subjects.parse(msg.subject)
            summary = decode(msg.data, RegionSummary)
        except (SubjectError, CodecError) as exc:
            self._bad("summary", msg.subject, str(exc))
            return
        if not isinstance(parsed, FedSummarySubject) or parsed.region != summary.region:
            self._bad("summary", msg.subject, f"carries region {summary.region!r}")
            return
        self.view.take(summary, self._clock())

    def _bad(self, kind: str, subject: str, reason: str) -> str:
        """Count a bad message on ``kind``'s subject, log it (once per kind per interval);
        the reason, shortened, for an answer."""
        reason = " ".join(reason.split())[:MAX_REASON]
        self.bad_messages[kind] = self.bad_messages.get(kind, 0) + 1
        suppressed = self._bad_log.allow(kind)
        if suppressed is not None:
            more = f" ({suppressed} more bad {kind} messages since)" if suppressed else ""
            log.warning("federation: bad %s message on %s: %s%s", kind, subject, reason, more)
        return reason

    async def _on_lookup(self, msg: Msg) -> None:
        answer: NodeLookupReply | JobLookupReply | RegionPing
        try:
            asked: object = decode(msg.data)
        except CodecError as exc:
            asked, why = None, str(exc)
        else:
            why = f"a {type(asked).__name__} is not a lookup"
        if isinstance(asked, NodeLookup):
            answer = find_uuid(self.region, self._records(), asked.uuid)
        elif isinstance(asked, JobLookup):
            status = self.job_of(asked.job_id) if self.job_of is not None else None
            answer = JobLookupReply(
                job_id=asked.job_id, found=status is not None, region=self.region, status=status
            )
        elif isinstance(asked, RegionPing):
            answer = RegionPing(region=self.region, ts=self._clock())
        else:
            reason = self._bad("lookup", msg.subject, why)
            answer = NodeLookupReply(
                uuid="", found=False, region=self.region, error="rejected", reasons=(reason,)
            )
        if msg.reply:
            with contextlib.suppress(NatsError):
                await msg.respond(encode(answer))

    async def _on_submit(self, msg: Msg) -> None:
        try:
            forwarded = decode(msg.data, JobForward | JobCancel)  # type: ignore[arg-type]
        except CodecError as exc:
            reason = self._bad("submit", msg.subject, str(exc))
            reply = JobForwardReply(
                ok=False, region=self.region, error="rejected", reasons=(reason,)
            )
        else:
            problems = job_problems(forwarded.job) if isinstance(forwarded, JobForward) else []
            if problems:  # a job a submit here would refuse: never queued unchecked
                self._bad("submit", msg.subject, "; ".join(problems))
                reasons = tuple(p[:MAX_REASON] for p in problems)
                reply = JobForwardReply(
                    ok=False, region=self.region, error="rejected", reasons=reasons
                )
            elif self.accept is None:
                reply = JobForwardReply(ok=False, region=self.region, error="unavailable")
            else:
                reply = await self.accept(forwarded)
        if msg.reply:
            with contextlib.suppress(NatsError):
                await msg.respond(encode(reply))
