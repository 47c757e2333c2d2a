"""Scoring: a node's signal history and its new batch -> a score 0-100 with its reasons.

Pure: no I/O and no clock; the time of every sample is ``batch.ts``. The model
(docs/scoring.md): every rule in :mod:`controller.rules` turns readings into findings,
each a :class:`proto.base.Reason` with a severity and a penalty. The score is 100 minus
the penalties (the findings of one rule cost at most its ``max_penalty``), clamped to
0-100. The grade follows from the score, except that any fatal finding makes it FAILING.
Findings of severity ``info`` are notes: they explain, they cost nothing.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from metalguard.controller.core.rules import COUNTER_SOURCES, RULES, Context, Finding
from metalguard.controller.core.rules.base import GROWTH_ONLY_RULES, READS
from metalguard.controller.core.scoring.config import (
    DEFAULT_SCORING,
    SEVERITIES,
    Grades,
    Rules,
    ScoringConfig,
)
from metalguard.controller.core.scoring.signals import (
    NodeSignals,
    fingerprint,
    shared_key,
    take_in,
)
from metalguard.proto.base import Reason
from metalguard.proto.nodes import Grade
from metalguard.proto.telemetry import TelemetryBatch

FULL_SCORE = 100.0

__all__ = [
    "Assessment",
    "Finding",
    "NodeSignals",
    "ScoringMemo",
    "assess",
    "grade_for",
    "summarize",
]


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


class ScoringMemo:
    """What :func:`assess` may reuse for one node from the node's previous batch: the
    output of every function marked with :func:`controller.rules.base.reads` whose fields
    are the very objects they were (``is``, not ``==``: ingest's decoder hands unchanged
    sections back as the same objects), and the assessment of the same findings.

    One memo per node, passed to every ``assess`` of that node; results are exactly those
    of ``assess`` without it (tests/unit/test_scoring_memo.py).
    """

    __slots__ = ("assessment", "config", "fields", "found", "outputs", "read", "values")

    def __init__(self, stable: Iterable[str] | None = None) -> None:
        self.read = _reader(MEMO_FIELDS if stable is None else tuple(stable))
        """``stable``: the only fields that can come back as the same objects (the
        sections ingest's decoder reuses); the others are not kept between batches, and
        count as changed (None: every field some marked function reads)."""
        self.fields: tuple[object, ...] | None = None
        """The previous batch's values of those fields (only those: the rest of the
        batch is not kept)."""
        self.config: ScoringConfig | None = None
        self.outputs: list[tuple[object, ...] | None] = [None] * len(_SLOTS)
        """Each marked function's output for the previous batch, by its slot."""
        self.values: dict[str, int] | None = None
        """The counter values of the previous batch."""
        self.found: list[Finding] | None = None
        self.assessment: Assessment | None = None
        """The summary of ``found``."""

    def unchanged(self, batch: TelemetryBatch, config: ScoringConfig) -> frozenset[str]:
        """The fields of ``batch`` that are the previous batch's objects (under the same
        config object); then remembers ``batch``'s as the previous ones."""
        names, read = self.read
        now = read(batch)
        then, self.fields = self.fields, now
        if then is None or config is not self.config:
            self.config = config
            self.outputs = [None] * len(_SLOTS)
            self.found = self.assessment = None
            return frozenset()
        return frozenset([f for f, a, b in zip(names, now, then, strict=True) if a is b])

    def run(self, plan: Plan, unchanged: frozenset[str], arg: object) -> list[Any]:
        """Every function of ``plan`` called with ``arg``, outputs concatenated in order;
        a marked function whose fields are all ``unchanged`` gives its previous output."""
        outputs = self.outputs
        out: list[Any] = []
        for fn, slot, reusable in _steps(plan, unchanged):
            if reusable:
                kept = outputs[slot]
                if kept is not None:
                    out += kept
                    continue
            if slot < 0:
                out += fn(arg)
                continue
            fresh = outputs[slot] = tuple(fn(arg))
            out += fresh
        return out


@functools.cache
def _reader(stable: tuple[str, ...]) -> tuple[tuple[str, ...], Callable[[Any], tuple[Any, ...]]]:
    """The marked fields among ``stable`` and a getter of their values (a tuple)."""
    names = tuple(f for f in MEMO_FIELDS if f in stable)
    get = operator.attrgetter(*names) if names else (lambda _b: ())
    if len(names) == 1:
        one = get
        return names, lambda b: (one(b),)
    return names, get


_STEPS: dict[tuple[int, frozenset[str]], tuple[tuple[Any, int, bool], ...]] = {}


def _steps(plan: Plan, unchanged: frozenset[str]) -> tuple[tuple[Any, int, bool], ...]:
    """``plan``'s functions with their slots and whether their fields are all
    ``unchanged`` (a function with no slot: never), worked out once per field set."""
    key = (id(plan), unchanged)
    steps = _STEPS.get(key)
    if steps is None:
        if len(_STEPS) >= 4096:
            _STEPS.clear()
        steps = _STEPS[key] = tuple(
            (fn, slot, fields is not None and slot >= 0 and fields <= unchanged)
            for fn, fields, slot in plan
        )
    return steps


Plan = tuple[tuple[Callable[[Any], Iterable[Any]], frozenset[str] | None, int], ...]
"""Functions to call in order, each with the fields it reads (None: unmarked) and its
slot in :attr:`ScoringMemo.outputs`."""


def _plan(functions: Iterable[Callable[[Any], Iterable[Any]]]) -> Plan:
    return tuple((fn, READS.get(fn), _SLOTS.get(fn, -1)) for fn in functions)


_SLOTS: dict[object, int] = {
    fn: i for i, fn in enumerate(dict.fromkeys(f for f in RULES if f in READS))
}
"""A slot per marked function, in :attr:`ScoringMemo.outputs`."""
MEMO_FIELDS = tuple(sorted({f for fields in READS.values() for f in fields}))
"""The batch fields some marked function reads."""
_memo_fields = operator.attrgetter(*MEMO_FIELDS)


def assess(
    signals: NodeSignals | None,
    batch: TelemetryBatch,
    config: ScoringConfig = DEFAULT_SCORING,
    memo: ScoringMemo | None = None,
) -> tuple[NodeSignals, Assessment]:
    """Take ``batch`` into the node's history and score it.

    ``signals`` is what the previous call returned for this node (None for the first
    batch). Returns the new history, to pass with the next batch, and the assessment.
    ``memo``: the node's :class:`ScoringMemo`, which makes repeated work cheap without
    changing any result.
    """
    if memo is not None:
        return _assess_memo(signals, batch, config, memo)
    values: dict[str, int] = {}
    for source in COUNTER_SOURCES:
        values.update(source(batch))
    updated, steady, ctx, quiet = _take_in(signals, batch, values, config)
    rules = READING_RULES if quiet else RULES
    found = [item for rule in rules for item in rule(ctx)]
    return _result(signals, updated, steady, summarize(found, config))


def _assess_memo(
    signals: NodeSignals | None,
    batch: TelemetryBatch,
    config: ScoringConfig,
    memo: ScoringMemo,
) -> tuple[NodeSignals, Assessment]:
    """:func:`assess` reusing what ``memo`` holds (the same steps, in the same order)."""
    unchanged = memo.unchanged(batch, config)
    values = memo.values
    if values is None or not unchanged >= _COUNTER_FIELDS:
        # The sources' outputs are not kept (only the values; the keys shared with the
        # history's): they are rerun together when some counter section changed.
        values = memo.values = {
            shared_key(k): v for k, v in memo.run(_SOURCES_PLAN, unchanged, batch)
        }
    updated, steady, ctx, quiet = _take_in(signals, batch, values, config)
    found: list[Finding] = memo.run(_READING_PLAN if quiet else _RULES_PLAN, unchanged, ctx)
    previous = memo.found
    if (
        previous is not None
        and memo.assessment is not None
        and len(previous) == len(found)
        and all(a is b for a, b in zip(previous, found, strict=True))
    ):
        assessment = memo.assessment
    else:
        assessment = summarize(found, config)
        memo.found, memo.assessment = found, assessment
    return _result(signals, updated, steady, assessment)


def _take_in(
    signals: NodeSignals | None,
    batch: TelemetryBatch,
    values: dict[str, int],
    config: ScoringConfig,
) -> tuple[NodeSignals, bool, Context, bool]:
    """The batch's counter ``values`` taken into the history: (the new history, whether
    it is steady, the rules' context, whether every counter is quiet)."""
    retention_s = _retention_s(config)
    updated, steady = take_in(
        signals,
        batch.ts,
        values,
        retention_s=retention_s,
        max_samples=config.history.max_samples_per_key,
    )
    ctx = Context(batch=batch, signals=updated, config=config)
    return updated, steady, ctx, steady or updated.quiet_since(ctx.now - retention_s)


def _result(
    signals: NodeSignals | None, updated: NodeSignals, steady: bool, assessment: Assessment
) -> tuple[NodeSignals, Assessment]:
    """What :func:`assess` returns: ``assessment`` says whether the history changed."""
    if signals is None or not signals.counters:  # a first batch: changed if it has counters
        if not updated.counters:
            return updated, assessment
    elif steady or fingerprint(updated) == fingerprint(signals):
        return updated, assessment
    return updated, msgspec.structs.replace(assessment, history_changed=True)


READING_RULES = tuple(rule for rule in RULES if rule not in GROWTH_ONLY_RULES)
"""The rules run for a node whose counters are all quiet (the growth-only rules would
find nothing: most nodes, most of the time)."""
_SOURCES_PLAN: Plan = tuple((fn, None, -1) for fn in COUNTER_SOURCES)
_RULES_PLAN = _plan(RULES)
_READING_PLAN = _plan(READING_RULES)


_COUNTER_FIELDS = frozenset(f for source in COUNTER_SOURCES for f in READS.get(source, ("*",)))
"""The fields the counter sources read ("*": some source reads an unmarked field)."""

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
