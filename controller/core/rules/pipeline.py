"""Rules about the telemetry itself: failed collectors and counters that reset."""

from __future__ import annotations

from collections.abc import Iterator

from metalguard.controller.core.rules.base import (
    Context,
    Finding,
    configured,
    flagged,
    growth_only,
    reads,
)
from metalguard.controller.core.scoring.config import FlagRule

RESET_KEYS_LISTED = 5
"""How many reset counters a counter_reset message names before ``...``."""


@reads("collectors", "errors")
@configured
def collector_failed(ctx: Context, rule: FlagRule) -> Iterator[Finding]:
    """A collector whose run failed in this cycle; its other readings may be stale."""
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
@configured
def counter_reset(ctx: Context, rule: FlagRule) -> Iterator[Finding]:
    """Counters that dropped in this batch (reboot, driver reload): a note by default."""
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
