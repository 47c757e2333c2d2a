"""The node state machine over injected time: transitions, hysteresis, unreachable,
operator actions, repeat offenders, restart safety (docs/lifecycle.md)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metalguard.controller.core.lifecycle import (
    KIND_ENTERING,
    SECONDS_PER_DAY,
    AssessedGrade,
    Decision,
    LifecycleConfig,
    Observation,
    OperatorAction,
    Transition,
    accepts_new_work,
    check_silence,
    observe,
    operator,
    to_event,
    update_jobs,
)
from metalguard.proto.base import NodeIdentity, Reason
from metalguard.proto.codec import decode, encode
from metalguard.proto.events import CONTROLLER_EVENT_KINDS, ControllerEvent
from metalguard.proto.nodes import NodeRecord

CFG = LifecycleConfig()
INTERVAL = 10.0
NODE = NodeIdentity(region="r1", cluster="c1", node="n1")
SCORES = {"H": 95.0, "S": 65.0, "F": 30.0, "X": 90.0}
"""Observation steps: clean, sub-healthy, failing, fatal (with a high score)."""
GRADE_OF: dict[str, AssessedGrade] = {
    "H": "HEALTHY",
    "S": "SUB_HEALTHY",
    "F": "FAILING",
    "X": "FAILING",
}
OPERATOR_ACTIONS: dict[str, OperatorAction] = {
    "cordon": "cordon",
    "uncordon": "uncordon",
    "maintenance": "maintenance",
}
FAULT = Reason(signal="edac.ce_rate", value=40.0, threshold=10.0, rule="ecc", message="ECC")


def fresh(**fields: Any) -> NodeRecord:
    return NodeRecord(node=NODE, interval_s=INTERVAL, **fields)


def obs(step: str, ts: float, seq: int, jobs: int | None = None) -> Observation:
    return Observation(
        ts=ts,
        seq=seq,
        score=SCORES[step],
        grade=GRADE_OF[step],
        fatal=step == "X",
        reasons=() if step == "H" else (FAULT,),
        interval_s=INTERVAL,
        running_jobs=jobs,
        sent_ts=ts,
    )


@dataclass
class Run:
    """A node driven through steps at injected times (isolations always allowed)."""

    record: NodeRecord
    cfg: LifecycleConfig = CFG
    now: float = 1_000.0
    seq: int = 0
    decisions: list[Decision] = field(default_factory=list)

    def step(self, step: str) -> Transition:
        """``H S F X``: an assessment one interval later; ``gap``: 4 intervals of
        silence, then a silence check; ``jobs:N``; ``day:N``: N days pass; ``cordon``,
        ``uncordon``, ``maintenance``: an operator's action."""
        name, _, arg = step.partition(":")
        if name in SCORES:
            self.now += INTERVAL
            self.seq += 1
            t = observe(self.record, obs(name, self.now, self.seq), self.cfg)
        elif name == "gap":
            self.now += 4 * INTERVAL
            t = check_silence(self.record, self.now, self.cfg)
        elif name == "jobs":
            t = update_jobs(self.record, int(arg), self.now, self.cfg)
        elif name == "day":
            self.now += float(arg) * SECONDS_PER_DAY
            t = Transition(self.record)
        elif name in OPERATOR_ACTIONS:
            self.now += 1
            action = OPERATOR_ACTIONS[name]
            t = operator(self.record, action, f"ticket {name}", "alice", self.now, self.cfg)
        else:
            raise AssertionError(step)
        self.record = t.record  # the rail allows every isolation here
        self.decisions.extend(t.decisions)
        return t

    def run(self, steps: list[str]) -> Run:
        for s in steps:
            self.step(s)
        return self

    @property
    def kinds(self) -> list[str]:
        return [d.kind for d in self.decisions]


def cycles(n: int) -> list[str]:
    """n isolations, each followed by a recovery (3 clean assessments)."""
    return ["F", "H", "H", "H"] * n


ISO, SUB, MNT, RET = "node.isolated", "node.sub_healthy", "node.maintenance", "node.returned"
UNR, HELD, COR, UNC = "node.unreachable", "node.held", "node.cordoned", "node.uncordoned"
TWICE = [ISO, RET] * 2
HELD_3RD = [*TWICE, ISO, HELD]
FORGOTTEN = [*HELD_3RD, UNC, *TWICE]
"""Two isolations with recoveries; the third, which holds the node; after an uncordon."""

# (name, start jobs, steps, final grade, decision kinds)
TABLE: list[tuple[str, int, list[str], str, list[str]]] = [
    # plain transitions
    ("clean stays quiet", 2, ["H", "H", "H"], "HEALTHY", []),
    ("healthy -> sub-healthy", 2, ["S"], "SUB_HEALTHY", [SUB]),
    ("sub-healthy again is quiet", 2, ["S", "S"], "SUB_HEALTHY", [SUB]),
    ("idle sub-healthy is announced first", 0, ["S"], "SUB_HEALTHY", [SUB]),
    ("idle sub-healthy -> maintenance", 0, ["S", "S"], "MAINTENANCE", [SUB, MNT]),
    ("sub-healthy empties -> maintenance", 2, ["S", "jobs:0"], "MAINTENANCE", [SUB, MNT]),
    ("healthy node losing jobs stays", 2, ["jobs:0", "H"], "HEALTHY", []),
    ("healthy -> failing", 2, ["F"], "FAILING", [ISO]),
    ("fatal with a high score fails", 2, ["X"], "FAILING", [ISO]),
    ("failing again is quiet", 2, ["F", "F", "X"], "FAILING", [ISO]),
    ("sub-healthy -> failing", 2, ["S", "F"], "FAILING", [SUB, ISO]),
    ("failing does not soften to sub-healthy", 2, ["F", "S"], "FAILING", [ISO]),
    ("maintenance -> failing", 0, ["S", "S", "F"], "FAILING", [SUB, MNT, ISO]),
    # hysteresis (N = 3)
    ("failing: N-1 clean not enough", 2, ["F", "H", "H"], "FAILING", [ISO]),
    ("failing: N clean return", 2, ["F", "H", "H", "H"], "HEALTHY", [ISO, RET]),
    ("failing: a fault resets", 2, ["F", "H", "H", "S", "H", "H"], "FAILING", [ISO]),
    ("failing: reset then N", 2, ["F", "H", "H", "S", "H", "H", "H"], "HEALTHY", [ISO, RET]),
    ("sub-healthy: N-1 not enough", 2, ["S", "H", "H"], "SUB_HEALTHY", [SUB]),
    ("sub-healthy: N clean return", 2, ["S", "H", "H", "H"], "HEALTHY", [SUB, RET]),
    ("sub-healthy: a fault resets", 2, ["S", "H", "H", "S", "H", "H"], "SUB_HEALTHY", [SUB]),
    ("maintenance: N clean return", 0, ["S", "S", "H", "H", "H"], "HEALTHY", [SUB, MNT, RET]),
    # unreachable
    ("silence -> unreachable", 2, ["H", "gap"], "UNREACHABLE", [UNR]),
    ("silence announced once", 2, ["H", "gap", "gap"], "UNREACHABLE", [UNR]),
    ("never seen: no verdict", 2, ["gap"], "HEALTHY", []),
    ("back healthy at once", 2, ["H", "gap", "H"], "HEALTHY", [UNR, RET]),
    ("back sub-healthy", 2, ["H", "gap", "S"], "SUB_HEALTHY", [UNR, SUB]),
    ("back failing", 2, ["H", "gap", "F"], "FAILING", [UNR, ISO]),
    ("sub-healthy keeps its probation", 2, ["S", "gap", "H"], "SUB_HEALTHY", [SUB, UNR, SUB]),
    ("probation completes", 2, ["S", "gap", "H", "H", "H"], "HEALTHY", [SUB, UNR, SUB, RET]),
    ("failing node silent stays failing", 2, ["F", "gap"], "FAILING", [ISO]),
    ("maintenance node silent stays", 0, ["S", "S", "gap"], "MAINTENANCE", [SUB, MNT]),
    # operators
    ("cordon", 2, ["cordon"], "HEALTHY", [COR]),
    ("cordon twice is one", 2, ["cordon", "cordon", "H"], "HEALTHY", [COR]),
    ("cordon does not stop isolation", 2, ["cordon", "F"], "FAILING", [COR, ISO]),
    ("maintenance", 2, ["maintenance"], "MAINTENANCE", [MNT]),
    ("maintenance ignores faults", 2, ["maintenance", "X", "H", "H", "H"], "MAINTENANCE", [MNT]),
    ("maintenance stays when silent", 2, ["H", "maintenance", "gap"], "MAINTENANCE", [MNT]),
    ("cordon inside maintenance", 2, ["maintenance", "cordon"], "MAINTENANCE", [MNT]),
    ("uncordon after maintenance", 2, ["maintenance", "uncordon"], "HEALTHY", [MNT, UNC]),
    ("uncordon skips hysteresis", 2, ["F", "uncordon"], "HEALTHY", [ISO, UNC]),
    ("uncordon of a clean node", 2, ["uncordon"], "HEALTHY", []),
    ("uncordon while silent", 2, ["H", "gap", "uncordon"], "UNREACHABLE", [UNR]),
    ("uncordon ends probation", 2, ["S", "gap", "uncordon", "H"], "HEALTHY", [SUB, UNR, UNC, RET]),
    ("after uncordon faults count", 2, ["F", "uncordon", "F"], "FAILING", [ISO, UNC, ISO]),
    # repeat offenders (K = 3 within D = 7 days)
    ("K-1 isolations: not held", 2, cycles(2), "HEALTHY", TWICE),
    ("K-th isolation: held", 2, cycles(3), "FAILING", HELD_3RD),
    ("held stays out", 2, [*cycles(3), "H", "H", "H", "H"], "FAILING", HELD_3RD),
    ("held stays when silent", 2, [*cycles(3), "gap"], "FAILING", HELD_3RD),
    ("old isolations forgotten", 2, [*cycles(1), "day:8", *cycles(2)], "HEALTHY", [ISO, RET] * 3),
    ("just inside D days", 2, [*cycles(1), "day:6.9", *cycles(2)], "FAILING", HELD_3RD),
    ("uncordon frees held", 2, [*cycles(3), "uncordon", "H"], "HEALTHY", [*HELD_3RD, UNC]),
    ("uncordon forgets", 2, [*cycles(3), "uncordon", *cycles(2)], "HEALTHY", FORGOTTEN),
]  # fmt: skip


@pytest.mark.parametrize(
    ("jobs", "steps", "grade", "kinds"), [t[1:] for t in TABLE], ids=[t[0] for t in TABLE]
)
def test_state_machine(jobs: int, steps: list[str], grade: str, kinds: list[str]) -> None:
    run = Run(fresh(running_jobs=jobs)).run(steps)
    assert run.record.grade == grade
    assert run.kinds == kinds
    assert set(run.kinds) <= CONTROLLER_EVENT_KINDS
    changes = [(c.grade_from, c.grade_to) for c in run.record.history]
    assert all(a != b for a, b in changes), "history holds grade changes only"
    assert [c.grade_to for c in run.record.history][-1:] in ([], [grade])


def test_every_kind_is_documented() -> None:
    assert set(KIND_ENTERING.values()) | {HELD, COR, UNC, "rail.tripped"} <= CONTROLLER_EVENT_KINDS


# --- what the decisions say -----------------------------------------------------------


def test_isolation_names_its_reasons_and_action() -> None:
    run = Run(fresh(running_jobs=2)).run(["H", "X"])
    (d,) = run.decisions
    assert (d.kind, d.grade_from, d.grade_to, d.action) == (ISO, "HEALTHY", "FAILING", "isolate")
    assert d.reasons == (FAULT,)
    assert d.attributes["fatal"] is True
    assert d.node == NODE
    assert (d.region, d.cluster) == ("r1", "c1")
    assert run.record.history[-1].reasons == (FAULT,)
    assert not accepts_new_work(run.record)


def test_return_releases_only_out_of_service_nodes() -> None:
    failing = Run(fresh(running_jobs=2)).run(["F", "H", "H", "H"])
    assert failing.decisions[-1].action == "release"
    assert failing.decisions[-1].reasons[0].rule == "clean_cycles_to_recover"
    sub = Run(fresh(running_jobs=2)).run(["S", "H", "H", "H"])
    assert sub.decisions[-1].action is None
    assert accepts_new_work(sub.record)


def test_score_and_reasons_update_without_events() -> None:
    run = Run(fresh(running_jobs=2)).run(["S"])
    t = run.step("S")
    assert t.decisions == ()
    assert t.record.score == SCORES["S"]
    assert t.record.reasons == (FAULT,)
    t = run.step("H")
    assert t.decisions == ()
    assert t.record.reasons == ()
    assert t.record.clean_cycles == 1


@pytest.mark.parametrize(
    ("bmc", "words"),
    [
        (None, "no out-of-band reading"),
        (True, "the BMC says it is powered on"),
        (False, "the BMC says it is powered off"),
    ],
)
def test_unreachable_cross_checks_the_bmc(bmc: bool | None, words: str) -> None:
    rec = Run(fresh()).run(["H"]).record
    seen = rec.last_seen_ts
    assert seen is not None
    assert check_silence(rec, seen + 29.9, CFG, bmc_power_on=bmc).decisions == ()
    t = check_silence(rec, seen + 30.0, CFG, bmc_power_on=bmc)
    (d,) = t.decisions
    assert d.kind == UNR
    assert d.action is None
    assert words in d.message
    assert d.reasons[0].rule == "unreachable_after_intervals"
    assert d.reasons[0].threshold == 30.0
    assert [r.signal for r in d.reasons[1:]] == ([] if bmc is None else ["bmc.power_on"])
    assert t.record.grade == "UNREACHABLE"
    assert t.record.unreachable_from == "HEALTHY"
    assert not accepts_new_work(t.record)


@pytest.mark.parametrize(
    ("action", "want_action", "cordoned", "maintenance"),
    [("cordon", None, True, False), ("maintenance", "isolate", True, True)],
)
def test_operator_actions_carry_who_and_why(
    action: OperatorAction, want_action: str | None, cordoned: bool, maintenance: bool
) -> None:
    t = operator(fresh(running_jobs=1), action, "swap DIMM A3", "alice", 50.0, CFG)
    (d,) = t.decisions
    assert (d.by, d.action) == ("operator:alice", want_action)
    assert "alice" in d.message
    assert "swap DIMM A3" in d.message
    assert d.reasons[0].message == "swap DIMM A3"
    rec = t.record
    assert (rec.cordoned, rec.maintenance, rec.operator_by) == (
        cordoned,
        maintenance,
        "operator:alice",
    )
    assert (rec.operator_reason, rec.operator_ts) == ("swap DIMM A3", 50.0)
    assert not accepts_new_work(rec)
    again = operator(rec, action, "new ticket", "bob", 60.0, CFG)
    assert again.decisions[0].message.endswith(("new ticket", "running jobs continue"))
    assert again.record.operator_ts == 50.0, "a restated reason keeps the start time"


def test_uncordon_clears_everything_and_records_the_operator() -> None:
    run = Run(fresh(running_jobs=2)).run([*cycles(3), "cordon"])
    assert run.record.held
    assert run.record.cordoned
    assert len(run.record.isolations) == 3
    t = run.step("uncordon")
    (d,) = t.decisions
    assert (d.kind, d.grade_from, d.grade_to, d.action) == (UNC, "FAILING", "HEALTHY", "release")
    rec = t.record
    assert (rec.held, rec.cordoned, rec.isolations, rec.operator_reason) == (False, False, (), "")
    assert rec.history[-1].by == "operator:alice"
    assert accepts_new_work(rec)


def test_history_is_bounded() -> None:
    cfg = LifecycleConfig(history_max=4, repeat_offender_count=100)
    run = Run(fresh(running_jobs=2), cfg=cfg).run(cycles(5))
    assert len(run.record.history) == 4
    assert run.record.history[-1].grade_to == "HEALTHY"


def test_running_jobs_from_the_observation() -> None:
    rec = Run(fresh(running_jobs=3)).run(["S"]).record
    t = observe(rec, obs("S", 2_000.0, 99, jobs=0), CFG)
    assert t.record.grade == "MAINTENANCE"
    assert [d.kind for d in t.decisions] == [MNT]


def test_config_is_validated() -> None:
    assert LifecycleConfig.from_mapping({"rail_max_fraction": 0.2}).rail_max_fraction == 0.2
    with pytest.raises(msgspec.ValidationError, match="rail_max_fractio"):
        LifecycleConfig.from_mapping({"rail_max_fractio": 0.2})
    with pytest.raises(msgspec.ValidationError, match="clean_cycles_to_recover"):
        LifecycleConfig.from_mapping({"clean_cycles_to_recover": 0})


def test_to_event() -> None:
    (d,) = Run(fresh()).run(["F"]).decisions
    ev = decode(encode(to_event(d, "e-1")), ControllerEvent)
    assert (ev.event_id, ev.region, ev.kind, ev.node, ev.reasons) == (
        "e-1",
        "r1",
        ISO,
        NODE,
        (FAULT,),
    )
    assert ev.attributes["grade_from"] == "HEALTHY"
    assert ev.attributes["action"] == "isolate"
    assert ev.attributes["cluster"] == "c1"
    assert ev.attributes["fatal"] is False


# --- restart safety -------------------------------------------------------------------


def reload(rec: NodeRecord) -> NodeRecord:
    return decode(encode(rec), NodeRecord)


STORY = ["H", "S", "H", "F", "H", "gap", "H", "H", "cordon", "S", "uncordon", *cycles(3), "H"]


def test_reloaded_records_decide_identically() -> None:
    memory = Run(fresh(running_jobs=2)).run(STORY)
    stored = Run(fresh(running_jobs=2))
    for s in STORY:
        stored.step(s)
        stored.record = reload(stored.record)
    assert stored.decisions == memory.decisions
    assert stored.record == memory.record


@pytest.mark.parametrize("upto", range(1, len(STORY) + 1))
def test_a_replayed_assessment_changes_nothing(upto: int) -> None:
    run = Run(fresh(running_jobs=2)).run(STORY[:upto])
    if run.seq == 0:
        return
    last = STORY[:upto][max(i for i, s in enumerate(STORY[:upto]) if s in SCORES)]
    sent = run.record.last_sent_ts
    replay = dataclasses.replace(obs(last, run.now + 100, run.seq), sent_ts=sent)  # redelivered
    t = observe(reload(run.record), replay, CFG)
    assert t.decisions == ()
    assert t.record == run.record


def test_an_agent_that_lost_its_seq_is_heard() -> None:
    rec = Run(fresh(running_jobs=2)).run(["H"] * 5).record
    reset = dataclasses.replace(obs("F", 2_000.0, 1), sent_ts=None)
    assert observe(rec, reset, CFG).decisions == (), "no newer batch time: a replay"
    t = observe(rec, obs("F", 2_000.0, 1), CFG)
    assert [d.kind for d in t.decisions] == [ISO]
    assert t.record.last_seq == 1


@pytest.mark.parametrize(
    ("bad", "late_clean_sent", "grade_after_late", "fresh_clean_to_return"),
    [
        ("X", (98.0, 99.0, 100.0), "FAILING", 3),  # spooled before a fatal event
        ("F", (98.0, 99.0), "FAILING", 3),
        ("S", (98.0, 99.0, 100.0), "SUB_HEALTHY", 3),
    ],
)
def test_clean_batches_collected_before_the_evidence_are_no_clean_cycles(
    bad: str, late_clean_sent: tuple[float, ...], grade_after_late: str, fresh_clean_to_return: int
) -> None:
    """A node found bad at its time 100 (an event, or a batch) is not returned to service
    by clean batches it collected before that (its spool, delivered late with higher
    ``seq``s); clean batches collected after it count as usual."""
    rec = Run(fresh(running_jobs=1)).run(["H"] * 3).record
    seq = rec.last_seq
    t = observe(rec, dataclasses.replace(obs(bad, 1_000.0, seq + 1), sent_ts=100.0), CFG)
    rec = t.record
    assert rec.grade == grade_after_late
    assert rec.bad_sent_ts == 100.0
    seq = rec.last_seq
    for i, sent in enumerate(late_clean_sent):
        seq += 1
        t = observe(rec, dataclasses.replace(obs("H", 1_001.0 + i, seq), sent_ts=sent), CFG)
        assert t.decisions == (), sent
        assert t.record.grade == grade_after_late
        assert t.record.clean_cycles == 0
        assert t.record.score == rec.score  # the evidence stands
        assert t.record.last_seen_ts == 1_001.0 + i  # but the node is alive
        rec = t.record
    kinds: list[str] = []
    for i in range(fresh_clean_to_return):
        seq += 1
        t = observe(rec, dataclasses.replace(obs("H", 1_100.0 + i, seq), sent_ts=101.0 + i), CFG)
        kinds += [d.kind for d in t.decisions]
        rec = t.record
    assert rec.grade == "HEALTHY"
    assert "node.returned" in kinds


# --- properties -----------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    gaps=st.lists(
        st.floats(min_value=0.0, max_value=30 * SECONDS_PER_DAY), min_size=1, max_size=30
    ),
    seq_steps=st.lists(st.integers(min_value=-2, max_value=3), min_size=30, max_size=30),
    jobs=st.integers(min_value=0, max_value=3),
)
def test_a_healthy_node_with_clean_assessments_never_speaks(
    gaps: list[float], seq_steps: list[int], jobs: int
) -> None:
    rec, now, seq = fresh(running_jobs=jobs), 0.0, 0
    for gap, ds in zip(gaps, seq_steps, strict=False):
        now, seq = now + gap, max(0, seq + ds)
        t = observe(rec, obs("H", now, seq), CFG)
        assert t.decisions == ()
        assert not t.wants_isolation
        rec = t.record
        assert rec.grade == "HEALTHY"
        assert accepts_new_work(rec)
