"""Per-node lanes: a node's items are served in order, different nodes in parallel.

A fixed pool of ``max_concurrent`` worker tasks serves the lanes: a lane with items is
either waiting in the ready queue or held by exactly one worker, so a node's items never
run concurrently or out of order, and no task is created per message.  A worker serves
one item of a lane, then puts the lane back at the end of the ready queue if it has more
(nodes take turns); an emptied lane is forgotten, so idle nodes cost nothing.  ``put``
waits while the node's lane holds ``queue_size`` items: that wait is the backpressure on
the fetch loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from metalguard.controller.stopping import cancel_within
from metalguard.runtime.deadlines import wait_event

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(eq=False)
class _Lane(Generic[T]):
    items: deque[T] = field(default_factory=deque)
    held: bool = False
    """In the ready queue or being served (then a worker will look at it again)."""
    space: asyncio.Event | None = None
    """Set when an item is taken; made by the first put that has to wait."""
    waiting_puts: int = 0


class NodeDispatcher(Generic[T]):
    """Runs ``serve(item)`` for each put item: in order per key, keys in parallel."""

    def __init__(
        self,
        serve: Callable[[T], Awaitable[None]],
        *,
        queue_size: int,
        max_concurrent: int,
        name: str = "ingest",
    ) -> None:
        self._serve = serve
        self._queue_size = queue_size
        self._pool_size = max_concurrent
        self._name = name
        self._lanes: dict[str, _Lane[T]] = {}
        self._ready: asyncio.Queue[str] = asyncio.Queue()
        self._workers: list[asyncio.Task[None]] = []
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def active(self) -> int:
        """Keys with work queued or being served."""
        return len(self._lanes)

    def busy(self, key: str) -> bool:
        """Whether ``key`` has items queued or being served (its next item must wait)."""
        return key in self._lanes

    def is_full(self, key: str) -> bool:
        """Whether a ``put`` for ``key`` would wait now."""
        lane = self._lanes.get(key)
        return lane is not None and len(lane.items) >= self._queue_size

    async def put(self, key: str, item: T) -> None:
        """Queue ``item`` behind ``key``'s earlier items; waits while that lane is full."""
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = _Lane()
            self._idle.clear()
        while len(lane.items) >= self._queue_size:
            if lane.space is None:
                lane.space = asyncio.Event()
            lane.space.clear()
            lane.waiting_puts += 1
            try:
                await lane.space.wait()
            finally:
                lane.waiting_puts -= 1
        lane.items.append(item)
        if not lane.held:
            lane.held = True
            self._ready.put_nowait(key)
        if not self._workers:
            self._workers = [
                asyncio.create_task(self._work(), name=f"{self._name}:worker{i}")
                for i in range(self._pool_size)
            ]

    async def _work(self) -> None:
        while True:
            key = await self._ready.get()
            lane = self._lanes[key]
            item = lane.items.popleft()
            if lane.space is not None:
                lane.space.set()
            try:
                await self._serve(item)
            except asyncio.CancelledError:
                raise
            except Exception:  # serve is meant to catch; never lose the lane
                log.exception("%s: serving an item of %s failed", self._name, key)
            if lane.items:
                self._ready.put_nowait(key)  # back of the line: nodes take turns
            elif lane.waiting_puts:
                lane.held = False  # a put is about to add; it schedules the lane again
            else:
                del self._lanes[key]
                if not self._lanes:
                    self._idle.set()

    async def drain(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for every lane to empty, then stop the workers.

        Returns how many nodes still had work (their items stay unacknowledged and are
        redelivered by JetStream).
        """
        await wait_event(self._idle, timeout_s)
        left = len(self._lanes)
        workers, self._workers = self._workers, []
        await cancel_within(workers, timeout_s, "ingest drain")
        self._lanes.clear()
        self._ready = asyncio.Queue()
        self._idle.set()
        return left
