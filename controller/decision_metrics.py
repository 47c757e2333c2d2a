"""The region controller's decision metrics: how many, of which kind, and how fast."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

DECISION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Seconds; the issue's goal for fault-to-isolation is 1 s, so the buckets straddle it."""


class DecisionMetrics:
    """``metalguard_decision_latency_seconds`` and ``metalguard_decisions_total`` by kind."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.latency = Histogram(
            "metalguard_decision_latency_seconds",
            "From taking an input in (a batch or node event fetched, an operator's request, "
            "a silence check) to its decision's event stored in the control stream",
            ["kind"],
            buckets=DECISION_BUCKETS,
            registry=self.registry,
        )
        self.announced = Counter(
            "metalguard_decisions_total",
            "ControllerEvents announced (stored in the control stream)",
            ["kind"],
            registry=self.registry,
        )

    def observe(self, kind: str, seconds: float) -> None:
        """One event of ``kind`` announced ``seconds`` after its input was taken in."""
        self.announced.labels(kind=kind).inc()
        self.latency.labels(kind=kind).observe(max(0.0, seconds))
