"""The event-loop lag monitor (metalguard/runtime/looplag.py): the window's figures, the
warning (rate-limited, over an injected clock) and the Prometheus exposition."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from metalguard.runtime.looplag import LagWindow, LoopLagCollector, LoopLagMonitor


@pytest.mark.parametrize(
    ("samples", "last", "p99", "largest"),
    [
        ([], 0.0, 0.0, 0.0),
        ([0.001], 0.001, 0.001, 0.001),
        ([0.0] * 99 + [2.0], 2.0, 0.0, 2.0),
        ([0.0] * 98 + [2.0, 3.0], 3.0, 2.0, 3.0),
        ([-1.0], 0.0, 0.0, 0.0),  # a timer that fired early is no lag
    ],
)
def test_window(samples: list[float], last: float, p99: float, largest: float) -> None:
    w = LagWindow(size=100)
    for lag in samples:
        w.add(lag)
    assert (w.last, w.quantile(0.99), w.max) == (last, p99, largest)
    assert w.count == len(samples)
    assert sum(w.buckets) == len(samples)


def test_the_window_forgets_old_samples_for_its_p99_only() -> None:
    w = LagWindow(size=10)
    w.add(5.0)
    for _ in range(10):
        w.add(0.01)
    assert w.quantile(0.99) == 0.01
    assert w.max == 5.0


def test_a_lag_over_a_second_warns_at_most_every_warn_every_s(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    m = LoopLagMonitor(warn_s=1.0, warn_every_s=10.0, clock=lambda: now[0], name="test loop")
    caplog.set_level(logging.WARNING, "metalguard.runtime.looplag")
    for t, lag in [(1, 0.5), (2, 1.5), (3, 2.0), (12, 1.2), (13, 0.9)]:
        now[0] = t
        m.observe(lag)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "test loop lagging" in lines[0]
    assert "1.50 s late" in lines[0]
    assert m.warnings == 3


def test_the_collector_exposes_gauges_histogram_and_warnings() -> None:
    m = LoopLagMonitor(warn_s=1.0)
    for lag in (0.002, 0.2, 1.5):
        m.observe(lag)
    registry = CollectorRegistry()
    registry.register(LoopLagCollector(m))
    text = generate_latest(registry).decode()
    assert "metalguard_event_loop_lag_seconds 1.5" in text
    assert "metalguard_event_loop_lag_max_seconds 1.5" in text
    assert "metalguard_event_loop_lag_p99_seconds 1.5" in text
    assert 'metalguard_event_loop_lag_histogram_seconds_bucket{le="0.25"} 2.0' in text
    assert 'metalguard_event_loop_lag_histogram_seconds_bucket{le="+Inf"} 3.0' in text
    assert "metalguard_event_loop_lag_histogram_seconds_count 3.0" in text
    assert "metalguard_event_loop_lag_warnings_total 1.0" in text


async def test_the_timer_measures_a_blocked_loop() -> None:
    m = LoopLagMonitor(interval_s=0.01)
    m.start()
    try:
        await asyncio.sleep(0.02)
        time.sleep(0.2)  # noqa: ASYNC251 - blocks the loop on purpose
        await asyncio.sleep(0.05)
    finally:
        m.stop()
    print(f"largest lag measured: {m.window.max:.3f} s")
    assert m.window.max >= 0.1
    assert not m.running
