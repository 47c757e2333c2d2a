"""A cluster's queued inputs: decided and written together (group commit).

A batch or node event that must be decided waits on its cluster's lock. Whichever
waiter gets the lock first takes every input queued for the cluster by then (one per
node, :func:`take_group`) and decides them in one round: one outbox write, the records
and the rail written together, the events published together, where one round per node
awaited each of those round trips in turn (docs/controller.md, "Rounds"). The others
find their input settled when the lock comes to them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from metalguard.controller.core.decide import NodeInput

MAX_GROUP = 256
"""Inputs decided in one round at most (a cluster's worth of a mass failure)."""


class RoundFailedError(Exception):
    """The round that took this input failed; the input was not decided (its message is
    redelivered). The round's own error is the cause."""


@dataclass(eq=False)
class QueuedInput:
    """One node's input waiting for its cluster's round."""

    handle: str
    make: Callable[[], NodeInput | None]
    """Builds the input under the lock (from the record as it is then); None: nothing
    to decide."""
    received_ts: float
    settled: bool = False
    """A round took it (decided, or failed: then :attr:`error`)."""
    error: BaseException | None = None


def take_group(queue: list[QueuedInput], limit: int = MAX_GROUP) -> list[QueuedInput]:
    """Remove from ``queue`` and return its oldest entries, one per node, ``limit`` at
    most; a node's later entry stays queued for the next round, in its order."""
    group: list[QueuedInput] = []
    left: list[QueuedInput] = []
    handles: set[str] = set()
    for entry in queue:
        if len(group) < limit and entry.handle not in handles:
            handles.add(entry.handle)
            group.append(entry)
        else:
            left.append(entry)
    queue[:] = left
    return group
