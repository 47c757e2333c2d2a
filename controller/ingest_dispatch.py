"""Per-node lanes: a node's items are served in order, different nodes in parallel.

Each node with work has a bounded queue and one worker task; a worker retires as soon
as its queue is empty and nobody waits to put, so idle nodes cost nothing.  ``put``
waits while the node's queue is full: that wait is the backpressure on the fetch loop.
A semaphore bounds how many nodes are handled at the same moment.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(eq=False)
class _Lane(Generic[T]):
    queue: asyncio.Queue[T]
    task: asyncio.Task[None] | None = None
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
        self._slots = asyncio.Semaphore(max_concurrent)
        self._name = name
        self._lanes: dict[str, _Lane[T]] = {}

    @property
    def active(self) -> int:
        """Keys with a live worker."""
        return len(self._lanes)

    def is_full(self, key: str) -> bool:
        """Whether a ``put`` for ``key`` would wait now."""
        lane = self._lanes.get(key)
        return lane is not None and lane.queue.full()

    async def put(self, key: str, item: T) -> None:
        """Queue ``item`` behind ``key``'s earlier items; waits while that queue is full."""
        lane = self._lanes.get(key)
        if lane is None:
            lane = _Lane(asyncio.Queue(self._queue_size))
            self._lanes[key] = lane
            lane.task = asyncio.create_task(self._work(key, lane), name=f"{self._name}:{key}")
            lane.task.add_done_callback(_report_crash)
        lane.waiting_puts += 1
        try:
            await lane.queue.put(item)
        finally:
            lane.waiting_puts -= 1

    async def _work(self, key: str, lane: _Lane[T]) -> None:
        try:
            while lane.waiting_puts or not lane.queue.empty():
                item = await lane.queue.get()
                async with self._slots:
                    try:
                        await self._serve(item)
                    except Exception:  # serve is meant to catch; never lose the lane
                        log.exception("%s: serving an item of %s failed", self._name, key)
        finally:
            # No await between the emptiness check and this removal: a later put
            # finds no lane and starts a fresh one.
            if self._lanes.get(key) is lane:
                del self._lanes[key]

    async def drain(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for every worker to finish; cancel the rest.

        Returns how many workers had to be cancelled (their items stay unacknowledged
        and are redelivered by JetStream).
        """
        tasks = [lane.task for lane in self._lanes.values() if lane.task is not None]
        if not tasks:
            return 0
        _, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        return len(pending)


def _report_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("worker %s died", task.get_name(), exc_info=task.exception())
