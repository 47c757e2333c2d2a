"""``GET /v1/events``: the region's ControllerEvents as Server-Sent Events (docs/api.md).

Each client gets its own JetStream ordered consumer on the ``<P>_CONTROL`` stream
(:class:`NatsEventSource`), starting at new events, at a point in the past (``since``), or
just after the last event it saw (``Last-Event-ID``: the stream sequence), and a bounded
queue; a client too slow to keep up loses events (counted in the log), never the
controller's memory.  The handler ends when the client goes away (a keep-alive comment
fails to write) or when the app shuts down (a ``None`` sentinel in every queue).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import math
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from aiohttp import web
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from metalguard.proto.codec import CodecError, decode, encode_json
from metalguard.proto.events import ControllerEvent
from metalguard.proto.subjects import ControlSubject, SubjectError, Subjects
from metalguard.runtime.deadlines import within

log = logging.getLogger(__name__)

Deliver = Callable[[ControllerEvent, int | None], None]
"""Called with each event and its stream sequence (None where the source has none)."""
Unsubscribe = Callable[[], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class StartAt:
    """Where a subscription starts: new events only, every kept event, after a stream
    sequence, or at a wall-clock time."""

    after_seq: int | None = None
    """Deliver the events after this stream sequence (``Last-Event-ID``)."""
    time: float | None = None
    """Deliver the events published at or after this Unix time."""
    everything: bool = False
    """Deliver every event the stream still keeps."""


NEW_ONLY = StartAt()

_DURATION = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(s|m|h|d)$", re.ASCII)
_SEQUENCE = re.compile(r"^[0-9]{1,20}$", re.ASCII)
MAX_SEQ = 2**63 - 1
"""The largest stream sequence taken (JetStream's are unsigned 64-bit; the next one is asked)."""
MAX_TIME = dt.datetime(9999, 12, 31, tzinfo=dt.UTC).timestamp()
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_since(text: str, now: float) -> StartAt:
    """``since``: ``all``, a duration back from ``now`` (``90s``, ``10m``, ``2h``, ``1d``),
    an RFC 3339 time (``2026-11-29T21:00:00Z``) or Unix seconds; ValueError otherwise."""
    text = text.strip()
    if text == "all":
        return StartAt(everything=True)
    if m := _DURATION.match(text):
        return _at(now - float(m.group(1)) * _UNIT_S[m.group(2)], text)
    if text.isascii():  # Unix seconds (float() would also take other scripts' digits)
        try:
            seconds = float(text)
        except ValueError:
            pass
        else:
            return _at(seconds, text)
    try:
        when = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(
            f"since: {text!r} is not 'all', a duration (90s, 10m, 2h, 1d), "
            "an RFC 3339 time or Unix seconds"
        ) from None
    if when.tzinfo is None:
        raise ValueError(f"since: {text!r} has no time zone (add Z or +00:00)")
    return _at(when.timestamp(), text)


def _at(ts: float, text: str) -> StartAt:
    """A start at Unix time ``ts``: before the epoch is from the start; not finite or
    past year 9999, ValueError."""
    if not math.isfinite(ts) or ts > MAX_TIME:
        raise ValueError(f"since: {text!r} is out of range")
    return StartAt(time=max(ts, 0.0))


def parse_last_event_id(text: str) -> StartAt:
    """The ``Last-Event-ID`` header: the stream sequence of the last event seen."""
    text = text.strip()
    if not _SEQUENCE.match(text) or int(text) > MAX_SEQ:
        raise ValueError(f"Last-Event-ID: {text!r} is not a stream sequence number")
    return StartAt(after_seq=int(text))


class EventSource(Protocol):
    """Where ControllerEvents come from: the past the source keeps, then as published."""

    async def subscribe(self, deliver: Deliver, start: StartAt = NEW_ONLY) -> Unsubscribe:
        """Call ``deliver`` for each event from ``start`` on until the returned function
        is awaited."""
        ...

    async def history(
        self, start: StartAt, limit: int
    ) -> tuple[list[tuple[ControllerEvent, int]], bool]:
        """Up to ``limit`` kept events from ``start`` on, and whether more were left."""
        ...


class NatsEventSource:
    """A region's ControllerEvents from the ``<P>_CONTROL`` stream (ordered consumer)."""

    def __init__(self, nc: Client, subjects: Subjects, region: str) -> None:
        self._js = nc.jetstream()
        self._subjects = subjects
        self._region = region

    async def subscribe(self, deliver: Deliver, start: StartAt = NEW_ONLY) -> Unsubscribe:
        """Create the consumer; events published after this returns are delivered."""

        async def on_msg(msg: Msg) -> None:
            try:
                parsed = self._subjects.parse(msg.subject)
                if not isinstance(parsed, ControlSubject) or parsed.region != self._region:
                    return
                event = decode(msg.data, ControllerEvent)
            except (SubjectError, CodecError) as exc:
                log.warning("events: ignoring %s: %s", msg.subject, exc)
                return
            deliver(event, msg.metadata.sequence.stream)

        sub = await self._js.subscribe(
            self._subjects.control_all(self._region),
            stream=self._subjects.stream_control,
            cb=on_msg,
            ordered_consumer=True,
            config=consumer_config(start),
        )
        return sub.unsubscribe

    async def history(
        self, start: StartAt, limit: int
    ) -> tuple[list[tuple[ControllerEvent, int]], bool]:
        """Up to ``limit`` kept events from ``start`` on (oldest first), with their stream
        sequences, and whether more were left."""
        config = consumer_config(start)
        config.ack_policy = AckPolicy.NONE
        config.inactive_threshold = HISTORY_CONSUMER_TTL_S
        sub = await self._js.pull_subscribe(
            self._subjects.control_all(self._region),
            stream=self._subjects.stream_control,
            config=config,
        )
        out: list[tuple[ControllerEvent, int]] = []
        try:
            pending = (await sub.consumer_info()).num_pending or 0
            while pending and len(out) < limit:
                want = min(pending, HISTORY_FETCH, limit - len(out))
                for msg in await sub.fetch(want, timeout=5):
                    pending = msg.metadata.num_pending or 0
                    try:
                        event = decode(msg.data, ControllerEvent)
                    except CodecError as exc:
                        log.warning("events: ignoring %s: %s", msg.subject, exc)
                        continue
                    if event.region == self._region:
                        out.append((event, msg.metadata.sequence.stream))
        finally:
            with contextlib.suppress(NatsError):
                await sub.unsubscribe()
        return out, pending > 0


HISTORY_FETCH = 256
HISTORY_CONSUMER_TTL_S = 30.0
"""A history consumer left behind (controller killed mid-request) is removed after this."""


def consumer_config(start: StartAt) -> ConsumerConfig:
    """The consumer settings that start delivery at ``start``."""
    if start.everything:
        return ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
    if start.after_seq is not None:
        return ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start.after_seq + 1
        )
    if start.time is not None:
        return ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_TIME,
            opt_start_time=dt.datetime.fromtimestamp(start.time, dt.UTC),
        )
    return ConsumerConfig(deliver_policy=DeliverPolicy.NEW)


class EventFilter:
    """``kind`` (exact, or a prefix ending in ``.``) and ``node`` (handle or bare name)."""

    def __init__(self, kind: str = "", node: str = "") -> None:
        self.kind = kind
        self.node = node

    def __call__(self, event: ControllerEvent) -> bool:
        if self.kind:
            if self.kind.endswith("."):
                if not event.kind.startswith(self.kind):
                    return False
            elif event.kind != self.kind:
                return False
        if self.node:
            n = event.node
            if n is None:
                return False
            if self.node not in (n.handle, n.node):
                return False
        return True


def sse_event(event: ControllerEvent, seq: int | None = None) -> bytes:
    """One SSE message: ``id`` (the stream sequence, else the event id), ``event: <kind>``
    and the event as one JSON line."""
    ident = event.event_id if seq is None else str(seq)
    return f"id: {ident}\nevent: {event.kind}\ndata: ".encode() + encode_json(event) + b"\n\n"


_Item = tuple[ControllerEvent, int | None]


class SseHub:
    """The open SSE streams of one app: their queues, ended together at shutdown."""

    def __init__(self, source: EventSource, keepalive_s: float, queue_size: int) -> None:
        self.source = source
        self.keepalive_s = keepalive_s
        self.queue_size = queue_size
        self._queues: set[asyncio.Queue[_Item | None]] = set()
        self.closing = False

    @property
    def open_streams(self) -> int:
        """How many clients are being served."""
        return len(self._queues)

    async def close(self) -> None:
        """End every open stream (app shutdown)."""
        self.closing = True
        for queue in self._queues:
            _offer(queue, None)

    async def stream(
        self, request: web.Request, keep: EventFilter, start: StartAt = NEW_ONLY
    ) -> web.StreamResponse:
        """Serve one client, from ``start``, until it goes away or the app shuts down."""
        queue: asyncio.Queue[_Item | None] = asyncio.Queue(self.queue_size)
        dropped = 0

        def deliver(event: ControllerEvent, seq: int | None) -> None:
            nonlocal dropped
            if keep(event) and not _offer(queue, (event, seq)):
                dropped += 1

        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            }
        )
        unsubscribe = await self.source.subscribe(deliver, start)
        self._queues.add(queue)
        try:
            await response.prepare(request)
            await response.write(b": subscribed\n\n")
            while not self.closing:
                try:
                    item = await within(queue.get(), self.keepalive_s)
                except TimeoutError:
                    await response.write(b": keep-alive\n\n")
                    continue
                if item is None:
                    break
                await response.write(sse_event(*item))
        except ConnectionResetError:
            log.debug("events: client %s went away", request.remote)
        finally:
            self._queues.discard(queue)
            with contextlib.suppress(NatsError):
                await unsubscribe()
            if dropped:
                log.warning("events: %d events dropped for slow client %s", dropped, request.remote)
        return response


def _offer(queue: asyncio.Queue[_Item | None], item: _Item | None) -> bool:
    try:
        queue.put_nowait(item)
    except asyncio.QueueFull:
        return False
    return True
