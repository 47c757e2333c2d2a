"""Network rules: per-interface error, drop and pause-frame rates, and drops in a lossless
tc class. Every reading is a counter, judged by its growth over the rule's window; the
reasons' signals start with ``network.``, the node's network component.

A microburst or incast shows as drops (``net_drop_rate``) or, on a lossless fabric, as
pause frames (``net_pause_storm``: a NIC that cannot drain its buffers pauses its peers,
and a storm of them stalls the whole fabric); drops in a class that should be lossless
(``tc_lossless_drops``) mean PFC is not doing its job.
"""

from __future__ import annotations

from collections.abc import Iterator

from metalguard.controller.core.rules.base import (
    Context,
    Finding,
    configured,
    growth_only,
    rate_finding,
    reads,
)
from metalguard.controller.core.scoring.config import RateRule
from metalguard.proto.telemetry import NetInterface, TcClassStats, TelemetryBatch


@reads("net")
def counters(batch: TelemetryBatch) -> Iterator[tuple[str, int]]:
    """Per interface: errors, drops and pause frames (both directions); per lossless tc
    class: its drops."""
    for net in batch.net:
        for kind, value in (
            ("errors", _both(net.rx_errors, net.tx_errors)),
            ("drops", _both(net.rx_dropped, net.tx_dropped)),
            ("pause", _both(net.rx_pause, net.tx_pause)),
        ):
            if value is not None:
                yield _key(net, kind), value
        for tc in net.tc_classes:
            if tc.lossless:
                yield _class_key(net, tc), tc.drops


@growth_only
@configured
def net_error_rate(ctx: Context, rule: RateRule) -> Iterator[Finding]:
    """rx + tx errors per hour per interface (CRC, frame, FIFO, ...)."""
    yield from _per_interface(ctx, "net_error_rate", rule, "errors")


@growth_only
@configured
def net_drop_rate(ctx: Context, rule: RateRule) -> Iterator[Finding]:
    """rx + tx drops per hour per interface (full rings and queues: bursts, incast)."""
    yield from _per_interface(ctx, "net_drop_rate", rule, "drops")


@growth_only
@configured
def net_pause_storm(ctx: Context, rule: RateRule) -> Iterator[Finding]:
    """PFC/pause frames received + sent per hour per interface."""
    yield from _per_interface(ctx, "net_pause_storm", rule, "pause")


@growth_only
@configured
def tc_lossless_drops(ctx: Context, rule: RateRule) -> Iterator[Finding]:
    """Drops per hour in a tc class that serves a lossless (PFC) priority."""
    for net in ctx.batch.net:
        for tc in net.tc_classes:
            if not tc.lossless:
                continue
            found = rate_finding(
                "tc_lossless_drops",
                rule,
                ctx,
                _class_key(net, tc),
                signal="network.lossless_drops",
                what="drops",
                subject=f"lossless class {_class_name(tc)} on {net.name}",
            )
            if found is not None:
                yield found


RULES = (net_error_rate, net_drop_rate, net_pause_storm, tc_lossless_drops)

_WHAT = {"errors": "rx/tx errors", "drops": "rx/tx drops", "pause": "pause frames"}
_SIGNAL = {
    "errors": "network.error_rate",
    "drops": "network.drop_rate",
    "pause": "network.pause_rate",
}


def _per_interface(ctx: Context, key: str, rule: RateRule, kind: str) -> Iterator[Finding]:
    for net in ctx.batch.net:
        found = rate_finding(
            key,
            rule,
            ctx,
            _key(net, kind),
            signal=_SIGNAL[kind],
            what=_WHAT[kind],
            subject=f"interface {net.name}",
        )
        if found is not None:
            yield found


def _both(rx: int | None, tx: int | None) -> int | None:
    if rx is None and tx is None:
        return None
    return (rx or 0) + (tx or 0)


def _key(net: NetInterface, kind: str) -> str:
    return f"net.{net.name}.{kind}"


def _class_key(net: NetInterface, tc: TcClassStats) -> str:
    return f"net.{net.name}.tc.{tc.classid}.drops"


def _class_name(tc: TcClassStats) -> str:
    return f"{tc.name} ({tc.classid})" if tc.name else tc.classid
