"""Federation: regions tell each other their state over NATS gateways (docs/federation.md).

Each region's controller publishes a :class:`RegionSummary` on
``<p>.fed.summary.<region>`` every ``interval_s`` (core NATS: gateways carry it to every
region that listens) and answers node lookups by UUID on ``<p>.fed.lookup.<region>``.
Every controller keeps the newest summary of each region it has heard (:class:`FleetView`);
one older than ``STALE_INTERVALS`` of its interval is *stale* — a region cut off from the
others keeps working on its own and shows the others as stale until the gateway returns,
when the next summaries make the views converge.  The pure parts (:func:`summarize`,
:class:`FleetView`) take time as an argument.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError

from controller.scheduler import FleetNode
from proto.codec import CodecError, decode, encode
from proto.federation import GpuCapacity, NodeLookup, NodeLookupReply, RegionSummary
from proto.jobs import JobStatus
from proto.nodes import GRADES, NodeRecord
from proto.subjects import FedSummarySubject, SubjectError, Subjects

log = logging.getLogger(__name__)

STALE_INTERVALS = 3.0
"""A summary older than this many of its region's intervals is stale."""
LOOKUP_TIMEOUT_S = 1.0
"""How long a node lookup waits for each other region."""


def summarize(
    region: str,
    records: Mapping[str, NodeRecord],
    fleet: Iterable[FleetNode],
    now: float,
    interval_s: float,
    *,
    controller: str = "",
    queued_jobs: int = 0,
    running_jobs: int = 0,
) -> RegionSummary:
    """The region's summary: nodes per grade and GPU capacity per type (pure)."""
    grades = Counter(r.grade for r in records.values())
    by_type: dict[str, list[int]] = {}
    for node in fleet:
        healthy = node.grade == "HEALTHY" and not node.cordoned
        row = by_type.setdefault(node.gpu_type, [0, 0, 0, 0])
        row[0] += 1
        row[1] += healthy
        row[2] += node.gpus
        row[3] += node.gpus if healthy else 0
    capacity = tuple(
        GpuCapacity(gpu_type=t, nodes=n, healthy_nodes=h, gpus=g, healthy_gpus=hg)
        for t, (n, h, g, hg) in sorted(by_type.items())
    )
    return RegionSummary(
        region=region,
        ts=now,
        interval_s=interval_s,
        controller=controller,
        nodes=len(records),
        grades={g: grades.get(g, 0) for g in GRADES},
        capacity=capacity,
        queued_jobs=queued_jobs,
        running_jobs=running_jobs,
    )


@dataclass(frozen=True, slots=True)
class Heard:
    """A region's newest summary and when this controller received it."""

    summary: RegionSummary
    received_ts: float


class FleetView:
    """The newest summary of every region heard, by region (pure; time as arguments)."""

    def __init__(self) -> None:
        self._heard: dict[str, Heard] = {}

    def take(self, summary: RegionSummary, received_ts: float) -> bool:
        """Keep ``summary`` unless an as-new one of its region is kept; whether kept."""
        held = self._heard.get(summary.region)
        if held is not None and held.summary.ts > summary.ts:
            return False
        self._heard[summary.region] = Heard(summary, received_ts)
        return True

    @property
    def regions(self) -> list[str]:
        """The regions heard from, sorted."""
        return sorted(self._heard)

    def snapshot(self, now: float) -> list[dict[str, Any]]:
        """Every region's summary with ``age_s`` and ``stale``, sorted by region."""
        out = []
        for region in self.regions:
            heard = self._heard[region]
            age = max(0.0, now - heard.received_ts)
            stale = age > STALE_INTERVALS * max(heard.summary.interval_s, 0.001)
            out.append(msgspec.to_builtins(heard.summary) | {"age_s": age, "stale": stale})
        return out


RecordsOf = Callable[[], Mapping[str, NodeRecord]]
FleetOf = Callable[[], Iterable[FleetNode]]
JobCounts = Callable[[], tuple[int, int]]
"""(queued, running) jobs of the region."""


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
        leading: Callable[[], bool] = lambda: True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._nc = nc
        self._subjects = subjects
        self.region = region
        self._records = records
        self._fleet = fleet
        self.interval_s = interval_s
        self._controller = controller
        self._jobs = jobs
        self._leading = leading
        self._clock = clock
        self.view = FleetView()
        self._subs: list[Subscription] = []
        self._task: asyncio.Task[None] | None = None
        self._published = asyncio.Event()

    async def start(self) -> None:
        """Listen to every region's summaries, answer lookups, start publishing."""
        self._subs.append(
            await self._nc.subscribe(self._subjects.fed_summary("*"), cb=self._on_summary)
        )
        self._subs.append(
            await self._nc.subscribe(self._subjects.fed_lookup(self.region), cb=self._on_lookup)
        )
        await self._nc.flush()
        self._task = asyncio.create_task(self._publish_loop(), name="federation")

    async def stop(self) -> None:
        """Stop publishing and listening (idempotent)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        subs, self._subs = self._subs, []
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
        )

    def fleet(self) -> list[dict[str, Any]]:
        """``GET /v1/fleet``: every region heard, this one from its own state now."""
        now = self._clock()
        own = msgspec.to_builtins(self.summary()) | {"age_s": 0.0, "stale": False}
        others = [r for r in self.view.snapshot(now) if r["region"] != self.region]
        return sorted([own, *others], key=lambda r: str(r["region"]))

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

    async def _publish_loop(self) -> None:
        while True:
            await self.publish_once()
            await asyncio.sleep(self.interval_s)

    async def _on_summary(self, msg: Msg) -> None:
        try:
            parsed = self._subjects.parse(msg.subject)
            summary = decode(msg.data, RegionSummary)
        except (SubjectError, CodecError) as exc:
            log.warning("federation: ignoring %s: %s", msg.subject, exc)
            return
        if not isinstance(parsed, FedSummarySubject) or parsed.region != summary.region:
            log.warning("federation: %s carries region %r", msg.subject, summary.region)
            return
        self.view.take(summary, self._clock())

    async def _on_lookup(self, msg: Msg) -> None:
        try:
            uuid = decode(msg.data, NodeLookup).uuid
        except CodecError as exc:
            log.warning("federation: bad lookup on %s: %s", msg.subject, exc)
            return
        if msg.reply:
            with contextlib.suppress(NatsError):
                await msg.respond(encode(find_uuid(self.region, self._records(), uuid)))


def job_counts(jobs: Mapping[str, JobStatus]) -> tuple[int, int]:
    """(queued, running) among ``jobs`` (the job manager's statuses; pure)."""
    states = Counter(s.state for s in jobs.values())
    return states.get("queued", 0), states.get("running", 0)


def find_uuid(region: str, records: Mapping[str, NodeRecord], uuid: str) -> NodeLookupReply:
    """The reply for ``uuid`` from this region's records (pure)."""
    if uuid:
        for handle, record in records.items():
            if record.node.uuid == uuid:
                return NodeLookupReply(
                    uuid=uuid, found=True, region=region, handle=handle, record=record
                )
    return NodeLookupReply(uuid=uuid, found=False)
