"""Bad messages the controller's own listeners met, on ``/metrics`` (read at scrape).

Ingest counts its own (``metalguard_ingest_decode_errors_total``); the federation service
(``<p>.fed.summary|lookup|submit``) and the job manager (agents' job events) keep plain
counts, which :class:`ListenerCollector` exposes as Prometheus counters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

FEDERATION_BAD: str = "metalguard_federation_bad_messages"
JOB_EVENTS_BAD: str = "metalguard_job_bad_events"


class ListenerCollector(Collector):
    """``metalguard_federation_bad_messages_total{subject}`` (summary, lookup, submit;
    only with ``[federation] enabled``) and ``metalguard_job_bad_events_total``."""

    def __init__(
        self,
        job_bad_events: Callable[[], int],
        federation_bad: Callable[[], Mapping[str, int]] | None = None,
    ) -> None:
        self._job_bad_events = job_bad_events
        self._federation_bad = federation_bad

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(
            JOB_EVENTS_BAD,
            "Agents' job events the job manager could not take (undecodable, or about "
            "another node than their subject's)",
            value=self._job_bad_events(),
        )
        if self._federation_bad is None:
            return
        family = CounterMetricFamily(
            FEDERATION_BAD,
            "Federation messages refused or ignored (undecodable, wrong type, unfit)",
            labels=["subject"],
        )
        for subject, count in sorted(self._federation_bad().items()):
            family.add_metric([subject], count)
        yield family
