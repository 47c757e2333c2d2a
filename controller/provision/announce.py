"""Announcing the provisioning events on ``<p>.ctl.<region>.<kind>`` (``instance.*``,
``node.provision_flagged``; docs/events.md): each with its deterministic id as the
message id, so a repeat inside the stream's duplicate window is dropped; one that cannot
be published waits, with the ones after it, for the next pass (in memory: a controller
that dies meanwhile does not announce it)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

from nats.errors import Error as NatsError
from nats.js import JetStreamContext

from metalguard.controller.provision.machine import Emit
from metalguard.proto.base import NodeIdentity
from metalguard.proto.codec import encode
from metalguard.proto.events import ControllerEvent
from metalguard.proto.subjects import Subjects

log = logging.getLogger(__name__)


def controller_event(e: Emit, region: str, now: float) -> ControllerEvent:
    """The ControllerEvent of an :class:`Emit` (its node, when it names one)."""
    node = None
    parts = e.node.split(".")
    if len(parts) == 3 and all(parts):
        node = NodeIdentity(region=parts[0], cluster=parts[1], node=parts[2])
    return ControllerEvent(
        event_id=e.event_id,
        ts=now,
        region=region,
        kind=e.kind,
        node=node,
        message=e.message,
        attributes=e.attributes,
    )


class Announcer:
    """Publishes the service's events in order."""

    def __init__(
        self,
        js: JetStreamContext,
        subjects: Subjects,
        region: str,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._js = js
        self._subjects = subjects
        self._region = region
        self._clock = clock
        self.unsent: list[ControllerEvent] = []
        self._flushing = asyncio.Lock()
        """One flush at a time: concurrent requests would publish (and pop) one event twice."""

    async def announce(self, emits: Iterable[Emit]) -> None:
        """Publish ``emits`` (after whatever is still unsent)."""
        now = self._clock()
        self.unsent.extend(controller_event(e, self._region, now) for e in emits)
        await self.flush()

    async def flush(self) -> None:
        """Publish what is unsent, oldest first; stop at the first failure."""
        async with self._flushing:
            while self.unsent:
                event = self.unsent[0]
                try:
                    await self._js.publish(
                        self._subjects.control(self._region, event.kind),
                        encode(event),
                        headers={"Nats-Msg-Id": event.event_id},
                    )
                except NatsError as exc:
                    log.warning("event %s not published yet: %s", event.event_id, exc)
                    return
                self.unsent.pop(0)
