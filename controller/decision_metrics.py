"""The region controller's decision metrics: how many, of which kind, and how fast."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

DECISION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Seconds; the issue's goal for fault-to-isolation is 1 s, so the buckets straddle it."""
ROUND_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
"""Inputs per round (controller/round_queue.py: at most ``MAX_GROUP``)."""


class DecisionMetrics:
    """``metalguard_decision_latency_seconds`` and ``metalguard_decisions_total`` by kind,
    and ``metalguard_round_inputs``: how many nodes' inputs each round decided together."""

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
        self.round_inputs = Histogram(
            "metalguard_round_inputs",
            "Inputs (batches, node events) of one cluster decided and written together in "
            "one round: above 1 while a cluster's inputs queue on its lock (a mass failure)",
            buckets=ROUND_BUCKETS,
            registry=self.registry,
        )

    def observe_round(self, inputs: int) -> None:
        """One round decided ``inputs`` queued inputs of a cluster together."""
        self.round_inputs.observe(inputs)

    def observe(self, kind: str, seconds: float) -> None:
        """One event of ``kind`` announced ``seconds`` after its input was taken in."""
        self.announced.labels(kind=kind).inc()
        self.latency.labels(kind=kind).observe(max(0.0, seconds))
