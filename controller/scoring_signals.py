"""A node's counter history: bounded windows of samples, turned into growth and rates.

Pure data and pure functions; the controller persists :class:`NodeSignals` as it is
(a msgspec Struct) and passes it back with the next batch.

Counters only grow, except when a node reboots or a driver reloads: a reading below the
previous one is a *reset*. The drop is not counted (never a negative rate) and growth is
counted again from the new, lower reading. Errors between the last reading before a reset
and the first after it are unknown and are not counted.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import pairwise

import msgspec

Sample = tuple[float, int]
"""(time in Unix seconds, counter value)"""


class CounterHistory(msgspec.Struct, frozen=True, kw_only=True):
    """One counter's recent samples, oldest first, and the resets seen in it."""

    samples: tuple[Sample, ...] = ()
    resets: int = 0
    last_reset_ts: float | None = None


class NodeSignals(msgspec.Struct, frozen=True, kw_only=True):
    """The signal history of one node, keyed like ``edac.mc0.dimm3.ce``."""

    updated_ts: float | None = None
    """The time of the newest batch taken in."""
    counters: dict[str, CounterHistory] = {}

    def increase(self, key: str, window_s: float, now: float) -> int:
        """How much ``key`` grew in the last ``window_s`` seconds before ``now``.

        A rise counts at the time of the reading that shows it; drops (resets) count as
        zero. An unknown key, or one with a single sample, grew by zero.
        """
        history = self.counters.get(key)
        if history is None:
            return 0
        start = now - window_s
        grown = 0
        for (_, before), (ts, value) in pairwise(history.samples):
            if start <= ts <= now and value > before:
                grown += value - before
        return grown

    def reset_at(self, key: str, ts: float) -> bool:
        """Whether ``key`` was seen to reset by the batch at ``ts``."""
        history = self.counters.get(key)
        return history is not None and history.last_reset_ts == ts


def observe(
    signals: NodeSignals | None,
    ts: float,
    values: Mapping[str, int],
    *,
    retention_s: float,
    max_samples: int,
) -> NodeSignals:
    """``signals`` with the counter ``values`` read at ``ts`` taken in, and old samples gone.

    A batch not newer than the last one (a redelivery) changes nothing. A time more than
    ``retention_s`` before the last one means the clock stepped back: history restarts.
    Samples older than ``retention_s`` are dropped (but for the newest of them, the base a
    later rise is measured from), then keys with no sample newer than that.
    """
    current = signals or NodeSignals()
    if current.updated_ts is not None and ts <= current.updated_ts:
        if ts > current.updated_ts - retention_s:
            return current
        current = NodeSignals()
    cutoff = ts - retention_s
    counters: dict[str, CounterHistory] = {}
    for key in current.counters.keys() | values.keys():
        history = current.counters.get(key, CounterHistory())
        if key in values:
            history = _append(history, ts, values[key], max_samples)
        kept = _prune(history.samples, cutoff)
        if kept:
            counters[key] = msgspec.structs.replace(history, samples=kept)
    return NodeSignals(updated_ts=ts, counters=dict(sorted(counters.items())))


def _append(history: CounterHistory, ts: float, value: int, max_samples: int) -> CounterHistory:
    """Add one reading; a run of equal readings keeps only its first and last sample."""
    samples = history.samples
    resets, last_reset_ts = history.resets, history.last_reset_ts
    if samples and value < samples[-1][1]:
        resets, last_reset_ts = resets + 1, ts
    if len(samples) >= 2 and samples[-1][1] == value == samples[-2][1]:
        samples = samples[:-1]
    samples = (*samples, (ts, value))[-max_samples:]
    return CounterHistory(samples=samples, resets=resets, last_reset_ts=last_reset_ts)


def _prune(samples: tuple[Sample, ...], cutoff: float) -> tuple[Sample, ...]:
    """The samples at or after ``cutoff`` and the one just before; none if all are older."""
    first = next((i for i, (ts, _) in enumerate(samples) if ts >= cutoff), None)
    if first is None:
        return ()
    return samples[max(0, first - 1) :]
