"""A node's counter history: bounded windows of samples, turned into growth and rates.

Pure data and pure functions; the controller persists :class:`NodeSignals` as it is
(a msgspec Struct) and passes it back with the next batch.

Counters only grow, except when a node reboots or a driver reloads: a reading below the
previous one is a *reset*. The drop is not counted (never a negative rate) and growth is
counted again from the new, lower reading. Errors between the last reading before a reset
and the first after it are unknown and are not counted.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from itertools import pairwise

import msgspec

Sample = tuple[float, int]
"""(time in Unix seconds, counter value)"""


class CounterHistory(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One counter's recent samples, oldest first, and the resets seen in it.

    Not tracked by the garbage collector (``gc=False``): it holds only numbers, so it
    can be in no reference cycle, and a controller keeps thousands of them alive."""

    samples: tuple[Sample, ...] = ()
    resets: int = 0
    last_reset_ts: float | None = None

    def quiet_since(self, start: float) -> bool:
        """Whether the counter neither grew nor reset in the samples kept from ``start``
        on (cheap: counters only grow between resets, so equal ends mean no growth)."""
        samples = self.samples
        if self.last_reset_ts is not None and self.last_reset_ts >= start:
            return False
        return len(samples) < 2 or samples[0][1] == samples[-1][1]


class NodeSignals(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The signal history of one node, keyed like ``edac.mc0.dimm3.ce`` (``gc=False``:
    it holds only strings and CounterHistory, so it can be in no reference cycle)."""

    updated_ts: float | None = None
    """The time of the newest batch taken in."""
    counters: dict[str, CounterHistory] = {}

    def increase(self, key: str, window_s: float, now: float) -> int:
        """How much ``key`` grew in the last ``window_s`` seconds before ``now``.

        A rise counts at the time of the reading that shows it; drops (resets) count as
        zero. An unknown key, or one with a single sample, grew by zero.
        """
        history = self.counters.get(key)
        start = now - window_s
        if history is None or history.quiet_since(start):
            return 0
        grown = 0
        for (_, before), (ts, value) in pairwise(history.samples):
            if start <= ts <= now and value > before:
                grown += value - before
        return grown

    def quiet_since(self, start: float) -> bool:
        """Whether no counter grew or reset from ``start`` on."""
        return all(h.quiet_since(start) for h in self.counters.values())

    def last_seen(self, key: str) -> float | None:
        """The time of ``key``'s newest sample kept (None: none). For a key that a counter
        source yields only while a state holds (``rdma.<device>.<port>.active``, always 1),
        that is when the state was last seen: the key stays in the history, unchanged,
        until its samples are older than the retention."""
        history = self.counters.get(key)
        return history.samples[-1][0] if history is not None and history.samples else None

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
    return take_in(signals, ts, values, retention_s=retention_s, max_samples=max_samples)[0]


def take_in(
    signals: NodeSignals | None,
    ts: float,
    values: Mapping[str, int],
    *,
    retention_s: float,
    max_samples: int,
) -> tuple[NodeSignals, bool]:
    """:func:`observe`, and whether the batch was *steady*: the same counters as before,
    each in a run of equal readings equal to its new value. A steady batch changes no
    value, sample count or reset (nothing worth persisting), and leaves every counter
    quiet over the retention."""
    current = signals or NodeSignals()
    if current.updated_ts is not None and ts <= current.updated_ts:
        if ts > current.updated_ts - retention_s:
            return current, False
        current = NodeSignals()
    if not current.counters and max_samples >= 1 and retention_s >= 0:
        return _first(ts, values), False
    cutoff = ts - retention_s if max_samples >= 2 else math.inf  # else: one sample kept
    steady = _steady(current, ts, values, cutoff)
    if steady is not None:
        return steady, True
    updated = _observe(current, ts, values, retention_s=retention_s, max_samples=max_samples)
    return updated, False


Fingerprint = tuple[tuple[str, int, int, int], ...]


def fingerprint(signals: NodeSignals | None) -> Fingerprint:
    """What of a history is worth persisting: each counter's newest value, sample count
    and resets. A run of equal readings ends in a sample that only marks how far the run
    goes (its time moves with every batch, :func:`_append` replaces it): it is not
    counted, so a history that only grew such a marker (a node's second batch) is not
    written again; one restarted from the written history takes the next reading to the
    same samples (tests/unit/test_scoring_compact.py)."""
    if signals is None:
        return ()
    return tuple(
        (key, h.samples[-1][1] if h.samples else -1, _kept_samples(h.samples), h.resets)
        for key, h in signals.counters.items()
    )


def _kept_samples(samples: tuple[Sample, ...]) -> int:
    """How many samples a history holds, its run's end marker not counted."""
    n = len(samples)
    return n - 1 if n >= 2 and samples[-1][1] == samples[-2][1] else n


_KEYS: dict[str, str] = {}
"""One string per counter key, shared by every node's history (``edac.mc0.dimm3.ce``
repeats on every node of a fleet)."""
_KEYS_KEPT = 1_000_000


def shared_key(key: str) -> str:
    """The shared copy of ``key`` (bounded: emptied when full)."""
    kept = _KEYS.get(key)
    if kept is None:
        if len(_KEYS) >= _KEYS_KEPT:
            _KEYS.clear()
        kept = _KEYS[key] = key
    return kept


def _first(ts: float, values: Mapping[str, int]) -> NodeSignals:
    """A node's first batch, what :func:`_observe` makes of it from no history: one
    sample per key; the keys and the histories of equal values are shared."""
    histories: dict[int, CounterHistory] = {}
    counters: dict[str, CounterHistory] = {}
    for key in sorted(values):
        value = values[key]
        history = histories.get(value)
        if history is None:
            history = histories[value] = CounterHistory(samples=((ts, value),))
        counters[shared_key(key)] = history
    return NodeSignals(updated_ts=ts, counters=counters)


def _steady(
    current: NodeSignals, ts: float, values: Mapping[str, int], cutoff: float
) -> NodeSignals | None:
    """The common case cheaply: the same counters, each in a run of equal readings equal
    to its new value (two samples: the run's first and its end marker; or one, newer
    than ``cutoff``: a node's second batch). The run's end moves to ``ts``; nothing is
    pruned (the run's first sample is the base of any later rise). None otherwise."""
    counters = current.counters
    if len(counters) != len(values) or not counters:
        return None
    moved: dict[str, CounterHistory] = {}
    newest: dict[int, Sample] = {}  # one (ts, value) tuple per distinct value
    shared: dict[int, CounterHistory] = {}  # one moved history per shared history
    replace = msgspec.structs.replace
    for key, history in counters.items():
        again = shared.get(id(history))
        if again is not None:
            if values.get(key) != again.samples[0][1]:
                return None
            moved[key] = again
            continue
        samples = history.samples
        if len(samples) == 2:
            first, last = samples
            value = first[1]
            if last[1] != value:
                return None
        elif len(samples) == 1:
            first = samples[0]
            value = first[1]
            if first[0] < cutoff:
                return None
        else:
            return None
        if values.get(key) != value:
            return None
        sample = newest.get(value)
        if sample is None:
            sample = newest[value] = (ts, value)
        moved[key] = shared[id(history)] = replace(history, samples=(first, sample))
    return NodeSignals(updated_ts=ts, counters=moved)


def _observe(
    current: NodeSignals,
    ts: float,
    values: Mapping[str, int],
    *,
    retention_s: float,
    max_samples: int,
) -> NodeSignals:
    """:func:`observe` the long way: every key appended and pruned."""
    cutoff = ts - retention_s
    counters: dict[str, CounterHistory] = {}
    shared: dict[tuple[tuple[Sample, ...], int, float | None], CounterHistory] = {}
    for key in current.counters.keys() | values.keys():
        history = current.counters.get(key, CounterHistory())
        if key in values:
            history = _append(history, ts, values[key], max_samples)
        kept = _prune(history.samples, cutoff)
        if kept:
            # Equal histories (a node's many zero counters) are one object.
            same = (kept, history.resets, history.last_reset_ts)
            again = shared.get(same)
            if again is None:
                again = shared[same] = msgspec.structs.replace(history, samples=kept)
            counters[shared_key(key)] = again
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
