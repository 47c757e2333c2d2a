"""Counter history: rates over windows, resets, bounds, replays — all on injected time."""

from __future__ import annotations

from itertools import pairwise

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metalguard.controller.core.scoring.config import parse_scoring_config
from metalguard.controller.core.scoring.engine import NodeSignals
from metalguard.controller.core.scoring.signals import observe
from tests.support.scoring_helpers import T0, by_rule, dimm_mc, pci, run

CE = "edac.mc0.dimm0.ce"


def ce_steps(*points: tuple[float, int]) -> list[tuple[float, dict[str, object]]]:
    """One batch per (offset, correctable count) of the DIMM."""
    return [(offset, {"edac": (dimm_mc(ce=count),)}) for offset, count in points]


@pytest.mark.parametrize(
    ("points", "severity"),
    [
        # a drop mid-window is a reset: no negative rate, no false alarm
        (((0, 50), (600, 3)), None),
        (((0, 50), (600, 3), (1200, 3)), None),
        # growth after the reset counts from the new baseline (3 -> 13)
        (((0, 50), (600, 3), (1200, 13)), "warning"),
        (((0, 50), (600, 3), (1200, 12)), None),
        # growth before and after a reset both count; the drop does not (60 + 50)
        (((0, 0), (600, 60), (1200, 0), (1800, 50)), "severe"),
        (((0, 0), (600, 49), (1200, 0), (1800, 50)), "warning"),  # 99: not severe
        # two resets in a row
        (((0, 90), (600, 10), (1200, 5), (1800, 15)), "warning"),
    ],
)
def test_resets(points: tuple[tuple[float, int], ...], severity: str | None) -> None:
    _signals, assessment = run(ce_steps(*points))
    found = {f.severity for f in assessment.findings if f.reason.rule == "ecc_correctable_rate"}
    assert found == ({severity} if severity else set())
    assert assessment.score >= 0


def test_reset_is_recorded_and_noted_once() -> None:
    signals, assessment = run(ce_steps((0, 50), (600, 3)))
    history = signals.counters[CE]
    assert (history.resets, history.last_reset_ts) == (1, T0 + 600)
    (note,) = by_rule(assessment, "counter_reset")
    assert note.value == 1
    assert CE in note.message
    assert assessment.findings == ()
    _signals, later = run(ce_steps((1200, 3)), signals=signals)
    assert by_rule(later, "counter_reset") == []


@pytest.mark.parametrize(
    ("now", "severity"),
    [
        (60, "severe"),  # 100 errors first seen at T0+60
        (3660, "severe"),  # still within the hour
        (3661, None),  # out of the window
    ],
)
def test_errors_leave_the_window(now: float, severity: str | None) -> None:
    points = [(0.0, 0), (60.0, 100)] + ([(float(now), 100)] if now > 60 else [])
    _signals, assessment = run(ce_steps(*points))
    found = {f.severity for f in assessment.findings}
    assert found == ({severity} if severity else set())


def test_rate_is_per_window_not_extrapolated() -> None:
    """10 errors in 10 s are 10 within the hour (a warning), not 3600/h."""
    _signals, assessment = run(ce_steps((0, 0), (10, 10)))
    (reason,) = assessment.reasons
    assert reason.value == 10.0


def test_window_is_configurable() -> None:
    config = parse_scoring_config("[rules.ecc_correctable_rate]\nwindow_s = 600.0")
    # 10 errors within 10 minutes: 60/h
    _signals, assessment = run(ce_steps((0, 0), (300, 10)), config=config)
    (reason,) = assessment.reasons
    assert (reason.value, reason.threshold) == (60.0, 10)
    assert "in the last 600 s" in reason.message


def test_retrains_reset_when_the_agent_restarts() -> None:
    steps = [(0.0, {"pcie": (pci(retrains=5),)}), (60.0, {"pcie": (pci(retrains=0),)})]
    _signals, assessment = run(steps)
    assert assessment.findings == ()
    assert [n.rule for n in assessment.notes] == ["counter_reset"]


def test_replayed_batch_changes_nothing() -> None:
    signals, first = run(ce_steps((0, 0), (600, 20)))
    again, second = run(ce_steps((600, 20)), signals=signals)
    assert again == signals
    assert first.history_changed
    assert second == msgspec.structs.replace(first, history_changed=False)  # nothing to persist
    older, _ = run(ce_steps((300, 999)), signals=signals)
    assert older == signals


def test_clock_stepped_back_restarts_history() -> None:
    signals, _ = run(ce_steps((100_000, 7)))
    restarted, assessment = run(ce_steps((0, 3)), signals=signals)
    assert restarted.updated_ts == T0
    assert restarted.counters[CE].samples == ((T0, 3),)
    assert assessment.findings == ()


def test_old_samples_and_vanished_counters_are_dropped() -> None:
    signals, _ = run(ce_steps((0, 1), (600, 2)))
    # a day and a bit later the DIMM's counter is gone from the batches
    later, _ = run([(90_000.0, {})], signals=signals)
    assert later.counters == {}


def test_unchanged_readings_are_merged() -> None:
    signals, _ = run(ce_steps(*((i * 5.0, 7) for i in range(100))))
    assert signals.counters[CE].samples == ((T0, 7), (T0 + 495.0, 7))


def test_samples_per_key_are_capped() -> None:
    config = parse_scoring_config("[history]\nmax_samples_per_key = 4")
    signals, _ = run(ce_steps(*((i * 5.0, i) for i in range(10))), config=config)
    assert [v for _, v in signals.counters[CE].samples] == [6, 7, 8, 9]


def test_signals_survive_msgpack() -> None:
    signals, _ = run(ce_steps((0, 50), (600, 3), (1200, 9)))
    data = msgspec.msgpack.encode(signals)
    assert msgspec.msgpack.decode(data, type=NodeSignals) == signals


counts = st.lists(
    st.tuples(st.floats(min_value=0.001, max_value=5000.0), st.integers(0, 10**6)),
    min_size=1,
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(points=counts, window=st.floats(min_value=1.0, max_value=7200.0), cap=st.integers(2, 50))
def test_history_properties(points: list[tuple[float, int]], window: float, cap: int) -> None:
    """Growth is never negative and never more than the rises seen; history stays bounded."""
    retention = 3600.0
    signals: NodeSignals | None = None
    ts = T0
    rises = 0
    previous: int | None = None
    for gap, value in points:
        ts += gap
        signals = observe(signals, ts, {"k": value}, retention_s=retention, max_samples=cap)
        rises += max(0, value - previous) if previous is not None else 0
        previous = value
        grown = signals.increase("k", window, ts)
        assert 0 <= grown <= rises
        samples = signals.counters["k"].samples
        assert len(samples) <= cap
        assert samples[-1] == (ts, value)
        assert all(a[0] < b[0] for a, b in pairwise(samples))
        assert sum(1 for t, _ in samples if t < ts - retention) <= 1
