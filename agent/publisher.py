"""Publishes telemetry batches and node events to JetStream without losing any.

Every message is, at any moment, in exactly one of three places: the in-memory queue,
the on-disk spool (:mod:`agent.spool`), or the stream (acknowledged by a PubAck).  One
sender task moves messages along, oldest first:

* connected and the spool empty: publish the head of the memory queue, pop it on ack;
* any failure (not connected, timeout, no stream, interrupted): spill the memory queue,
  in order, to the spool tail, and retry after a full-jitter backoff;
* while the spool is not empty, new messages are spilled behind it and the spool is
  replayed in order, each entry removed only after its ack.

A message id (``Nats-Msg-Id``) makes every retry idempotent within the stream's
duplicate window: ``region.cluster.node:seq`` for a batch, ``...:event_id`` for an event.
``publish_batch``/``publish_event`` only append to memory, so the collection loop never
waits on the network or the disk.  See docs/publisher.md.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js.api import PubAck

from metalguard.agent.backoff import Backoff, Sleep, guarded_task
from metalguard.agent.config import NatsSection
from metalguard.agent.connection import ClientFactory, Connection, NatsSettings
from metalguard.agent.spool import Spool, SpoolEntry
from metalguard.proto.codec import encode
from metalguard.proto.events import NodeEvent
from metalguard.proto.subjects import DEFAULT_SUBJECTS, SubjectError, Subjects
from metalguard.proto.telemetry import TelemetryBatch
from metalguard.runtime.deadlines import within

log = logging.getLogger(__name__)

_BAD_REQUEST = 400
"""JetStream's code for a request that will fail the same way every time."""

Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class PublisherSettings(NatsSettings):
    """The connection settings plus queueing: how long to wait, how much to hold."""

    publish_timeout_s: float = 5.0
    """How long to wait for one PubAck."""
    queue_max: int = 1000
    """Messages held in memory; beyond that the queue is spilled to the spool."""
    replay_batch: int = 64
    """Spool entries read per replay step."""


@dataclass(frozen=True, slots=True)
class PublisherStats:
    """Counters for the agent's status line (all since this Publisher started)."""

    connected: bool
    published: int
    """Messages acknowledged straight from memory."""
    replayed: int
    """Messages acknowledged from the spool."""
    spooled: int
    """Messages written to the spool."""
    dropped: int
    """Messages lost: evicted from the full spool, corrupt on disk, or unwritable."""
    rejected: int
    """Messages that can never be published (bad subject token, too large, refused by
    the server as a bad request); logged and discarded."""
    duplicates: int
    """PubAcks that said the stream already had the message id."""
    queued: int
    spool_entries: int
    spool_bytes: int


class _Outcome(enum.Enum):
    ACKED = "acked"
    REJECTED = "rejected"  # permanent: discard
    FAILED = "failed"  # transient: keep and retry later
    INTERRUPTED = "interrupted"  # cancelled by overflow, disconnect or the close deadline


def batch_msg_id(batch: TelemetryBatch) -> str:
    """The JetStream message id of a telemetry batch."""
    return f"{batch.node.handle}:{batch.seq}"


def event_msg_id(event: NodeEvent) -> str:
    """The JetStream message id of a node event."""
    return f"{event.node.handle}:{event.event_id}"


def publisher_settings(nats: NatsSection, name: str) -> PublisherSettings:
    """The publisher settings of an agent's ``[nats]`` section, for a client ``name``."""
    return PublisherSettings(
        servers=list(nats.servers),
        name=name,
        credentials=nats.credentials or None,
        nkey_seed=nats.nkey_seed or None,
        tls_ca=nats.tls_ca or None,
        tls_cert=nats.tls_cert or None,
        tls_key=nats.tls_key or None,
        inbox_prefix=nats.inbox_prefix or None,
        connect_timeout_s=nats.connect_timeout_s,
        publish_timeout_s=nats.publish_timeout_s,
        reconnect_base_s=nats.reconnect_base_s,
        reconnect_max_s=nats.reconnect_max_s,
    )


class Publisher:
    """Ordered, at-least-once (exactly-once in the stream) publishing with a disk spool."""

    def __init__(
        self,
        settings: PublisherSettings,
        *,
        spool: Spool,
        subjects: Subjects = DEFAULT_SUBJECTS,
        rng: random.Random | None = None,
        sleep: Sleep = asyncio.sleep,
        clock: Clock = time.monotonic,
        client_factory: ClientFactory = Client,
    ) -> None:
        """Take ownership of ``spool`` (closed by :meth:`close`); connect on :meth:`start`.

        ``rng``, ``sleep`` and ``clock`` drive the jittered backoffs (for tests).
        """
        self.settings = settings
        self.spool = spool
        self.subjects = subjects
        rng = rng or random.Random()
        self._backoff = Backoff(settings.reconnect_base_s, settings.reconnect_max_s, rng)
        self._clock = clock
        self.connection = Connection(
            settings,
            backoff=Backoff(settings.reconnect_base_s, settings.reconnect_max_s, rng),
            sleep=sleep,
            client_factory=client_factory,
            on_state=self._on_connection_state,
        )
        self._pending: deque[SpoolEntry] = deque()
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._inflight: asyncio.Task[PubAck] | None = None
        self._inflight_from_memory = False
        self._sender: asyncio.Task[None] | None = None
        self._failures = 0
        self._retry_at = 0.0
        self._closing = False
        self._abort = False
        self._closed = False
        self._lost_seen = 0
        self._unreported = 0
        self._published = self._replayed = self._spooled = 0
        self._dropped = self._rejected = self._duplicates = 0

    # --- lifecycle ----------------------------------------------------------------------
    async def start(self) -> bool:
        """Start the sender and connect (one bounded attempt, then background retries).

        Returns whether the first attempt connected; messages are accepted either way.
        """
        self._unreported += await asyncio.to_thread(self.spool.take_unreported_drops)
        self._note_spool_losses()
        self._update_idle()
        self._sender = guarded_task("publisher-sender", self._run, backoff=self._backoff)
        return await self.connection.start()

    async def close(self, flush_timeout: float = 5.0) -> None:
        """Publish what is queued within ``flush_timeout``, spool the rest, disconnect."""
        if self._closed:
            return
        self._closed = self._closing = True
        self._wakeup.set()
        sender = self._sender
        if sender is not None:
            try:
                await within(asyncio.shield(sender), flush_timeout)
            except TimeoutError:
                self._abort = True
                self._cancel_inflight()
                self._wakeup.set()
                await asyncio.gather(sender, return_exceptions=True)
        await self.connection.close()
        if self._pending:  # the sender never started, or died
            await self._spill()
        self._note_spool_losses()
        await asyncio.to_thread(self.spool.add_unreported_drops, self._unreported)
        self._unreported = 0
        self.spool.close()

    async def __aenter__(self) -> Publisher:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # --- producer API (never waits on the network or the disk) ----------------------------
    async def publish_batch(self, batch: TelemetryBatch) -> None:
        """Queue a telemetry batch for ``<p>.tel.<region>.<cluster>.<node>``."""
        self._queue_batch(batch, batch_msg_id(batch))

    def _queue_batch(self, batch: TelemetryBatch, msg_id: str) -> None:
        """Queue ``batch`` under ``msg_id`` (refused when its node makes no subject)."""
        n = batch.node
        try:
            subject = self.subjects.telemetry(n.region, n.cluster, n.node)
        except SubjectError as exc:
            self._refuse(msg_id, exc)
            return
        self._enqueue(SpoolEntry(subject, msg_id, encode(batch)))

    async def publish_event(self, event: NodeEvent) -> None:
        """Queue a node event for ``<p>.evt.<region>.<cluster>.<node>.<kind>``."""
        n = event.node
        try:
            subject = self.subjects.node_event(n.region, n.cluster, n.node, event.kind)
        except SubjectError as exc:
            self._refuse(event_msg_id(event), exc)
            return
        self._enqueue(SpoolEntry(subject, event_msg_id(event), encode(event)))

    def _refuse(self, msg_id: str, exc: Exception) -> None:
        """A message that can never be published: counted and logged, not raised."""
        self._rejected += 1
        log.error("not publishing %s: %s", msg_id, exc)

    def take_dropped(self) -> int:
        """Messages lost since the last call (for the next batch's ``spool_dropped``)."""
        self._note_spool_losses()
        count, self._unreported = self._unreported, 0
        return count

    def stats(self) -> PublisherStats:
        """A snapshot of the counters."""
        self._note_spool_losses()
        return PublisherStats(
            connected=self.connection.connected.is_set(),
            published=self._published,
            replayed=self._replayed,
            spooled=self._spooled,
            dropped=self._dropped,
            rejected=self._rejected,
            duplicates=self._duplicates,
            queued=len(self._pending),
            spool_entries=len(self.spool),
            spool_bytes=self.spool.size_bytes,
        )

    async def wait_idle(self) -> None:
        """Return once nothing is queued, in flight or spooled (wrap in a timeout)."""
        await self._idle.wait()

    def _enqueue(self, entry: SpoolEntry) -> None:
        if self._closed:
            raise RuntimeError("publisher is closed")
        self._pending.append(entry)
        self._idle.clear()
        if len(self._pending) > self.settings.queue_max and self._inflight_from_memory:
            self._cancel_inflight()  # spill now rather than after the ack timeout
        self._wakeup.set()

    # --- the sender ---------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            self._wakeup.clear()
            self._update_idle()
            if self._closing and (self._abort or not self._healthy() or not self._pending):
                await self._spill()
                return
            if not self._pending and not len(self.spool):
                await self._wakeup.wait()
            elif not self.connection.connected.is_set():
                await self._spill()
                await self._wakeup.wait()  # set by new messages, a connect, close()
            elif len(self.spool) or len(self._pending) > self.settings.queue_max:
                await self._spill()
                if len(self.spool) and not self._closing and await self._wait_retry():
                    await self._replay()
            elif await self._wait_retry():
                await self._send_head()

    async def _send_head(self) -> None:
        entry = self._pending[0]
        outcome = await self._send(entry, from_memory=True)
        if outcome in (_Outcome.ACKED, _Outcome.REJECTED):
            if self._pending and self._pending[0] is entry:
                self._pending.popleft()
            if outcome is _Outcome.ACKED:
                self._published += 1
        else:
            await self._spill()

    async def _replay(self) -> None:
        """Publish spool entries in order until the spool is empty or a send fails."""
        while len(self.spool) and not self._closing:
            stored = await asyncio.to_thread(self.spool.peek, self.settings.replay_batch)
            self._note_spool_losses()
            for item in stored:
                if self._pending:
                    await self._spill()  # newer than every spooled entry: goes behind them
                outcome = await self._send(item.entry, from_memory=False)
                if outcome not in (_Outcome.ACKED, _Outcome.REJECTED):
                    return
                await asyncio.to_thread(self.spool.ack, item.index)
                if outcome is _Outcome.ACKED:
                    self._replayed += 1
                if self._closing:
                    return

    async def _send(self, entry: SpoolEntry, *, from_memory: bool) -> _Outcome:
        js = self.connection.js
        if js is None or not self.connection.connected.is_set():
            return self._failed(entry, "not connected")
        task = asyncio.create_task(
            js.publish(
                entry.subject,
                entry.payload,
                timeout=self.settings.publish_timeout_s,
                headers={"Nats-Msg-Id": entry.msg_id},
            )
        )
        self._inflight, self._inflight_from_memory = task, from_memory
        try:
            await asyncio.wait({task})
        finally:
            self._inflight, self._inflight_from_memory = None, False
            if not task.done():
                task.cancel()
        if task.cancelled():
            return self._failed(entry, "interrupted", _Outcome.INTERRUPTED)
        exc = task.exception()
        if exc is None:
            self._failures = 0
            if task.result().duplicate is True:
                self._duplicates += 1
                log.debug("publish %s: already in the stream", entry.msg_id)
            return _Outcome.ACKED
        if _is_permanent(exc):
            self._rejected += 1
            log.error("publish %s to %s rejected: %s", entry.msg_id, entry.subject, exc)
            return _Outcome.REJECTED
        return self._failed(entry, f"{type(exc).__name__}: {exc}")

    def _failed(self, entry: SpoolEntry, why: str, outcome: _Outcome = _Outcome.FAILED) -> _Outcome:
        if outcome is _Outcome.FAILED:
            delay = self._backoff.delay(self._failures)
            self._failures += 1
            self._retry_at = self._clock() + delay
            log.warning("publish %s failed (%s); retry in %.2fs", entry.msg_id, why, delay)
        else:
            log.info("publish %s %s; spooling", entry.msg_id, why)
        return outcome

    async def _wait_retry(self) -> bool:
        """Wait out the retry backoff; False if woken early (re-check the state)."""
        remaining = self._retry_at - self._clock()
        if remaining <= 0:
            return True
        try:
            await within(self._wakeup.wait(), remaining)
        except TimeoutError:
            return True
        return False

    async def _spill(self) -> None:
        """Move the whole memory queue, in order, to the spool tail."""
        if not self._pending:
            return
        entries = list(self._pending)
        try:
            dropped = await asyncio.to_thread(self.spool.append_many, entries)
        except OSError as exc:
            log.error("spool write failed, %d messages lost: %s", len(entries), exc)
            self._dropped += len(entries)
            self._unreported += len(entries)
        else:
            self._spooled += len(entries)
            if dropped:
                log.warning("spool full: dropped the %d oldest messages", dropped)
        for _ in entries:  # new messages may have arrived during the write
            self._pending.popleft()
        self._note_spool_losses()

    # --- helpers ------------------------------------------------------------------------
    def _healthy(self) -> bool:
        return self.connection.connected.is_set() and not len(self.spool)

    def _cancel_inflight(self) -> None:
        if self._inflight is not None and not self._inflight.done():
            self._inflight.cancel()

    def _on_connection_state(self, connected: bool) -> None:
        if connected:
            self._failures, self._retry_at = 0, 0.0
        else:
            self._cancel_inflight()  # its reply cannot come on this connection
        self._wakeup.set()

    def _note_spool_losses(self) -> None:
        lost = self.spool.lost_total
        if lost > self._lost_seen:
            self._dropped += lost - self._lost_seen
            self._unreported += lost - self._lost_seen
            self._lost_seen = lost

    def _update_idle(self) -> None:
        if not self._pending and not len(self.spool) and self._inflight is None:
            self._idle.set()
        else:
            self._idle.clear()


def _is_permanent(exc: BaseException) -> bool:
    """Errors that no retry can fix; everything else is retried."""
    if isinstance(exc, nats.errors.MaxPayloadError | nats.errors.BadSubjectError):
        return True
    return isinstance(exc, nats.js.errors.APIError) and exc.code == _BAD_REQUEST
