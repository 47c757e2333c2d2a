"""Which nodes' silence may be due: a silence check looks at those, not at every node.

A node is watched with the time its silence can first reach its limit
(:func:`controller.core.lifecycle.silence_due_ts`). A steady node's batches move that
time later without telling the watch (they only move its liveness): when the old time
comes, the check finds the node heard since and watches it again at its new time. So a
tick costs the nodes that fall due, about ``nodes / silence limit`` a second, not a walk
over every node (measured: the walk took most of a 25,000-node shard's CPU,
docs/scaling.md).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Mapping

from metalguard.proto.nodes import NodeRecord

RECHECK_S = 1.0
"""A node looked at and found still silent but not decided (its silence stalled, its
round failed) is looked at again after this long."""


class SilenceWatch:
    """Handles by the time their silence may be due (a heap; an entry superseded by a
    later :meth:`watch` of the same handle is skipped when it comes up)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, str]] = []
        self._due: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._due)

    def __contains__(self, handle: object) -> bool:
        return handle in self._due

    def watch(self, handle: str, due_ts: float) -> None:
        """Look at ``handle`` once ``due_ts`` has come (replacing its earlier time)."""
        if self._due.get(handle) == due_ts:
            return
        self._due[handle] = due_ts
        heapq.heappush(self._heap, (due_ts, handle))
        if len(self._heap) > 2 * len(self._due) + 64:
            self._compact()

    def rewatch(
        self,
        handles: Iterable[str],
        records: Mapping[str, NodeRecord],
        due_of: Callable[[NodeRecord], float | None],
        now: float | None = None,
    ) -> None:
        """Watch each of ``handles`` at ``due_of`` its record (with ``now``, the time of
        a check that just looked at them: not before ``now`` + :data:`RECHECK_S`); forget
        those with no record or no time."""
        for handle in handles:
            record = records.get(handle)
            due = None if record is None else due_of(record)
            if due is None:
                self.forget(handle)
            else:
                self.watch(handle, due if now is None else max(due, now + RECHECK_S))

    def forget(self, handle: str) -> None:
        """Stop watching ``handle`` (its entry is skipped when it comes up)."""
        self._due.pop(handle, None)

    def pop_due(self, now: float) -> list[str]:
        """The handles due at ``now``, earliest first, no longer watched."""
        due: list[str] = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            ts, handle = heapq.heappop(heap)
            if self._due.get(handle) == ts:
                del self._due[handle]
                due.append(handle)
        return due

    def _compact(self) -> None:
        """Drop superseded entries (many re-watches between two ticks)."""
        self._heap = [(ts, h) for h, ts in self._due.items()]
        heapq.heapify(self._heap)
