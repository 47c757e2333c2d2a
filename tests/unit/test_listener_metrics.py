"""The listeners' bad-message counts as Prometheus counters, read at scrape."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from metalguard.controller.listener_metrics import ListenerCollector


def scrape(collector: ListenerCollector) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.name.endswith("_created")
    }


def test_counts_are_read_at_each_scrape() -> None:
    counts = {"bad": 0}
    fed = {"summary": 0, "lookup": 0, "submit": 0}
    collector = ListenerCollector(lambda: counts["bad"], lambda: fed)
    assert scrape(collector)[("metalguard_job_bad_events_total", ())] == 0
    counts["bad"] = 3
    fed["lookup"] = 2
    got = scrape(collector)
    assert got[("metalguard_job_bad_events_total", ())] == 3
    assert got[("metalguard_federation_bad_messages_total", (("subject", "lookup"),))] == 2
    assert got[("metalguard_federation_bad_messages_total", (("subject", "summary"),))] == 0


def test_without_federation_only_the_job_events_are_exposed() -> None:
    got = scrape(ListenerCollector(lambda: 1))
    assert got == {("metalguard_job_bad_events_total", ()): 1}
