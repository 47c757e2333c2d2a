"""The safety rail over injected time: share, window, one alert, small clusters,
persistence, and the invariant that no sequence ever isolates more than it allows."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metalguard.controller.core.lifecycle import (
    AssessedGrade,
    Decision,
    LifecycleConfig,
    Observation,
    Transition,
    accepts_new_work,
    check_silence,
    observe,
    operator,
    to_event,
)
from metalguard.controller.core.rail import apply_rail, rail_limit
from metalguard.proto.base import NodeIdentity, Reason
from metalguard.proto.codec import decode, encode
from metalguard.proto.events import ControllerEvent
from metalguard.proto.nodes import NodeRecord, RailState

CFG = LifecycleConfig()
WINDOW = CFG.rail_window_s
INTERVAL = 10.0
FAULT = Reason(signal="pcie.aer_fatal", value=1, rule="aer", message="fatal AER")


def cluster(size: int) -> dict[str, NodeRecord]:
    return {
        f"n{i:02d}": NodeRecord(
            node=NodeIdentity(region="r1", cluster="c1", node=f"n{i:02d}"),
            interval_s=INTERVAL,
            running_jobs=1,
        )
        for i in range(size)
    }


def assess(
    grade: AssessedGrade,
    ts: float,
    seq: int,
    score: float | None = None,
    fatal: bool = False,
    sent: float | None = None,
) -> Observation:
    default = {"HEALTHY": 95.0, "SUB_HEALTHY": 65.0, "FAILING": 20.0}[grade]
    return Observation(
        ts=ts,
        seq=seq,
        score=default if score is None else score,
        grade=grade,
        fatal=fatal,
        reasons=() if grade == "HEALTHY" else (FAULT,),
        interval_s=INTERVAL,
        sent_ts=ts if sent is None else sent,
    )


class Fleet:
    """One cluster's records and rail, driven round by round through the lifecycle."""

    def __init__(self, size: int, cfg: LifecycleConfig = CFG) -> None:
        self.records = cluster(size)
        self.rail = RailState(region="r1", cluster="c1")
        self.cfg = cfg
        self.seq = 0
        self.alerts: list[Decision] = []
        self.isolated: list[tuple[float, str]] = []

    def round(
        self,
        now: float,
        grades: dict[str, AssessedGrade],
        scores: dict[str, float] | None = None,
        sent: float | None = None,
    ) -> list[Transition]:
        """Every named node reports at ``now`` (batches stamped ``sent``); others are silent."""
        self.seq += 1
        scores = scores or {}
        wanted = [
            observe(self.records[n], assess(g, now, self.seq, scores.get(n), sent=sent), self.cfg)
            for n, g in grades.items()
        ]
        result = apply_rail(self.rail, len(self.records), wanted, now, self.cfg)
        self.rail = result.state
        self.alerts.extend(result.alerts)
        for t in result.transitions:
            assert not t.wants_isolation
            self.records[t.record.node.node] = t.record
            self.isolated += [
                (now, t.record.node.node) for d in t.decisions if d.kind == "node.isolated"
            ]
        return result.transitions

    def grade(self, name: str) -> str:
        return self.records[name].grade


@pytest.mark.parametrize(
    ("size", "fraction", "min_nodes", "limit"),
    [
        (20, 0.10, 1, 2),
        (25, 0.10, 1, 2),  # 2.5 rounds down
        (100, 0.10, 1, 10),
        (100, 0.29, 1, 29),  # 28.999... is 29
        (10, 0.30, 1, 3),  # 3.0000000000000004 is 3
        (5, 0.10, 1, 1),  # 0.5: the minimum
        (5, 0.10, 0, 0),  # no minimum: a small cluster never auto-isolates
        (5, 0.10, 3, 3),
        (2, 0.10, 3, 2),  # never more than the cluster
        (1, 0.10, 1, 1),
        (0, 0.10, 1, 0),
        (10, 1.0, 1, 10),
        (10, 0.0, 1, 1),
    ],
)
def test_rail_limit(size: int, fraction: float, min_nodes: int, limit: int) -> None:
    cfg = LifecycleConfig(rail_max_fraction=fraction, rail_min_nodes=min_nodes)
    assert rail_limit(size, cfg) == limit


def test_thirty_percent_at_once_isolates_ten_percent_and_alerts_once() -> None:
    fleet = Fleet(20)
    failing: dict[str, AssessedGrade] = {f"n{i:02d}": "FAILING" for i in range(6)}
    scores = {"n00": 40.0, "n01": 10.0, "n02": 30.0, "n03": 5.0, "n04": 45.0, "n05": 35.0}
    fleet.round(1_000.0, {**failing, "n10": "HEALTHY"}, scores)
    # the lowest scores win the two slots (test_fatal_goes_first: fatal before them)
    assert sorted(n for _, n in fleet.isolated) == ["n01", "n03"]
    flagged = [n for n, r in fleet.records.items() if r.rail_flagged]
    assert flagged == ["n00", "n02", "n04", "n05"]
    for name in flagged:
        rec = fleet.records[name]
        assert rec.grade == "HEALTHY"
        assert rec.reasons == (FAULT,)
        assert not accepts_new_work(rec)
        assert rec.isolations == ()
        assert not rec.held
    (alert,) = fleet.alerts
    assert (alert.kind, alert.node, alert.cluster, alert.by) == ("rail.tripped", None, "c1", "rail")
    assert alert.attributes["flagged"] == 4
    assert alert.attributes["limit"] == 2
    assert "n00, n02, n04, n05" in alert.message
    event = decode(encode(to_event(alert, "rail-1")), ControllerEvent)
    assert (event.kind, event.region, event.attributes["cluster"]) == ("rail.tripped", "r1", "c1")
    assert alert.reasons[0].value == 2
    assert alert.reasons[0].threshold == 2
    assert fleet.rail.isolations == (1_000.0, 1_000.0)
    assert fleet.rail.tripped_ts == 1_000.0


def test_fatal_goes_first() -> None:
    fleet = Fleet(5)
    fleet.seq += 1
    wanted = [
        observe(fleet.records["n00"], assess("FAILING", 10.0, 1, score=1.0), CFG),
        observe(fleet.records["n01"], assess("FAILING", 10.0, 1, score=90.0, fatal=True), CFG),
    ]
    result = apply_rail(fleet.rail, 5, wanted, 10.0, CFG)
    assert [t.record.grade for t in result.transitions] == ["HEALTHY", "FAILING"]


def test_later_refusals_in_the_window_stay_quiet() -> None:
    fleet = Fleet(20)
    fleet.round(0.0, {"n00": "FAILING", "n01": "FAILING", "n02": "FAILING"})
    assert len(fleet.alerts) == 1
    fleet.round(600.0, {"n03": "FAILING", "n02": "FAILING"})
    assert len(fleet.alerts) == 1
    assert len(fleet.isolated) == 2
    assert fleet.records["n03"].rail_flagged
    assert fleet.grade("n03") == "HEALTHY"


def test_window_expiry_frees_capacity_for_flagged_nodes() -> None:
    fleet = Fleet(20)
    fleet.round(0.0, {f"n{i:02d}": "FAILING" for i in range(4)})
    assert len(fleet.isolated) == 2
    fleet.round(WINDOW - 1, {"n02": "FAILING", "n03": "FAILING"})
    assert len(fleet.isolated) == 2, "still inside the window"
    fleet.round(WINDOW, {"n02": "FAILING", "n03": "FAILING"})
    assert sorted(n for _, n in fleet.isolated[2:]) == ["n02", "n03"]
    assert not fleet.records["n02"].rail_flagged
    assert fleet.grade("n02") == "FAILING"
    assert len(fleet.alerts) == 1
    assert fleet.rail.isolations == (WINDOW, WINDOW)


def test_a_new_window_raises_a_new_alert() -> None:
    fleet = Fleet(20)
    fleet.round(0.0, {f"n{i:02d}": "FAILING" for i in range(3)})
    fleet.round(WINDOW - 10, {"n03": "FAILING"})  # refused, inside the first alert's window
    fleet.round(WINDOW + 1, {f"n{i:02d}": "FAILING" for i in range(10, 13)})
    fleet.round(WINDOW + 5, {"n05": "FAILING"})
    assert [a.ts for a in fleet.alerts] == [0.0, WINDOW + 1]
    assert len(fleet.isolated) == 4


@pytest.mark.parametrize(
    ("size", "isolated"), [(1, 1), (3, 1), (5, 1), (10, 1), (19, 1), (20, 2), (40, 4)]
)
def test_whole_cluster_failing(size: int, isolated: int) -> None:
    fleet = Fleet(size)
    fleet.round(0.0, dict.fromkeys(fleet.records, "FAILING"))
    assert len(fleet.isolated) == isolated
    assert sum(r.rail_flagged for r in fleet.records.values()) == size - isolated
    assert len(fleet.alerts) == (0 if size == isolated else 1)


def test_other_transitions_pass_untouched() -> None:
    fleet = Fleet(20)
    recs = fleet.records
    wanted = [
        observe(recs["n00"], assess("SUB_HEALTHY", 5.0, 1), CFG),
        observe(recs["n01"], assess("HEALTHY", 5.0, 1), CFG),
    ]
    result = apply_rail(fleet.rail, 20, wanted, 5.0, CFG)
    assert result.transitions == wanted
    assert result.alerts == ()
    assert result.state is fleet.rail, "nothing to persist"


def test_one_rail_per_cluster() -> None:
    stranger = NodeRecord(
        node=NodeIdentity(region="r1", cluster="c2", node="x"), interval_s=INTERVAL
    )
    t = observe(stranger, assess("FAILING", 1.0, 1), CFG)
    with pytest.raises(ValueError, match=r"r1\.c2\.x is not in r1\.c1"):
        apply_rail(RailState(region="r1", cluster="c1"), 5, [t], 1.0, CFG)


def test_a_refused_node_back_from_silence_keeps_its_old_grade() -> None:
    fleet = Fleet(5)
    fleet.round(0.0, {"n00": "HEALTHY", "n01": "SUB_HEALTHY"})
    fleet.records["n01"] = check_silence(fleet.records["n01"], 100.0, CFG).record
    assert fleet.grade("n01") == "UNREACHABLE"
    fleet.round(100.0, {"n00": "FAILING"})
    transitions = fleet.round(110.0, {"n01": "FAILING"})
    (d,) = transitions[0].decisions
    assert (d.kind, d.grade_from, d.grade_to, d.by) == (
        "node.sub_healthy",
        "UNREACHABLE",
        "SUB_HEALTHY",
        "rail",
    )
    assert fleet.records["n01"].rail_flagged


def test_refused_isolations_do_not_make_repeat_offenders() -> None:
    cfg = LifecycleConfig(repeat_offender_count=1, rail_min_nodes=0)
    fleet = Fleet(5, cfg)
    for k in range(3):
        fleet.round(float(k * 10), {"n00": "FAILING"})
    rec = fleet.records["n00"]
    assert rec.rail_flagged
    assert not rec.held
    assert rec.isolations == ()
    assert len(fleet.alerts) == 1


def test_a_flagged_node_needs_n_clean_cycles_to_lose_its_flag() -> None:
    fleet = Fleet(5)
    fleet.round(0.0, {"n00": "FAILING", "n01": "FAILING"})
    name = next(n for n, r in fleet.records.items() if r.rail_flagged)
    for k in range(1, 3):
        fleet.round(10.0 * k, {name: "HEALTHY"})
        assert fleet.records[name].rail_flagged
    transitions = fleet.round(30.0, {name: "HEALTHY"})
    assert transitions[0].decisions == ()
    assert not fleet.records[name].rail_flagged
    assert accepts_new_work(fleet.records[name])


# --- restart safety -------------------------------------------------------------------

SCRIPT: list[tuple[float, dict[str, AssessedGrade]]] = [
    (0.0, {f"n{i:02d}": "FAILING" for i in range(5)}),
    (10.0, {"n00": "HEALTHY", "n02": "FAILING", "n07": "SUB_HEALTHY"}),
    (20.0, {"n00": "HEALTHY", "n07": "HEALTHY", "n03": "FAILING"}),
    (30.0, {"n00": "HEALTHY", "n07": "HEALTHY", "n09": "FAILING"}),
    (WINDOW + 1, {"n02": "FAILING", "n03": "FAILING", "n04": "FAILING", "n07": "HEALTHY"}),
    (WINDOW + 11, {"n00": "FAILING", "n04": "FAILING"}),
]


def play(reload: bool) -> tuple[Fleet, list[list[Transition]]]:
    fleet = Fleet(20)
    rounds = []
    for now, grades in SCRIPT:
        rounds.append(fleet.round(now, grades))
        if reload:
            fleet.rail = decode(encode(fleet.rail), RailState)
            fleet.records = {n: decode(encode(r), NodeRecord) for n, r in fleet.records.items()}
    return fleet, rounds


def test_a_reloaded_cluster_decides_identically() -> None:
    memory, memory_rounds = play(reload=False)
    stored, stored_rounds = play(reload=True)
    assert stored_rounds == memory_rounds
    assert stored.records == memory.records
    assert stored.rail == memory.rail
    assert stored.alerts == memory.alerts
    assert len(stored.alerts) == 2


def test_reobserving_after_reload_announces_nothing() -> None:
    fleet, _ = play(reload=True)
    rail_before, records_before, alerts = fleet.rail, dict(fleet.records), len(fleet.alerts)
    now, grades = SCRIPT[-1]
    fleet.seq -= 1  # the last round again: a redelivery
    transitions = fleet.round(now + 5, grades, sent=now)
    assert all(t.decisions == () for t in transitions)
    assert len(fleet.alerts) == alerts
    assert fleet.records == records_before
    assert fleet.rail.isolations == rail_before.isolations


# --- properties -----------------------------------------------------------------------

GRADE: st.SearchStrategy[AssessedGrade] = st.sampled_from(
    ["HEALTHY", "HEALTHY", "SUB_HEALTHY", "FAILING"]
)


@settings(max_examples=80, deadline=None)
@given(
    size=st.integers(min_value=1, max_value=12),
    fraction=st.sampled_from([0.0, 0.1, 0.25, 0.5]),
    min_nodes=st.integers(min_value=0, max_value=2),
    rounds=st.lists(
        st.tuples(
            st.floats(min_value=0.0, max_value=2 * WINDOW),
            st.lists(GRADE, min_size=12, max_size=12),
            st.booleans(),
        ),
        max_size=25,
    ),
)
def test_no_sequence_isolates_more_than_the_rail_allows(
    size: int,
    fraction: float,
    min_nodes: int,
    rounds: list[tuple[float, list[AssessedGrade], bool]],
) -> None:
    cfg = LifecycleConfig(rail_max_fraction=fraction, rail_min_nodes=min_nodes)
    fleet, now = Fleet(size, cfg), 0.0
    limit = rail_limit(size, cfg)
    for dt, grades, uncordon_all in rounds:
        now += dt
        fleet.round(now, dict(zip(fleet.records, grades, strict=False)))
        if uncordon_all:  # operators free every node: the rail must still hold
            for n, r in fleet.records.items():
                fleet.records[n] = operator(r, "uncordon", "fixed", "op", now, cfg).record
    times = [t for t, _ in fleet.isolated]
    for t in times:
        assert sum(1 for u in times if t - WINDOW < u <= t) <= limit
    alerts = [a.ts for a in fleet.alerts]
    assert all(b - a >= WINDOW for a, b in itertools.pairwise(alerts))
