"""Rules about the telemetry itself: failed collectors and counters that reset."""

from __future__ import annotations

from collections.abc import Iterator

from metalguard.controller.core.rules.base import Context, Finding, flagged, growth_only, reads

RESET_KEYS_LISTED = 5
"""How many reset counters a counter_reset message names before ``...``."""


@reads("collectors", "errors")
def collector_failed(ctx: Context) -> Iterator[Finding]:
    """A collector whose run failed in this cycle; its other readings may be stale."""
    rule = ctx.rules.collector_failed
    if not rule.enabled:
        return
    for run in ctx.batch.collectors:
        if run.success:
            continue
        errors = [e.message for e in ctx.batch.errors if e.collector == run.collector]
        detail = f": {errors[0]}" if errors and errors[0] else ""
        yield flagged(
            "collector_failed",
            rule,
            signal="collector.success",
            value=False,
            threshold=None,
            message=f"collector {run.collector!r} failed{detail}",
        )


@growth_only
def counter_reset(ctx: Context) -> Iterator[Finding]:
    """Counters that dropped in this batch (reboot, driver reload): a note by default."""
    rule = ctx.rules.counter_reset
    if not rule.enabled:
        return
    keys = [key for key in ctx.signals.counters if ctx.signals.reset_at(key, ctx.batch.ts)]
    if keys:
        shown = ", ".join(keys[:RESET_KEYS_LISTED]) + (
            ", ..." if len(keys) > RESET_KEYS_LISTED else ""
        )
        yield flagged(
            "counter_reset",
            rule,
            signal="counter.reset",
            value=len(keys),
            message=f"{len(keys)} counter(s) dropped and count again from their new value "
            f"(reboot or driver reload): {shown}",
        )


RULES = (collector_failed, counter_reset)
