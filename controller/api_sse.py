"""``GET /v1/events``: the region's ControllerEvents as Server-Sent Events (docs/api.md).

Each client gets its own core-NATS subscription (:class:`NatsEventSource`) and a bounded
queue; a client too slow to keep up loses events (counted in the log), never the
controller's memory.  The handler ends when the client goes away (a keep-alive comment
fails to write) or when the app shuts down (a ``None`` sentinel in every queue).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from aiohttp import web
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError

from proto.codec import CodecError, decode, encode_json
from proto.events import ControllerEvent
from proto.subjects import ControlSubject, SubjectError, Subjects

log = logging.getLogger(__name__)

Deliver = Callable[[ControllerEvent], None]
Unsubscribe = Callable[[], Awaitable[None]]


class EventSource(Protocol):
    """Where ControllerEvents come from as they are published."""

    async def subscribe(self, deliver: Deliver) -> Unsubscribe:
        """Call ``deliver`` for each new event until the returned function is awaited."""
        ...


class NatsEventSource:
    """A region's ControllerEvents from core NATS (``<p>.ctl.>``, filtered to the region)."""

    def __init__(self, nc: Client, subjects: Subjects, region: str) -> None:
        self._nc = nc
        self._subjects = subjects
        self._region = region

    async def subscribe(self, deliver: Deliver) -> Unsubscribe:
        """Subscribe; the subscription is known to the server when this returns."""

        async def on_msg(msg: Msg) -> None:
            try:
                parsed = self._subjects.parse(msg.subject)
                if not isinstance(parsed, ControlSubject) or parsed.region != self._region:
                    return
                event = decode(msg.data, ControllerEvent)
            except (SubjectError, CodecError) as exc:
                log.warning("events: ignoring %s: %s", msg.subject, exc)
                return
            deliver(event)

        # the builder has no multi-token wildcard for one region: all_of + filter above
        sub = await self._nc.subscribe(self._subjects.all_of("ctl"), cb=on_msg)
        await self._nc.flush()
        return sub.unsubscribe


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
            handle = f"{n.region}.{n.cluster}.{n.node}"
            if self.node not in (handle, n.node):
                return False
        return True


def sse_event(event: ControllerEvent) -> bytes:
    """One SSE message: ``id``, ``event: <kind>`` and the event as one JSON line."""
    return (
        f"id: {event.event_id}\nevent: {event.kind}\ndata: ".encode() + encode_json(event) + b"\n\n"
    )


class SseHub:
    """The open SSE streams of one app: their queues, ended together at shutdown."""

    def __init__(self, source: EventSource, keepalive_s: float, queue_size: int) -> None:
        self.source = source
        self.keepalive_s = keepalive_s
        self.queue_size = queue_size
        self._queues: set[asyncio.Queue[ControllerEvent | None]] = set()
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

    async def stream(self, request: web.Request, keep: EventFilter) -> web.StreamResponse:
        """Serve one client until it goes away or the app shuts down."""
        queue: asyncio.Queue[ControllerEvent | None] = asyncio.Queue(self.queue_size)
        dropped = 0

        def deliver(event: ControllerEvent) -> None:
            nonlocal dropped
            if keep(event) and not _offer(queue, event):
                dropped += 1

        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            }
        )
        unsubscribe = await self.source.subscribe(deliver)
        self._queues.add(queue)
        try:
            await response.prepare(request)
            await response.write(b": subscribed\n\n")
            while not self.closing:
                try:
                    event = await asyncio.wait_for(queue.get(), self.keepalive_s)
                except TimeoutError:
                    await response.write(b": keep-alive\n\n")
                    continue
                if event is None:
                    break
                await response.write(sse_event(event))
        except ConnectionResetError:
            log.debug("events: client %s went away", request.remote)
        finally:
            self._queues.discard(queue)
            with contextlib.suppress(NatsError):
                await unsubscribe()
            if dropped:
                log.warning("events: %d events dropped for slow client %s", dropped, request.remote)
        return response


def _offer(queue: asyncio.Queue[ControllerEvent | None], item: ControllerEvent | None) -> bool:
    try:
        queue.put_nowait(item)
    except asyncio.QueueFull:
        return False
    return True
