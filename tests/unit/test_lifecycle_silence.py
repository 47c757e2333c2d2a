"""The silence rule (docs/lifecycle.md, "Silence"): receiving time only, a floor in seconds
as well as in intervals, and the same rule through decide_silence (injected times)."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import pytest

from metalguard.controller.core.decide import decide_silence
from metalguard.controller.core.lifecycle import LifecycleConfig, check_silence, silence_limit_s
from metalguard.controller.core.receiving import Intake, heard, stalled
from metalguard.proto.base import NodeIdentity
from metalguard.proto.nodes import Grade, NodeRecord
from tests.support.clock import T0

CFG = LifecycleConfig()


def record(interval_s: float, seen: float = 0.0, grade: Grade = "HEALTHY") -> NodeRecord:
    node = NodeIdentity(region="r1", cluster="c1", node="n1")
    return NodeRecord(node=node, interval_s=interval_s, last_seen_ts=T0 + seen, grade=grade)


@pytest.mark.parametrize(
    ("interval_s", "limit"),
    [(0.5, 5.0), (1.0, 5.0), (5.0 / 3, 5.0), (2.0, 6.0), (10.0, 30.0)],
)
def test_the_limit_is_three_intervals_at_least_five_seconds(
    interval_s: float, limit: float
) -> None:
    assert silence_limit_s(interval_s, CFG) == pytest.approx(limit)


@dataclass(frozen=True)
class Case:
    name: str
    interval_s: float
    now: float
    """Seconds after the node's last batch (at T0)."""
    stalls: tuple[tuple[float, float], ...] = ()
    unreachable: bool = False
    rule: str = ""
    watching_since: float | None = None


CASES = [
    Case("1 s interval, 3 s quiet: the floor holds it", 1.0, 3.0),
    Case("1 s interval, 4.9 s quiet", 1.0, 4.9),
    Case(
        "1 s interval, 5 s quiet: the floor", 1.0, 5.0, unreachable=True, rule="unreachable_after_s"
    ),
    Case("10 s interval, 29 s", 10.0, 29.0),
    Case("10 s interval, 30 s", 10.0, 30.0, unreachable=True, rule="unreachable_after_intervals"),
    Case("a 15 s broker stall is not silence", 1.0, 17.0, stalls=((1.0, 16.0),)),
    Case(
        "silence before and after a stall adds up",
        1.0,
        19.0,
        stalls=((1.0, 15.0),),
        unreachable=True,
        rule="unreachable_after_s",
    ),
    Case("a stall still open: nothing judged", 1.0, 30.0, stalls=((2.0, 30.0),)),
    Case("a stall before the last batch changes nothing", 1.0, 4.0, stalls=((-20.0, -1.0),)),
    Case("a restarted controller's allowance", 1.0, 8.0, watching_since=4.0),
    Case(
        "allowance and a stall",
        1.0,
        13.0,
        stalls=((5.0, 10.0),),
        watching_since=4.0,
        unreachable=False,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_silence_counts_receiving_time_only(case: Case) -> None:
    stalls = tuple((T0 + a, T0 + b) for a, b in case.stalls)
    since = None if case.watching_since is None else T0 + case.watching_since
    t = check_silence(
        record(case.interval_s), T0 + case.now, CFG, stalls=stalls, watching_since=since
    )
    assert (t.record.grade == "UNREACHABLE") is case.unreachable
    if case.unreachable:
        (d,) = t.decisions
        assert d.kind == "node.unreachable"
        assert d.reasons[0].rule == case.rule
        value = d.reasons[0].value
        assert isinstance(value, float)
        assert value >= silence_limit_s(case.interval_s, CFG)
    else:
        assert t.decisions == ()


def test_the_reason_names_the_floor_and_the_stall_left_out() -> None:
    t = check_silence(record(1.0), T0 + 20.0, CFG, stalls=((T0 + 2.0, T0 + 16.0),))
    (d,) = t.decisions
    reason = d.reasons[0]
    assert reason.value == pytest.approx(6.0)
    assert reason.threshold == 5.0
    assert "no telemetry for 6 s" in reason.message
    assert "at least 5 s" in reason.message
    assert "14 s of the controller's own stalled intake not counted" in reason.message


def test_the_floor_is_configurable() -> None:
    cfg = LifecycleConfig.from_mapping({"unreachable_after_s": 0})
    assert check_silence(record(1.0), T0 + 3.0, cfg).record.grade == "UNREACHABLE"
    with pytest.raises(msgspec.ValidationError, match="unreachable_after_s"):
        LifecycleConfig.from_mapping({"unreachable_after_s": -1})


def test_decide_silence_after_a_broker_stall() -> None:
    """A fleet through a 15 s stall: live nodes' batches resume after it, a dead node's
    do not; only the dead one is judged, the threshold after the stall ended."""
    live = record(1.0, seen=34.0)
    dead = msgspec.structs.replace(
        record(1.0, seen=34.5), node=NodeIdentity(region="r1", cluster="c1", node="n2")
    )
    intake = Intake()
    for t in (33.0, 34.0, 34.5, 35.0):
        intake = heard(intake, T0 + t, 0)
    # frozen from 35 s to 50 s: no evidence; then the backlog, then drained
    records = {"r1.c1.n1": live, "r1.c1.n2": dead}
    during = decide_silence(records, T0 + 49.0, CFG, stalls=stalled(intake, T0 + 49.0))
    assert during.events == ()
    intake = heard(intake, T0 + 50.0, 30)
    for t in (50.4, 51.0, 52.0, 53.0, 54.0, 55.0):
        intake = heard(intake, T0 + t, 0)  # drained at 50.4, live since
    live = msgspec.structs.replace(live, last_seen_ts=T0 + 50.2)  # its spooled batches
    records = {"r1.c1.n1": live, "r1.c1.n2": dead}
    assert decide_silence(records, T0 + 54.0, CFG, stalls=stalled(intake, T0 + 54.0)).events == ()
    out = decide_silence(records, T0 + 55.0, CFG, stalls=stalled(intake, T0 + 55.0))
    assert [e.node.node for e in out.events if e.node] == ["n2"]
    assert out.records["r1.c1.n2"].grade == "UNREACHABLE"
