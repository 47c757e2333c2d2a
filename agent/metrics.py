"""The agent's ``GET /metrics`` (``[metrics] listen``, docs/agent.md "Metrics"): the
event-loop lag (:mod:`metalguard.runtime.looplag`) and the publisher's counters, in the
Prometheus text format, served with aiohttp."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from metalguard.agent.publisher import PublisherStats
from metalguard.runtime.looplag import LoopLagCollector, LoopLagMonitor
from metalguard.runtime.tasks import TaskCountCollector

log = logging.getLogger(__name__)

COUNTERS = {  # PublisherStats field: (metric family, help); exposed with ``_total``
    "published": ("metalguard_agent_published", "Messages acknowledged by JetStream"),
    "replayed": ("metalguard_agent_replayed", "Spooled messages published after a reconnect"),
    "spooled": (
        "metalguard_agent_spooled",
        "Messages written to the spool (NATS unreachable or slow)",
    ),
    "dropped": ("metalguard_agent_dropped", "Messages lost (the spool full)"),
    "rejected": (
        "metalguard_agent_rejected",
        "Messages that can never be published (refused, logged)",
    ),
    "duplicates": (
        "metalguard_agent_duplicates",
        "Messages JetStream had already (acknowledged as duplicates)",
    ),
}
"""PublisherStats counters, exposed as ``metalguard_agent_<name>_total``."""
GAUGES = {
    "queued": ("metalguard_agent_queued", "Messages waiting in memory to be published"),
    "spool_entries": ("metalguard_agent_spool_entries", "Messages in the spool"),
    "spool_bytes": ("metalguard_agent_spool_bytes", "Bytes in the spool"),
}


class PublisherCollector(Collector):
    """The publisher's counters, read at scrape."""

    def __init__(self, stats: Callable[[], PublisherStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        for field, (family, text) in COUNTERS.items():
            yield CounterMetricFamily(family, text, value=getattr(stats, field))
        for field, (family, text) in GAUGES.items():
            yield GaugeMetricFamily(family, text, value=getattr(stats, field))
        yield GaugeMetricFamily(
            "metalguard_agent_nats_connected", "1 while connected to NATS",
            value=1.0 if stats.connected else 0.0,
        )  # fmt: skip


def split_listen(listen: str) -> tuple[str, int]:
    """``host:port`` (or ``[v6]:port``) → (host, port)."""
    host, _, port = listen.rpartition(":")
    return host.strip("[]"), int(port)


class MetricsServer:
    """Serves ``GET /metrics`` on ``listen``; runs the loop-lag monitor meanwhile."""

    def __init__(self, listen: str, stats: Callable[[], PublisherStats]) -> None:
        self.listen = listen
        self.lag = LoopLagMonitor(name="agent event loop")
        self.registry = CollectorRegistry()
        self.registry.register(LoopLagCollector(self.lag))
        self.registry.register(TaskCountCollector())
        self.registry.register(PublisherCollector(stats))
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        """Bind and serve (OSError when the address is taken or not ours)."""
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        host, port = split_listen(self.listen)
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError:
            await runner.cleanup()
            raise
        self._runner = runner
        bound = runner.addresses[0]
        self.url = f"http://{host if ':' not in host else f'[{host}]'}:{bound[1]}/metrics"
        self.lag.start()
        log.info("metrics at %s", self.url)

    async def stop(self) -> None:
        """Stop serving and measuring."""
        self.lag.stop()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _metrics(self, _request: web.Request) -> web.Response:
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
