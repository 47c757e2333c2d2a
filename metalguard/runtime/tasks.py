"""How many asyncio tasks the event loop holds: ``metalguard_asyncio_tasks``, read at
scrape (docs/api.md, docs/agent.md).  A count that keeps rising over hours is a leak
(bench/soak.py watches it)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class TaskCountCollector(Collector):
    """``metalguard_asyncio_tasks``: the tasks not yet done on the running loop (the
    scrape's; nothing when collected outside a loop)."""

    def collect(self) -> Iterator[Metric]:
        try:
            tasks = asyncio.all_tasks()
        except RuntimeError:  # no running loop (a registry read from a plain thread)
            return
        yield GaugeMetricFamily(
            "metalguard_asyncio_tasks",
            "Asyncio tasks not yet done on the event loop",
            value=len(tasks),
        )
