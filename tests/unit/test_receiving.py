"""The controller's receiving time (controller/core/receiving.py): stalls from gaps in the
intake's evidence, the wait for the backlog, and silence measured over receiving time."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from metalguard.controller.core.receiving import (
    BACKLOG_WAIT_S,
    SPANS_KEPT,
    STALL_GAP_S,
    Intake,
    Span,
    heard,
    silence_s,
    stalled,
)
from tests.support.clock import T0

Evidence = tuple[float, int | None]
"""(seconds after T0, pending)."""


def replay(evidence: list[Evidence]) -> Intake:
    intake = Intake()
    for at, pending in evidence:
        intake = heard(intake, T0 + at, pending)
    return intake


def rel(spans: tuple[Span, ...]) -> list[tuple[float, float]]:
    return [(round(a - T0, 3), round(b - T0, 3)) for a, b in spans]


@dataclass(frozen=True)
class Case:
    name: str
    evidence: list[Evidence]
    now: float
    stalls: list[tuple[float, float]]
    catching_up: bool = False


STEADY: list[Evidence] = [(t * 0.5, 0) for t in range(21)]  # every 0.5 s for 10 s, nothing pending

CASES = [
    Case("nothing heard: no stall known", [], 100.0, []),
    Case("steady evidence: no stall", STEADY, 10.2, []),
    Case("a short gap is no stall", [(0, 0), (STALL_GAP_S, 0)], STALL_GAP_S + 0.1, []),
    Case("quiet now, past the gap: stalled up to now", [(0, 0), (1, 0)], 9.0, [(1, 9)]),
    Case("quiet now, within the gap: not yet", [(0, 0), (1, 0)], 1 + STALL_GAP_S, []),
    Case("a gap drained at once: closed", [(0, 0), (1, 0), (16, 0)], 17.0, [(1, 16)]),
    Case(
        "a gap with a backlog: stalled until drained",
        [(0, 0), (1, 0), (16, 40), (16.5, 12), (17, 0)],
        18.0,
        [(1, 17)],
    ),
    Case(
        "backlog still pending: stalled up to now",
        [(0, 0), (1, 0), (16, 40), (16.5, 12)],
        18.0,
        [(1, 18)],
        catching_up=True,
    ),
    Case(
        "pending unknown after a gap: waits for a count",
        [(0, 0), (1, 0), (16, None), (16.5, None)],
        17.0,
        [(1, 17)],
        catching_up=True,
    ),
    Case(
        "a backlog that never drains ends after the wait",
        [(0, 0), (1, 0), (16, 9), *[(16 + i, 9) for i in range(1, int(BACKLOG_WAIT_S) + 2)]],
        16 + BACKLOG_WAIT_S + 2,
        [(1, 16 + BACKLOG_WAIT_S)],
    ),
    Case(
        "two stalls",
        [(0, 0), (1, 0), (10, 0), (11, 0), (30, 5), (31, 0)],
        31.5,
        [(1, 10), (11, 31)],
    ),
    Case(
        "late evidence (older than the newest) changes nothing", [(0, 0), (2, 0), (1, 0)], 3.0, []
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_stalls_from_the_evidence(case: Case) -> None:
    intake = replay(case.evidence)
    assert rel(stalled(intake, T0 + case.now)) == case.stalls
    assert intake.catching_up is case.catching_up


@pytest.mark.parametrize(
    ("since", "now", "stalls", "want"),
    [
        (0, 10, [], 10),
        (0, 10, [(2, 5)], 7),
        (0, 10, [(2, 5), (4, 8)], 4),  # overlapping stalls count once
        (0, 10, [(-5, 3)], 7),  # a stall that began before the node's last batch
        (0, 10, [(-9, -1)], 10),  # one that ended before it: nothing
        (0, 10, [(8, 12)], 8),  # one still open past now
        (0, 10, [(0, 10)], 0),
        (5, 3, [], 0),  # now before since
        (0, 10, [(6, 7), (1, 2)], 8),  # unordered
    ],
)
def test_silence_is_receiving_time_only(
    since: float, now: float, stalls: list[tuple[float, float]], want: float
) -> None:
    spans = [(T0 + a, T0 + b) for a, b in stalls]
    assert silence_s(T0 + since, T0 + now, spans) == pytest.approx(want)


def test_the_stalls_kept_are_bounded() -> None:
    intake = Intake()
    t = T0
    for _ in range(SPANS_KEPT + 50):
        intake = heard(intake, t, 0)
        t += STALL_GAP_S * 2
        intake = heard(intake, t, 0)
        t += 0.5
    assert len(intake.stalls) == SPANS_KEPT
    assert intake.stalls[-1][1] == t - 0.5
