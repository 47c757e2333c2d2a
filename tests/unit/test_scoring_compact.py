"""The compact scoring history: what it writes and what it shares, with no result changed.

A history is written (``Assessment.history_changed``) when its :func:`fingerprint`
changes; the end marker of a run of equal readings is not part of it, so a node's
second batch (the first run's marker) writes nothing. A controller restarted from the
last written history must take the next reading to the same counts, rises and resets
as the one that kept running.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from metalguard.controller.core.scoring.config import DEFAULT_SCORING
from metalguard.controller.core.scoring.signals import (
    NodeSignals,
    fingerprint,
    shared_key,
    take_in,
)

RETENTION_S = DEFAULT_SCORING.retention_s()
WINDOWS = (10.0, 600.0, 3600.0, RETENTION_S)
MAX_SAMPLES = 32


def step(
    signals: NodeSignals | None, ts: float, values: dict[str, int], max_samples: int = 4
) -> NodeSignals:
    return take_in(signals, ts, values, retention_s=RETENTION_S, max_samples=max_samples)[0]


def same_view(a: NodeSignals, b: NodeSignals, now: float) -> None:
    """What the growth rules read of a history: the rise of every counter in every
    window (an absent key rose by 0), quietness, and each counter's newest value. (The
    time of a run's end marker may lag in a restarted history, as it does after steady
    batches, which are never written: a key with no rise may then be pruned sooner.)"""
    for key in a.counters.keys() | b.counters.keys():
        for window in WINDOWS:
            assert a.increase(key, window, now) == b.increase(key, window, now), key
        if key in a.counters and key in b.counters:
            assert a.counters[key].samples[-1][1] == b.counters[key].samples[-1][1]
    for window in WINDOWS:
        assert a.quiet_since(now - window) == b.quiet_since(now - window)


@settings(max_examples=80, deadline=None)
@given(
    readings=st.lists(
        st.tuples(
            st.dictionaries(st.sampled_from(["a", "b", "c"]), st.integers(0, 3), max_size=3),
            st.booleans(),  # repeat the previous reading
        ),
        min_size=2,
        max_size=10,
    ),
    gaps=st.lists(st.sampled_from([1.0, 5.0, 600.0]), min_size=10),
    restart=st.integers(0, 9),
)
def test_a_restart_from_the_written_history_reads_the_same(
    readings: list[tuple[dict[str, int], bool]], gaps: list[float], restart: int
) -> None:
    # Within the retention and the sample bound (10 readings, <= 6,000 s, 32 samples).
    # Past them the two may differ, as after steady batches (never written) before: the
    # unwritten end marker keeps a run's first sample in the live history where the
    # restarted one prunes it (a key gone for a retention), or takes a sample slot that
    # pushes an older sample out (a rise seen by one and not the other): docs/controller.md.
    live: NodeSignals | None = None
    written: NodeSignals | None = None  # what KV holds: the last history worth writing
    restarted: NodeSignals | None = None
    ts, values = 0.0, dict[str, int]()
    for i, ((drawn, repeat), gap) in enumerate(zip(readings, gaps, strict=False)):
        values = values if repeat and values else drawn
        ts += gap
        before = live
        live = step(live, ts, values, MAX_SAMPLES)
        if restarted is not None:
            restarted = step(restarted, ts, values, MAX_SAMPLES)
            same_view(restarted, live, ts)
        elif fingerprint(live) != fingerprint(before):
            written = live
        if i == restart and restarted is None:
            restarted = written


def test_a_second_equal_batch_is_not_worth_writing() -> None:
    first = step(None, 10.0, {"a": 0, "b": 0})
    second = step(first, 25.0, {"a": 0, "b": 0})
    assert len(second.counters["a"].samples) == 2
    assert fingerprint(second) == fingerprint(first)
    third = step(second, 40.0, {"a": 1, "b": 0})
    assert fingerprint(third) != fingerprint(second)


def test_equal_histories_and_keys_are_shared() -> None:
    values = {f"edac.mc0.dimm{i}.ce": 0 for i in range(8)} | {"edac.mc0.ue": 2}
    first = step(None, 10.0, values)
    zero = {id(h) for k, h in first.counters.items() if k.endswith(".ce")}
    assert len(zero) == 1  # eight zero counters, one history
    assert first.counters["edac.mc0.ue"].samples == ((10.0, 2),)
    second = step(first, 25.0, dict(values))
    assert len({id(h) for k, h in second.counters.items() if k.endswith(".ce")}) == 1
    third = step(second, 40.0, dict(values))  # the steady path shares too
    assert len({id(h) for k, h in third.counters.items() if k.endswith(".ce")}) == 1
    other = step(None, 10.0, {"edac.mc0.dimm0.ce": 0})
    (key,) = other.counters
    assert key is next(iter(first.counters))  # one key string for every node
    assert shared_key("edac.mc0.dimm0.ce") is key
