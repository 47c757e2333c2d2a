"""Which datasets are warm on a node: the scheduler's dataset tie-breaker reads it
(docs/scheduler.md "Datasets").  Pure: the time comes in as an argument.

A node's batch carries one :class:`~metalguard.proto.telemetry.DatasetCache` per
``[[cache.datasets]]`` entry (docs/protocol.md), as the cache process last wrote it to
its ``stats.json``.  A dataset is warm on a node when its cache holds at least half of
what it can hold of the dataset, and its figures are fresh.
"""

from __future__ import annotations

from collections.abc import Iterable

from metalguard.proto.telemetry import DatasetCache, TelemetryBatch

WARM_FRACTION = 0.5
"""Warm from this share of ``min(max_bytes, dataset_bytes)`` cached (of ``max_bytes``
while the dataset's size is unknown)."""
FRESH_S = 30.0
"""Figures older than this (the cache process stopped or hung: it rewrites its stats
file every ``[cache] stats_interval_s``, 2 s by default) are not warm."""


def is_warm(cache: DatasetCache, now: float, *, fresh_s: float = FRESH_S) -> bool:
    """Whether ``cache`` is warm at ``now`` (Unix seconds, the same clock as ``cache.ts``:
    the batch's own ``ts``, so the node's and the controller's clocks never meet).

    Warm: ``used_bytes >= WARM_FRACTION * min(max_bytes, dataset_bytes)`` when the
    dataset's size is known (``dataset_bytes > 0``), else ``>= WARM_FRACTION *
    max_bytes``; at least one byte cached; and ``now - ts <= fresh_s`` (a ``ts`` of 0,
    the agent's entry for a cache that is not running, is never fresh).
    """
    if cache.ts <= 0 or now - cache.ts > fresh_s or cache.used_bytes <= 0:
        return False
    room = min(cache.max_bytes, cache.dataset_bytes) if cache.dataset_bytes > 0 else cache.max_bytes
    return room > 0 and cache.used_bytes >= WARM_FRACTION * room


def warm_datasets(caches: Iterable[DatasetCache], now: float) -> frozenset[str]:
    """The names of the warm ones among ``caches`` at ``now``."""
    return frozenset(c.dataset for c in caches if is_warm(c, now))


def batch_warm_datasets(batch: TelemetryBatch) -> frozenset[str]:
    """The datasets warm on the batch's node when it was sent (judged at ``batch.ts``)."""
    return warm_datasets(batch.cache, batch.ts) if batch.cache else frozenset()
