"""Ingest: durable JetStream pull consumers feeding the region controller.

One durable consumer per stream (telemetry, node events), filtered to this region (and
to the clusters this process owns).  A fetch loop per stream pulls batches
(:mod:`controller.ingest_pull`; the next pull is in flight while a batch is routed),
sorts each message to its node's lane (:mod:`controller.ingest_dispatch`) and the lane's
worker calls the :class:`~controller.ingest_api.IngestHandler`, then acknowledges.  A
batch of a node with nothing queued goes to the handler's ``on_batch_now`` straight from
the fetch loop when it has one (only what needs I/O is queued).  Messages that cannot be
decoded are published to ``<p>.dlq.<stream>`` and acknowledged away.  See docs/ingest.md.

Ingest also tells whether its intake is live (:attr:`Ingest.intake`, and the handler's
optional ``on_intake(pending)``): after every telemetry fetch that brought messages,
and every second from a probe of the telemetry consumer (``consumer_info``) that the
broker answered, with the consumer's count of messages still pending. No word for a
while is a stall of the broker or of the path to it; the controller judges silence over
the time its intake was live only (controller/core/receiving.py, docs/lifecycle.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final

import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError
from prometheus_client import CollectorRegistry

from metalguard.controller.ingest.dispatch import NodeDispatcher
from metalguard.controller.ingest.handler import IngestHandler
from metalguard.controller.ingest.metrics import IngestMetrics, IngestStats, RateLimiter
from metalguard.controller.ingest.pull import Puller, context_parts
from metalguard.controller.ingest.settings import (
    IngestSettings,
    StreamKind,
    durable_name,
    filter_subjects,
    shard_of,
)
from metalguard.controller.stopping import cancel_within
from metalguard.proto.base import node_handle
from metalguard.proto.codec import CodecError, SectionReuse, decode
from metalguard.proto.events import NodeEvent
from metalguard.proto.subjects import (
    NodeEventSubject,
    ParsedSubject,
    SubjectError,
    Subjects,
    TelemetrySubject,
)
from metalguard.proto.telemetry import TelemetryBatch
from metalguard.runtime.deadlines import wait_event, within

log = logging.getLogger(__name__)

UNKNOWN_SENDER: Final = "unknown"
HDR_SUBJECT: Final = "Mg-Original-Subject"
HDR_STREAM: Final = "Mg-Original-Stream"
HDR_SEQ: Final = "Mg-Original-Seq"
HDR_SENDER: Final = "Mg-Sender"
HDR_REASON: Final = "Mg-Reason"
HDR_SIZE: Final = "Mg-Original-Size"
"""Set on a dead letter cut short to fit the server's max_payload: the original's size."""
_MAX_REASON = 512
_HEADER_ROOM = 1024
"""Bytes kept free in a dead letter for its headers and the protocol's framing."""


def dead_letter_payload(data: bytes, headers: dict[str, str], max_payload: int) -> bytes:
    """``data`` as a dead letter can carry it: whole, or its head when the original and
    the dead letter's headers together would exceed ``max_payload`` (the server closes a
    connection that publishes more; the original would be nak'ed and redelivered forever).
    A cut one gets ``HDR_SIZE`` in ``headers``."""
    room = max_payload - _HEADER_ROOM - sum(len(k) + len(v) + 4 for k, v in headers.items())
    if len(data) <= room:
        return data
    headers[HDR_SIZE] = str(len(data))
    return data[: max(room, 0)]


INLINE_YIELD_EVERY: Final = 64
"""Batches handled inline by the fetch loop between two yields to the event loop."""
BatchNow = Callable[[TelemetryBatch, float], Callable[[], Awaitable[None]] | None]
"""``IngestHandler.on_batch_now`` (optional): see controller/ingest_api.py."""
PARSED_SUBJECTS_KEPT: Final = 100_000
"""Parsed subjects remembered (two per node); the memo is emptied when it is full."""
PROBE_EVERY_S: Final = 1.0
"""How often the telemetry consumer is probed (``consumer_info``) for intake evidence."""
PROBE_TIMEOUT_S: Final = 2.0
"""How long one probe waits for the broker's answer."""
IntakeReport = Callable[[int | None], None]
"""``IngestHandler.on_intake`` (optional): evidence that the intake is live now, with the
telemetry consumer's pending count (None: not known)."""
REUSED_SECTIONS: Final = (
    "edac",
    "pcie",
    "smart",
    "bmc",
    "gpu",
    "net",
    "rdma",
    "errors",
    "qos",
    "topology",
)
"""TelemetryBatch fields a node's next batch reuses when their bytes are unchanged: its
counters and states (fan, temperature and collector timings change every batch)."""

__all__ = [
    "HDR_REASON",
    "HDR_SENDER",
    "HDR_SEQ",
    "HDR_STREAM",
    "HDR_SUBJECT",
    "Ingest",
    "IngestSettings",
    "IngestStats",
    "IntakeState",
    "StreamKind",
    "durable_name",
    "filter_subjects",
    "shard_of",
]


@dataclass(frozen=True, slots=True)
class IntakeState:
    """The telemetry consumer's progress as ingest last saw it."""

    progress_ts: float | None = None
    """When a fetch last brought messages or the broker last answered a probe."""
    pending: int | None = None
    """Messages the consumer still had to deliver then (None: not yet known)."""
    probe_ts: float | None = None
    """When the broker last answered a probe."""


@dataclass(slots=True)
class _Route:
    kind: StreamKind
    stream: str
    durable: str
    sub: Puller | None = None
    task: asyncio.Task[None] | None = None
    fetching: bool = False


@dataclass(frozen=True, slots=True)
class _Item:
    route: _Route
    msg: Msg
    message: TelemetryBatch | NodeEvent
    received_ts: float
    rest: Callable[[], Awaitable[None]] | None = None
    """What ``on_batch_now`` left to await (the handler was already called inline)."""


@dataclass(frozen=True, slots=True)
class _Bad:
    sender: str
    reason: str


class _Skip:
    """Another shard's message."""


_SKIP: Final = _Skip()


class Ingest:
    """Consumes this region's telemetry and node events; see the module docstring."""

    def __init__(
        self,
        js: JetStreamContext,
        subjects: Subjects,
        settings: IngestSettings,
        handler: IngestHandler,
        *,
        clock: Callable[[], float] = time.time,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self._js = js
        self._subjects = subjects
        self.settings = settings
        self._handler = handler
        self._clock = clock
        self.metrics = IngestMetrics(registry)
        self._decode_log = RateLimiter(settings.log_interval_s, clock)
        self._handler_log = RateLimiter(settings.log_interval_s, clock)
        self._fetch_log = RateLimiter(settings.log_interval_s, clock)
        self._parsed: dict[str, ParsedSubject] = {}
        """Parsed subjects by subject: a node's subjects repeat every batch."""
        self._batches = SectionReuse(TelemetryBatch, REUSED_SECTIONS)
        """Telemetry decoding that keeps each node's unchanged sections (proto/codec.py)."""
        self._dispatch: NodeDispatcher[_Item] = NodeDispatcher(
            self._serve,
            queue_size=settings.node_queue_size,
            max_concurrent=settings.max_concurrent_nodes,
        )
        self._routes = [
            _Route(StreamKind.TELEMETRY, subjects.stream_telemetry, ""),
            _Route(StreamKind.EVENTS, subjects.stream_events, ""),
        ]
        for route in self._routes:
            route.durable = durable_name(settings, route.kind)
            self.metrics.stream(route.stream)
        self._stopping = asyncio.Event()
        self._started = False
        self._batch_now: BatchNow | None = getattr(handler, "on_batch_now", None)
        """The handler's synchronous start of ``on_batch``, when it has one."""
        self._on_intake: IntakeReport | None = getattr(handler, "on_intake", None)
        """The handler's taker of intake evidence, when it has one."""
        self._intake = IntakeState()
        self._probe_task: asyncio.Task[None] | None = None

    # --- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        """Create (or update) the durable consumers, bind to them, start the fetch loops.

        Safe across restarts: an existing durable keeps its acknowledged position.  If a
        consumer cannot be created the subscriptions made so far are removed and the
        error is raised.  An Ingest starts once; make a new one to start again.
        """
        if self._started:
            raise RuntimeError("Ingest already started")
        self._started = True
        try:
            for route in self._routes:
                await self._js.add_consumer(route.stream, self._consumer_config(route))
                puller = Puller.over(self._js, route.stream, route.durable)
                await puller.start()
                route.sub = puller
        except BaseException:
            await self._unsubscribe()
            raise
        self._progress(self._clock(), None)  # the broker answered: the consumers exist
        for route in self._routes:
            route.task = asyncio.create_task(self._fetch_loop(route), name=f"ingest:{route.stream}")
            route.task.add_done_callback(_report_loop_end)
        self._probe_task = asyncio.create_task(self._probe_loop(), name="ingest-probe")
        self._probe_task.add_done_callback(_report_loop_end)
        log.info(
            "ingest started: region %s, consumers %s",
            self.settings.region,
            ", ".join(r.durable for r in self._routes),
        )

    async def stop(self) -> None:
        """Stop fetching, unsubscribe, then let queued work finish (bounded by stop_timeout_s).

        Messages not acknowledged by then are redelivered to the next consumer bind.
        """
        self._stopping.set()
        probe, self._probe_task = self._probe_task, None
        if probe is not None:
            probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await probe
        tasks = [r.task for r in self._routes if r.task is not None]
        for route in self._routes:
            if route.fetching and route.task is not None:
                route.task.cancel()  # idle in fetch: nothing of ours is lost
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self.settings.stop_timeout_s)
            await cancel_within(pending, self.settings.stop_timeout_s, "ingest stop")
        await self._unsubscribe()
        cancelled = await self._dispatch.drain(self.settings.stop_timeout_s)
        if cancelled:
            log.warning("ingest stop: %d node workers cancelled with work queued", cancelled)
        log.info("ingest stopped")

    async def _unsubscribe(self) -> None:
        for route in self._routes:
            if route.sub is not None:
                try:  # bounded: a stop never waits forever on the server
                    await within(route.sub.unsubscribe(), self.settings.stop_timeout_s)
                except (TimeoutError, nats.errors.Error) as exc:
                    log.warning("unsubscribing %s failed: %s", route.durable, exc)
                route.sub = None

    def stats(self) -> IngestStats:
        """A snapshot of the counters (keys: stream names)."""
        return self.metrics.snapshot(self._dispatch.active)

    @property
    def intake(self) -> IntakeState:
        """The telemetry consumer's progress and backlog as last seen."""
        return self._intake

    def _progress(self, ts: float, pending: int | None, *, probe: bool = False) -> None:
        """Evidence that the intake is live at ``ts``: kept, and given to the handler."""
        before = self._intake
        self._intake = IntakeState(
            max(ts, before.progress_ts or ts),
            before.pending if pending is None else pending,
            ts if probe else before.probe_ts,
        )
        if self._on_intake is not None:
            try:
                self._on_intake(pending)
            except Exception:
                log.exception("the ingest handler failed on intake evidence")

    async def _probe_loop(self) -> None:
        """Ask the broker for the telemetry consumer's state every PROBE_EVERY_S; each
        answer is evidence of a live intake, with the backlog (``num_pending``)."""
        route = next(r for r in self._routes if r.kind is StreamKind.TELEMETRY)
        while not self._stopping.is_set():
            try:
                info = await self._js.consumer_info(
                    route.stream, route.durable, timeout=PROBE_TIMEOUT_S
                )
            except (nats.errors.Error, TimeoutError, OSError) as exc:
                log.debug("probe of %s unanswered: %r", route.durable, exc)
            else:
                pending = info.num_pending
                if pending is not None:
                    self.metrics.set_lag(route.stream, pending)
                self._progress(self._clock(), pending, probe=True)
            await self._pause(PROBE_EVERY_S)

    @property
    def durables(self) -> dict[str, str]:
        """Stream name -> durable consumer name."""
        return {r.stream: r.durable for r in self._routes}

    def _consumer_config(self, route: _Route) -> ConsumerConfig:
        s = self.settings
        filters = filter_subjects(self._subjects, s, route.kind)
        config = ConsumerConfig(
            name=route.durable,
            durable_name=route.durable,
            deliver_policy=DeliverPolicy.ALL,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=s.ack_wait_s,
            max_ack_pending=s.max_ack_pending,
            description=f"metalguard ingest {s.region} {route.kind.value}",
        )
        if len(filters) == 1:
            config.filter_subject = filters[0]
        else:
            config.filter_subjects = filters
        return config

    # --- fetch loop -----------------------------------------------------------------------
    async def _fetch_loop(self, route: _Route) -> None:
        """Pull, route, repeat; the next pull is in flight while a batch is routed (the
        server delivers it meanwhile). Once stopping, a pull in flight is still routed."""
        pending: asyncio.Task[list[Msg]] | None = None
        try:
            while True:
                sub = route.sub
                if sub is None:
                    return
                if pending is None:
                    if self._stopping.is_set():
                        return
                    pending = self._pull(sub)
                route.fetching = True
                try:
                    msgs = await pending
                except TimeoutError:
                    # An empty pull.  nats-py raises its own TimeoutError, or, on a busy
                    # loop, the plain one (an OSError): neither is a failure to back off from.
                    continue
                except (nats.errors.Error, OSError) as exc:
                    await self._recover(route, exc)
                    continue
                finally:
                    route.fetching = False
                    pending = None
                if not self._stopping.is_set() and route.sub is sub:
                    pending = self._pull(sub)
                try:
                    await self._route_batch(route, msgs)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("ingest %s: a batch could not be routed", route.stream)
        finally:
            if pending is not None:  # cancelled while routing: that pull is given up
                pending.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await pending

    def _pull(self, sub: Puller) -> asyncio.Task[list[Msg]]:
        s = self.settings
        return asyncio.create_task(sub.fetch(s.fetch_batch, s.fetch_timeout_s), name="ingest-pull")

    async def _recover(self, route: _Route, exc: Exception) -> None:
        """After a failed fetch: wait, and re-create the consumer if it was deleted."""
        suppressed = self._fetch_log.allow(route.durable)
        if suppressed is not None:
            log.warning(
                "fetch from %s failed: %r (%d more since the last report)",
                route.durable,
                exc,
                suppressed,
            )
        await self._pause(self.settings.retry_delay_s)
        if self._stopping.is_set():
            return
        try:
            await self._js.consumer_info(route.stream, route.durable)
            return
        except NotFoundError:
            log.warning("consumer %s on %s is gone; re-creating it", route.durable, route.stream)
        except (nats.errors.Error, TimeoutError):
            return  # server unreachable or busy: fetch again later
        try:  # the puller's inbox outlives the consumer: only the consumer is re-made
            await self._js.add_consumer(route.stream, self._consumer_config(route))
        except (nats.errors.Error, TimeoutError) as err:
            log.warning("re-creating consumer %s failed: %r", route.durable, err)

    async def _pause(self, seconds: float) -> None:
        """Wait ``seconds``, or less when stop() is called."""
        await wait_event(self._stopping, seconds)

    async def _route_batch(self, route: _Route, msgs: list[Msg]) -> None:
        received = self._clock()
        dead: list[Awaitable[None]] = []
        if msgs:  # the last message's count of those behind it is the consumer's lag
            pending: int | None = None
            with contextlib.suppress(nats.errors.Error, ValueError, IndexError):
                pending = msgs[-1].metadata.num_pending
                self.metrics.set_lag(route.stream, pending)
            if route.kind is StreamKind.TELEMETRY:
                self._progress(received, pending)
        inline = 0
        for msg in msgs:
            verdict = self._classify(route, msg)
            if isinstance(verdict, _Bad):
                dead.append(self._dead_letter(route, msg, verdict))
            elif isinstance(verdict, _Skip):
                self.metrics.count(route.stream, "skipped")
                await _settle(msg.ack(), route)
            else:
                key, message = verdict
                item = _Item(route, msg, message, received)
                if (
                    self._batch_now is not None
                    and isinstance(message, TelemetryBatch)
                    and not self._dispatch.busy(key)
                ):
                    # Nothing of this node queued: start the handler here (no task switch);
                    # what needs I/O goes to its lane, ahead of its later messages.
                    item = await self._serve_now(item, self._batch_now)
                    inline += 1
                    if inline % INLINE_YIELD_EVERY == 0:
                        await asyncio.sleep(0)  # let the workers and the I/O run
                    if item.rest is None:
                        continue
                if self._dispatch.is_full(key):
                    self.metrics.count(route.stream, "backpressure_waits")
                await self._dispatch.put(key, item)
        if dead:
            for result in await asyncio.gather(*dead, return_exceptions=True):
                if isinstance(result, Exception):
                    log.error("ingest %s: dead-lettering failed", route.stream, exc_info=result)

    def _classify(
        self, route: _Route, msg: Msg
    ) -> tuple[str, TelemetryBatch | NodeEvent] | _Bad | _Skip:
        """(node key, message), or why it is undecodable, or another shard's."""
        parsed = self._parsed.get(msg.subject)
        if parsed is None:
            try:
                parsed = self._subjects.parse(msg.subject)
            except SubjectError as exc:
                return self._unowned_bad(f"bad subject: {exc}")
            if len(self._parsed) >= PARSED_SUBJECTS_KEPT:
                self._parsed.clear()
            self._parsed[msg.subject] = parsed
        expected: type[TelemetryBatch] | type[NodeEvent]
        if route.kind is StreamKind.TELEMETRY and isinstance(parsed, TelemetrySubject):
            expected = TelemetryBatch
        elif route.kind is StreamKind.EVENTS and isinstance(parsed, NodeEventSubject):
            expected = NodeEvent
        else:
            return self._unowned_bad(f"subject {msg.subject!r} is not a {route.kind.value} subject")
        key = node_handle(parsed.region, parsed.cluster, parsed.node)
        shard = self.settings.shard
        if shard is not None and shard_of(key, shard[1]) != shard[0]:
            return _SKIP
        try:
            if expected is TelemetryBatch:
                message: TelemetryBatch | NodeEvent = self._batches.decode(key, msg.data)
            else:
                message = decode(msg.data, expected)
        except CodecError as exc:
            return _Bad(key, exc.reason)
        n = message.node
        if (n.region, n.cluster, n.node) != (parsed.region, parsed.cluster, parsed.node):
            return _Bad(key, f"payload is from {n.handle}")
        return key, message

    def _unowned_bad(self, reason: str) -> _Bad | _Skip:
        """A message with no node: the shard with index 0 dead-letters it."""
        shard = self.settings.shard
        return _SKIP if shard is not None and shard[0] != 0 else _Bad(UNKNOWN_SENDER, reason)

    async def _dead_letter(self, route: _Route, msg: Msg, bad: _Bad) -> None:
        suppressed = self._decode_log.allow(bad.sender)
        if suppressed is not None:
            log.warning(
                "undecodable message from %s on %s: %s%s",
                bad.sender,
                msg.subject,
                bad.reason,
                f" ({suppressed} more from this sender since the last report)"
                if suppressed
                else "",
            )
        reason = " ".join(bad.reason.split())[:_MAX_REASON]
        try:
            seq = str(msg.metadata.sequence.stream)
        except (nats.errors.Error, ValueError, IndexError):
            seq = ""
        headers = {
            HDR_SUBJECT: msg.subject,
            HDR_STREAM: route.stream,
            HDR_SEQ: seq,
            HDR_SENDER: bad.sender,
            HDR_REASON: reason,
        }
        if seq:
            headers["Nats-Msg-Id"] = f"{route.stream}-{seq}"
        # The server's limit (its INFO; 1 MiB, NATS's default, before one was heard).
        max_payload = context_parts(self._js)[0].max_payload or 1024 * 1024
        data = dead_letter_payload(msg.data, headers, max_payload)
        try:
            await self._js.publish(self._subjects.dead_letter(route.stream), data, headers=headers)
        except (nats.errors.Error, TimeoutError, OSError) as exc:
            self.metrics.count(route.stream, "dead_letter_failures")
            log.warning("dead-lettering %s failed: %s", msg.subject, exc)
            await _settle(msg.nak(delay=self.settings.retry_delay_s), route)
            return
        self.metrics.count(route.stream, "decode_errors")
        await _settle(msg.ack(), route)

    # --- per-node worker ------------------------------------------------------------------
    async def _serve(self, item: _Item) -> None:
        message = item.message
        started = time.perf_counter()
        try:
            if item.rest is not None:
                await item.rest()
            elif isinstance(message, TelemetryBatch):
                await self._handler.on_batch(message, item.received_ts)
            else:
                await self._handler.on_node_event(message, item.received_ts)
        except Exception:
            await self._failed(item)
            return
        await self._done(item, started)

    async def _serve_now(self, item: _Item, batch_now: BatchNow) -> _Item:
        """Call the handler's synchronous part on a batch; settle the message when that
        was all. The item with what is left to await, if anything."""
        started = time.perf_counter()
        assert isinstance(item.message, TelemetryBatch)
        try:
            rest = batch_now(item.message, item.received_ts)
        except Exception:
            await self._failed(item)
            return item
        if rest is not None:
            return dataclasses.replace(item, rest=rest)
        await self._done(item, started)
        return item

    async def _done(self, item: _Item, started: float) -> None:
        route = item.route
        self.metrics.observe_latency(route.stream, time.perf_counter() - started)
        self.metrics.count(route.stream, "ingested")
        await _settle(item.msg.ack(), route)

    async def _failed(self, item: _Item) -> None:
        """The handler raised: count, log (rate-limited), nak for a later redelivery."""
        route, msg = item.route, item.msg
        self.metrics.count(route.stream, "handler_errors")
        sender = item.message.node.handle
        suppressed = self._handler_log.allow(sender)
        if suppressed is not None:
            log.exception(
                "ingest handler failed on %s (%d similar suppressed); redelivery in %.1fs",
                msg.subject,
                suppressed,
                self.settings.retry_delay_s,
            )
        await _settle(msg.nak(delay=self.settings.retry_delay_s), route)


async def _settle(ack: Awaitable[None], route: _Route) -> None:
    """Send an ack or nak; a failure is logged (JetStream redelivers after ack_wait)."""
    try:
        await ack
    except (nats.errors.Error, OSError) as exc:
        log.warning("ack on %s failed: %s", route.durable, exc)


def _report_loop_end(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("ingest fetch loop %s died", task.get_name(), exc_info=task.exception())
