"""How late the event loop runs: a periodic loop timer that measures how late it fires.

A loop busy with CPU work (or blocked in a synchronous call) runs its callbacks late: a
timer due every ``interval_s`` fires ``lag`` seconds after it was due.  The monitor keeps
the last lag, the largest, a p99 over a window of recent samples and a histogram, logs a
warning when a lag exceeds ``warn_s`` (at most once per ``warn_every_s``), and exposes
them to Prometheus (:class:`LoopLagCollector`: ``metalguard_event_loop_lag_seconds`` and
friends; docs/agent.md, docs/controller.md).  The clock is injected; :class:`LagWindow`
is pure.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Final

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
"""Upper bounds (seconds) of the lag histogram's buckets (+Inf implied)."""


class LagWindow:
    """The lag samples: last, largest, p99 over the newest ``size``, and a histogram over
    every sample (pure)."""

    def __init__(self, size: int = 600) -> None:
        self._recent: deque[float] = deque(maxlen=size)
        self.last = 0.0
        self.max = 0.0
        self.count = 0
        self.sum = 0.0
        self.buckets = [0] * (len(BUCKETS) + 1)
        """Per bucket (not cumulative), the last one is +Inf."""

    def add(self, lag: float) -> None:
        """Take one sample (seconds, ≥ 0)."""
        lag = max(0.0, lag)
        self._recent.append(lag)
        self.last = lag
        self.max = max(self.max, lag)
        self.count += 1
        self.sum += lag
        self.buckets[bisect.bisect_left(BUCKETS, lag)] += 1

    def quantile(self, q: float) -> float:
        """The ``q`` quantile (nearest rank) of the recent samples; 0 without any."""
        if not self._recent:
            return 0.0
        ordered = sorted(self._recent)
        rank = max(1, math.ceil(q * len(ordered)))
        return ordered[rank - 1]


class LoopLagMonitor:
    """Measures the running loop's lag every ``interval_s`` (start it from the loop)."""

    def __init__(
        self,
        interval_s: float = 0.25,
        *,
        warn_s: float = 1.0,
        warn_every_s: float = 10.0,
        window: int = 1200,
        clock: Callable[[], float] = time.monotonic,
        name: str = "event loop",
    ) -> None:
        self.interval_s = interval_s
        self.warn_s = warn_s
        self.warn_every_s = warn_every_s
        self.window = LagWindow(window)
        self.warnings = 0
        """Lags above ``warn_s`` seen (each counted, logged at most every warn_every_s)."""
        self._clock = clock
        self._name = name
        self._due = 0.0
        self._warned = -math.inf
        self._handle: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def running(self) -> bool:
        """Whether the timer is armed."""
        return self._handle is not None

    def start(self) -> None:
        """Arm the timer on the running loop (idempotent)."""
        if self._handle is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._arm()

    def stop(self) -> None:
        """Disarm the timer."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def observe(self, lag: float) -> None:
        """Take one lag sample: recorded, and warned about above ``warn_s``."""
        self.window.add(lag)
        if lag <= self.warn_s:
            return
        self.warnings += 1
        now = self._clock()
        if now - self._warned >= self.warn_every_s:
            self._warned = now
            log.warning(
                "%s lagging: a timer fired %.2f s late (over %.1f s; p99 %.3f s)",
                self._name, lag, self.warn_s, self.window.quantile(0.99),
            )  # fmt: skip

    def _arm(self) -> None:
        assert self._loop is not None
        self._due = self._clock() + self.interval_s
        self._handle = self._loop.call_later(self.interval_s, self._fired)

    def _fired(self) -> None:
        self.observe(self._clock() - self._due)
        self._arm()


class LoopLagCollector(Collector):
    """The monitor's figures for Prometheus, read at scrape."""

    def __init__(self, monitor: LoopLagMonitor) -> None:
        self._monitor = monitor

    def collect(self) -> Iterator[Metric]:
        w = self._monitor.window
        yield GaugeMetricFamily(
            "metalguard_event_loop_lag_seconds",
            "How late the event loop ran its last periodic timer",
            value=w.last,
        )
        yield GaugeMetricFamily(
            "metalguard_event_loop_lag_p99_seconds",
            "99th percentile of the event loop's lag over the recent samples",
            value=w.quantile(0.99),
        )
        yield GaugeMetricFamily(
            "metalguard_event_loop_lag_max_seconds",
            "Largest event loop lag since the start",
            value=w.max,
        )
        cumulative, running = [], 0
        for bound, n in zip((*map(str, BUCKETS), "+Inf"), w.buckets, strict=True):
            running += n
            cumulative.append((bound, float(running)))
        yield HistogramMetricFamily(
            "metalguard_event_loop_lag_histogram_seconds",
            "The event loop's lag samples",
            buckets=cumulative,
            sum_value=w.sum,
        )
        yield CounterMetricFamily(
            "metalguard_event_loop_lag_warnings",
            f"Lags above the warning threshold ({self._monitor.warn_s:g} s)",
            value=self._monitor.warnings,
        )
