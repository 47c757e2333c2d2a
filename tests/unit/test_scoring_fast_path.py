"""The scorer's quiet-node fast path gives exactly what running every rule gives.

A node whose counters neither grew nor reset within the longest window skips the rules
marked ``growth_only``; these tests hold the marked rules to that mark over random
histories (repeats of a batch, long gaps, resets) and show the skip really happens.
"""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from metalguard.controller.core.rules import COUNTER_SOURCES, RULES, Context
from metalguard.controller.core.rules.base import GROWTH_ONLY_RULES
from metalguard.controller.core.scoring.config import DEFAULT_SCORING
from metalguard.controller.core.scoring.engine import (
    READING_RULES,
    Assessment,
    NodeSignals,
    assess,
    summarize,
)
from metalguard.controller.core.scoring.signals import fingerprint, observe
from metalguard.proto.telemetry import EdacController, EdacDimm, TelemetryBatch
from tests.support.batch_strategies import node_batches
from tests.support.scoring_helpers import batch

RETENTION_S = DEFAULT_SCORING.retention_s()


def every_rule(signals: NodeSignals | None, b: TelemetryBatch) -> tuple[NodeSignals, Assessment]:
    """``assess`` without the fast path: every rule, always."""
    values: dict[str, int] = {}
    for source in COUNTER_SOURCES:
        values.update(source(b))
    updated = observe(
        signals,
        b.ts,
        values,
        retention_s=RETENTION_S,
        max_samples=DEFAULT_SCORING.history.max_samples_per_key,
    )
    ctx = Context(batch=b, signals=updated, config=DEFAULT_SCORING)
    return updated, summarize([f for rule in RULES for f in rule(ctx)], DEFAULT_SCORING)


steps = st.tuples(
    st.sampled_from([1.0, 5.0, 60.0, 600.0, RETENTION_S, 2 * RETENTION_S]),
    st.booleans(),  # repeat the previous batch's readings
)


@settings(max_examples=150, deadline=None)
@given(
    first=node_batches(), rest=st.lists(st.tuples(steps, node_batches()), min_size=1, max_size=6)
)
def test_the_fast_path_agrees_with_every_rule(
    first: TelemetryBatch, rest: list[tuple[tuple[float, bool], TelemetryBatch]]
) -> None:
    fast: NodeSignals | None = None
    full: NodeSignals | None = None
    current = first
    sequence = [first]
    for (gap, repeat), drawn in rest:
        base = current if repeat else drawn
        current = msgspec.structs.replace(base, ts=current.ts + gap, seq=current.seq + 1)
        sequence.append(current)
    for b in sequence:
        before = fast
        fast, fast_result = assess(fast, b)
        full, full_result = every_rule(full, b)
        assert fast == full
        assert msgspec.structs.replace(fast_result, history_changed=False) == full_result
        assert fast_result.history_changed == (fingerprint(fast) != fingerprint(before))


def test_a_quiet_node_skips_the_growth_rules_and_a_storm_does_not() -> None:
    assert GROWTH_ONLY_RULES
    assert set(READING_RULES).isdisjoint(GROWTH_ONLY_RULES)
    quiet = [
        batch(t, edac=(EdacController(mc=0, dimms=(EdacDimm(name="dimm0", ce_count=5),)),))
        for t in (0.0, 5.0, 10.0)
    ]
    signals, _ = assess(None, quiet[0])
    for b in quiet[1:]:
        signals, _ = assess(signals, b)
    assert signals.quiet_since(quiet[-1].ts - RETENTION_S)

    storm = batch(15.0, edac=(EdacController(mc=0, dimms=(EdacDimm(name="dimm0", ce_count=500),)),))
    stormy, result = assess(signals, storm)
    assert not stormy.quiet_since(storm.ts - RETENTION_S)
    assert [r.rule for r in result.reasons] == ["ecc_correctable_rate"]


@settings(max_examples=200, deadline=None)
@given(
    readings=st.lists(
        st.tuples(
            st.dictionaries(st.sampled_from(["a", "b", "c"]), st.integers(0, 2), max_size=3),
            st.booleans(),  # repeat the previous reading (the steady path's case)
        ),
        min_size=1,
        max_size=8,
    ),
    gaps=st.lists(st.sampled_from([1.0, 5.0, 600.0, RETENTION_S, 2 * RETENTION_S]), min_size=8),
)
def test_observe_steady_path_equals_the_long_way(
    readings: list[tuple[dict[str, int], bool]], gaps: list[float]
) -> None:
    from metalguard.controller.core.scoring.signals import _observe

    signals: NodeSignals | None = None
    ts = 0.0
    values: dict[str, int] = {}
    for (drawn, repeat), gap in zip(readings, gaps, strict=False):
        values = values if repeat and values else drawn
        ts += gap
        long_way = _observe(
            signals or NodeSignals(), ts, values, retention_s=RETENTION_S, max_samples=4
        )
        signals = observe(signals, ts, values, retention_s=RETENTION_S, max_samples=4)
        assert signals == long_way
        assert list(signals.counters) == sorted(signals.counters)
