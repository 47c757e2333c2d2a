"""``GET /metrics``: the Prometheus exposition of the controller's registries (ingest's
metrics, docs/ingest.md), of :class:`GradeCollector`, the node counts read at scrape, and
of the event-loop lag (``metalguard_event_loop_lag_seconds`` ..., a monitor started with
the app: :mod:`metalguard.runtime.looplag`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from metalguard.controller.api.nodes import ControllerView
from metalguard.proto.nodes import GRADES
from metalguard.runtime.looplag import LoopLagCollector, LoopLagMonitor
from metalguard.runtime.tasks import TaskCountCollector

REGISTRIES: Final = web.AppKey("registries", tuple[CollectorRegistry, ...])
LOOP_LAG: Final = web.AppKey("loop_lag", LoopLagMonitor)


def add_metrics_route(
    app: web.Application, view: ControllerView, registry: CollectorRegistry | None = None
) -> None:
    """Register ``GET /metrics``: ``registry`` (when given), then the grade counts."""
    grades = CollectorRegistry()
    grades.register(GradeCollector(view))
    lag = LoopLagMonitor(name="controller event loop")
    grades.register(LoopLagCollector(lag))
    grades.register(TaskCountCollector())
    app[LOOP_LAG] = lag
    app.on_startup.append(_start_lag)
    app.on_cleanup.append(_stop_lag)
    app[REGISTRIES] = (grades,) if registry is None else (registry, grades)
    app.router.add_get("/metrics", metrics)


async def _start_lag(app: web.Application) -> None:
    app[LOOP_LAG].start()


async def _stop_lag(app: web.Application) -> None:
    app[LOOP_LAG].stop()


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text exposition of every registry."""
    body = b"".join(generate_latest(r) for r in request.app[REGISTRIES])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


class GradeCollector(Collector):
    """``metalguard_nodes{grade}`` and ``metalguard_nodes_cordoned``, read at scrape."""

    def __init__(self, view: ControllerView) -> None:
        self._view = view

    def collect(self) -> Iterator[GaugeMetricFamily]:
        records = self._view.store.records.values()
        by_grade = GaugeMetricFamily("metalguard_nodes", "Nodes by grade", labels=["grade"])
        for grade in GRADES:
            by_grade.add_metric([grade], sum(1 for r in records if r.grade == grade))
        yield by_grade
        yield GaugeMetricFamily(
            "metalguard_nodes_cordoned",
            "Nodes cordoned or in maintenance by an operator",
            value=sum(1 for r in records if r.cordoned),
        )
