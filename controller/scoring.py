"""Scoring: a node's signal history and its new batch -> a score 0-100 with its reasons.

Pure: no I/O and no clock; the time of every sample is ``batch.ts``. The model
(docs/scoring.md): every rule in :mod:`controller.rules` turns readings into findings,
each a :class:`proto.base.Reason` with a severity and a penalty. The score is 100 minus
the penalties (the findings of one rule cost at most its ``max_penalty``), clamped to
0-100. The grade follows from the score, except that any fatal finding makes it FAILING.
Findings of severity ``info`` are notes: they explain, they cost nothing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import msgspec

from controller.rules import COUNTER_SOURCES, RULES, Context, Finding
from controller.rules.base import GROWTH_ONLY_RULES
from controller.scoring_config import (
    DEFAULT_SCORING,
    SEVERITIES,
    Grades,
    Rules,
    ScoringConfig,
)
from controller.scoring_signals import NodeSignals, fingerprint, take_in
from proto.base import Reason
from proto.nodes import Grade
from proto.telemetry import TelemetryBatch

FULL_SCORE = 100.0

__all__ = ["Assessment", "Finding", "NodeSignals", "assess", "grade_for", "summarize"]


class Assessment(msgspec.Struct, frozen=True, kw_only=True):
    """A node's health after one batch: score, grade and why."""

    score: float
    """0-100: 100 minus the penalties charged."""
    grade: Grade
    """HEALTHY, SUB_HEALTHY or FAILING."""
    fatal: bool
    """A fatal finding: FAILING whatever the score."""
    findings: tuple[Finding, ...] = ()
    """What costs points, most serious first; ``penalty`` is what each was charged."""
    notes: tuple[Reason, ...] = ()
    """Information that costs nothing (counter resets, an unreachable BMC)."""
    history_changed: bool = False
    """The batch changed a counter's value, sample count or resets: the history is worth
    persisting (a steady node's is not, though its time stamps moved)."""

    @property
    def reasons(self) -> tuple[Reason, ...]:
        """The reasons of the findings, sorted by severity then penalty."""
        return tuple(f.reason for f in self.findings)


def assess(
    signals: NodeSignals | None,
    batch: TelemetryBatch,
    config: ScoringConfig = DEFAULT_SCORING,
) -> tuple[NodeSignals, Assessment]:
    """Take ``batch`` into the node's history and score it.

    ``signals`` is what the previous call returned for this node (None for the first
    batch). Returns the new history, to pass with the next batch, and the assessment.
    """
    values: dict[str, int] = {}
    for source in COUNTER_SOURCES:
        values.update(source(batch))
    retention_s = _retention_s(config)
    updated, steady = take_in(
        signals,
        batch.ts,
        values,
        retention_s=retention_s,
        max_samples=config.history.max_samples_per_key,
    )
    ctx = Context(batch=batch, signals=updated, config=config)
    quiet = steady or updated.quiet_since(ctx.now - retention_s)
    rules = READING_RULES if quiet else RULES
    found = [item for rule in rules for item in rule(ctx)]
    assessment = summarize(found, config)
    if steady or fingerprint(updated) == fingerprint(signals):
        return updated, assessment
    return updated, msgspec.structs.replace(assessment, history_changed=True)


READING_RULES = tuple(rule for rule in RULES if rule not in GROWTH_ONLY_RULES)
"""The rules run for a node whose counters are all quiet (the growth-only rules would
find nothing: most nodes, most of the time)."""


_RETENTION: dict[int, tuple[ScoringConfig, float]] = {}


def _retention_s(config: ScoringConfig) -> float:
    """``config.retention_s()``, computed once per config object."""
    cached = _RETENTION.get(id(config))
    if cached is None or cached[0] is not config:
        cached = _RETENTION[id(config)] = (config, config.retention_s())
    return cached[1]


def summarize(found: Iterable[Finding], config: ScoringConfig = DEFAULT_SCORING) -> Assessment:
    """Sort ``found``, charge penalties within each rule's cap, and grade the result."""
    items = list(found)
    notes = [item.reason for item in items if item.severity == "info"]
    scored = sorted((item for item in items if item.severity != "info"), key=_rank)
    charged, total = _charge(scored, config.rules)
    score = min(FULL_SCORE, max(0.0, FULL_SCORE - total))
    fatal = any(item.severity == "fatal" for item in charged)
    return Assessment(
        score=score,
        grade=grade_for(score, fatal, config.grades),
        fatal=fatal,
        findings=tuple(charged),
        notes=tuple(sorted(notes, key=lambda r: (r.rule, r.signal, r.message))),
    )


def grade_for(score: float, fatal: bool, grades: Grades) -> Grade:
    """HEALTHY at or above ``healthy_min``, SUB_HEALTHY at or above ``sub_healthy_min``."""
    if fatal or score < grades.sub_healthy_min:
        return "FAILING"
    return "HEALTHY" if score >= grades.healthy_min else "SUB_HEALTHY"


def _rank(item: Finding) -> tuple[int, float, str, str, str]:
    reason = item.reason
    return (
        SEVERITIES.index(item.severity),
        -item.penalty,
        reason.rule,
        reason.signal,
        reason.message,
    )


def _charge(findings: list[Finding], rules: Rules) -> tuple[list[Finding], float]:
    """Each finding with the penalty it is charged, and the total charged.

    A rule's total is the sum of its penalties, at most its ``max_penalty``; summed with
    ``math.fsum`` so that one more finding can never lower it, whatever the order.
    """
    penalties: dict[str, list[float]] = {}
    for item in findings:
        penalties.setdefault(item.reason.rule, []).append(item.penalty)
    totals = {
        rule: min(rules.get(rule).max_penalty, math.fsum(values))
        for rule, values in penalties.items()
    }
    left = dict(totals)
    out: list[Finding] = []
    for item in findings:
        rule = item.reason.rule
        cost = min(item.penalty, max(0.0, left[rule]))
        left[rule] -= cost
        out.append(msgspec.structs.replace(item, penalty=cost))
    return out, math.fsum(totals.values())
