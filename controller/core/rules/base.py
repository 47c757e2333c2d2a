"""What every rule shares: its input (:class:`Context`) and its output (:class:`Finding`).

A rule is a pure function ``Context -> Iterable[Finding]``; most are written as
``(Context, settings) -> Iterable[Finding]`` under :func:`configured`, which hands them
their own settings and skips them while disabled. A counter source is a pure function
``TelemetryBatch -> Iterable[(key, value)]`` naming the counters whose history the rules
of its module read back through ``Context.signals``.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec

from metalguard.controller.core.scoring.config import (
    RULE_KEYS,
    AnyRule,
    FlagRule,
    RateRule,
    Rules,
    ScoringConfig,
    Severity,
)
from metalguard.controller.core.scoring.signals import NodeSignals
from metalguard.proto.base import Reason
from metalguard.proto.telemetry import TelemetryBatch

SECONDS_PER_HOUR = 3600.0


class Finding(msgspec.Struct, frozen=True, kw_only=True):
    """One reason a rule found, how serious it is and the points it costs."""

    reason: Reason
    severity: Severity
    penalty: float


@dataclass(frozen=True, slots=True)
class Context:
    """What a rule reads: the batch, the node's history (this batch included), the config."""

    batch: TelemetryBatch
    signals: NodeSignals
    config: ScoringConfig
    rules: Rules = field(init=False)
    """The rules' settings (``config.rules``, looked up once: every rule reads it)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "rules", self.config.rules)

    @property
    def now(self) -> float:
        """The time rates are judged at: the newest batch seen (this one, unless replayed)."""
        newest = self.signals.updated_ts
        return self.batch.ts if newest is None else max(newest, self.batch.ts)


Rule = Callable[[Context], Iterable[Finding]]
CounterSource = Callable[[TelemetryBatch], Iterable[tuple[str, int]]]

_S = TypeVar("_S", bound=AnyRule)


def configured(fn: Callable[[Context, _S], Iterable[Finding]]) -> Rule:
    """Make ``fn(ctx, settings)`` a rule: it is called with the settings under its own
    name (``ctx.rules.<fn.__name__>``), and not at all while they are disabled (the rule
    then finds nothing). Put it below :func:`reads` and :func:`growth_only`: they mark
    the rule it returns."""
    key = fn.__name__
    if key not in RULE_KEYS:
        raise ValueError(f"{key!r} is not a rule's key in [rules]")
    settings_of = operator.attrgetter(key)

    @functools.wraps(fn)
    def rule(ctx: Context) -> Iterable[Finding]:
        settings: _S = settings_of(ctx.rules)
        return fn(ctx, settings) if settings.enabled else ()

    return rule


GROWTH_ONLY_RULES: set[Rule] = set()
"""Rules marked with :func:`growth_only`."""


def growth_only(rule: Rule) -> Rule:
    """Mark a rule that finds nothing unless a counter it reads grew, or reset, within its
    window (it reads only ``ctx.signals``' growth): the scorer skips it for a node whose
    counters are all quiet (tests/unit/test_scoring_fast_path.py holds every marked rule to
    it)."""
    GROWTH_ONLY_RULES.add(rule)
    return rule


READS: dict[Callable[..., Iterable[Any]], frozenset[str]] = {}
"""Rules and counter sources marked with :func:`reads`: the batch fields each reads."""

_F = TypeVar("_F", bound=Callable[..., Iterable[Any]])


def reads(*fields: str) -> Callable[[_F], _F]:
    """Mark a rule (or counter source) whose output depends only on these fields of the
    batch (and the scoring config): not on ``ctx.signals``, the batch's time or any other
    field. The scorer reuses its previous output for a node while those fields are the
    very objects of the node's previous batch (ingest's decoder hands unchanged sections
    back as the same objects: proto/codec.py ``SectionReuse``);
    tests/unit/test_scoring_memo.py holds every marked function to its mark."""
    unknown = set(fields) - set(TelemetryBatch.__struct_fields__)
    if unknown:
        raise ValueError(f"no such TelemetryBatch fields: {sorted(unknown)}")

    def mark(fn: _F) -> _F:
        READS[fn] = frozenset(fields)
        return fn

    return mark


def finding(
    rule: str,
    severity: Severity,
    penalty: float,
    *,
    signal: str,
    value: float | str | bool | None,
    threshold: float | str | None,
    message: str,
) -> Finding:
    """A Finding of rule ``rule`` (its key in the config)."""
    reason = Reason(signal=signal, value=value, threshold=threshold, rule=rule, message=message)
    return Finding(reason=reason, severity=severity, penalty=penalty)


def flagged(
    key: str,
    rule: FlagRule,
    *,
    signal: str,
    value: float | str | bool | None,
    threshold: float | str | None = None,
    message: str,
) -> Finding:
    """A Finding of a single-level rule, with the rule's severity and penalty."""
    return finding(
        key,
        rule.severity,
        rule.penalty,
        signal=signal,
        value=value,
        threshold=threshold,
        message=message,
    )


def rate_finding(
    key: str,
    rule: RateRule,
    ctx: Context,
    counter: str,
    *,
    signal: str,
    what: str,
    subject: str,
) -> Finding | None:
    """The finding of rate rule ``key`` for ``counter``, if its rate reaches a level.

    The rate is the counter's growth over the rule's window, per hour of that window.
    """
    grown = ctx.signals.increase(counter, rule.window_s, ctx.now)
    return growth_rate_finding(key, rule, grown, signal=signal, what=what, subject=subject)


def growth_rate_finding(
    key: str,
    rule: RateRule,
    grown: int,
    *,
    signal: str,
    what: str,
    subject: str,
) -> Finding | None:
    """:func:`rate_finding` for a growth already summed over the rule's window (the
    counters of one component together)."""
    rate = grown * SECONDS_PER_HOUR / rule.window_s
    if rate >= rule.severe_threshold:
        severity: Severity = "severe"
        threshold, penalty = rule.severe_threshold, rule.severe_penalty
    elif rate >= rule.warning_threshold:
        severity = "warning"
        threshold, penalty = rule.warning_threshold, rule.warning_penalty
    else:
        return None
    message = (
        f"{subject}: {grown} {what} in the last {rule.window_s:g} s "
        f"({rate:.1f}/h, {severity} at {threshold:g}/h)"
    )
    return finding(
        key,
        severity,
        penalty,
        signal=signal,
        value=round(rate, 3),
        threshold=threshold,
        message=message,
    )


def plural(count: float, noun: str) -> str:
    """``1 error``, ``2 errors``."""
    return f"{count:g} {noun}" if count == 1 else f"{count:g} {noun}s"
