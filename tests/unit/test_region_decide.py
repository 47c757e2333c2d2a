"""The region controller's pure decision core: rounds, the rail, replays, event ids."""

from __future__ import annotations

from dataclasses import replace

import msgspec
import pytest

from metalguard.controller.core.decide import (
    NodeInput,
    Outcome,
    batch_input,
    decide,
    decide_operator,
    decide_silence,
    event_input,
)
from metalguard.controller.core.lifecycle import AssessedGrade, LifecycleConfig, Observation
from metalguard.controller.core.scoring.engine import assess
from metalguard.proto.base import NodeIdentity, Reason
from metalguard.proto.events import NodeEvent
from metalguard.proto.nodes import NodeRecord
from metalguard.proto.telemetry import TelemetryBatch
from tests.support.scoring_helpers import dimm_mc

CFG = LifecycleConfig()
T0 = 1_800_000_000.0
INTERVAL = 10.0
FAULT = Reason(signal="edac.ue_count", value=1, rule="ecc_uncorrectable", message="UE")


def ident(i: int, cluster: str = "c1") -> NodeIdentity:
    return NodeIdentity(region="r1", cluster=cluster, node=f"n{i:02d}")


def node_input(
    i: int, grade: AssessedGrade, seq: int, ts: float, *, fatal: bool = False
) -> NodeInput:
    score = {"HEALTHY": 95.0, "SUB_HEALTHY": 65.0, "FAILING": 10.0}[grade]
    obs = Observation(
        ts=ts,
        seq=seq,
        sent_ts=ts,
        interval_s=INTERVAL,
        score=score,
        grade=grade,
        fatal=fatal,
        reasons=(FAULT,) if fatal else (),
    )
    return NodeInput(ident(i), obs, f"b{seq}@{round(ts * 1000)}")


def healthy_cluster(size: int) -> dict[str, NodeRecord]:
    records = {}
    for i in range(size):
        record = NodeRecord(
            node=ident(i), interval_s=INTERVAL, last_seen_ts=T0, last_sent_ts=T0, last_seq=1
        )
        records[record.node.handle] = msgspec.structs.replace(record, running_jobs=1)
    return records


def kinds(outcome: Outcome) -> list[str]:
    return [e.kind for e in outcome.events]


@pytest.mark.parametrize(
    ("grade", "fatal", "expected_kinds", "expected_grade"),
    [
        ("FAILING", True, ["node.isolated"], "FAILING"),
        ("FAILING", False, ["node.isolated"], "FAILING"),
        ("SUB_HEALTHY", False, ["node.sub_healthy"], "SUB_HEALTHY"),
        ("HEALTHY", False, [], "HEALTHY"),
    ],
)
def test_one_batch_one_node(
    grade: AssessedGrade, fatal: bool, expected_kinds: list[str], expected_grade: str
) -> None:
    records = healthy_cluster(10)
    out = decide(records, {}, [node_input(0, grade, 2, T0 + 10, fatal=fatal)], T0 + 10, CFG)
    assert kinds(out) == expected_kinds
    record = out.records["r1.c1.n00"]
    assert record.grade == expected_grade
    assert record.last_seq == 2
    for event in out.events:
        assert event.event_id == f"r1.c1.n00:{event.kind}:b2@{round((T0 + 10) * 1000)}"
        assert event.node == ident(0)
    if expected_grade == "FAILING":
        assert out.events[0].reasons == ((FAULT,) if fatal else ())
        assert out.events[0].attributes["action"] == "isolate"
        assert out.rails[("r1", "c1")].isolations == (T0 + 10,)


def test_score_only_change_updates_the_record_without_an_event() -> None:
    records = healthy_cluster(3)
    item = node_input(0, "HEALTHY", 2, T0 + 10)
    item = NodeInput(item.node, replace(item.obs, score=88.0), item.tag)
    out = decide(records, {}, [item], T0 + 10, CFG)
    assert out.events == ()
    assert out.records["r1.c1.n00"].score == 88.0
    assert out.rails == {}


def test_a_new_node_gets_a_record() -> None:
    out = decide({}, {}, [node_input(7, "HEALTHY", 1, T0)], T0, CFG)
    assert list(out.records) == ["r1.c1.n07"]
    assert out.events == ()


def test_a_batch_s_rack_goes_into_the_record_and_an_event_keeps_it() -> None:
    records = healthy_cluster(3)
    item = node_input(0, "HEALTHY", 2, T0 + 10)
    placed = decide(records, {}, [replace(item, rack="k3")], T0 + 10, CFG)
    assert placed.records["r1.c1.n00"].rack == "k3"
    assert placed.events == ()
    records.update(placed.records)
    unknown = node_input(0, "HEALTHY", 3, T0 + 20)  # rack None: an input that does not say
    assert decide(records, {}, [unknown], T0 + 20, CFG).records["r1.c1.n00"].rack == "k3"
    moved = decide(records, {}, [replace(unknown, rack="k4")], T0 + 20, CFG)
    assert moved.records["r1.c1.n00"].rack == "k4"


def test_rail_thirty_percent_fatal_at_once() -> None:
    """20 nodes, 6 fatal in one round: 2 isolated (10 %), 4 flagged (each announced), one
    rail.tripped."""
    records = healthy_cluster(20)
    now = T0 + 10
    inputs = [node_input(i, "FAILING", 2, now, fatal=True) for i in range(6)]
    out = decide(records, {}, inputs, now, CFG)
    assert kinds(out).count("node.isolated") == 2
    assert kinds(out).count("rail.tripped") == 1
    assert kinds(out).count("node.rail_flagged") == 4
    assert len(out.events) == 7
    grades = [out.records[f"r1.c1.n{i:02d}"].grade for i in range(6)]
    flagged = [out.records[f"r1.c1.n{i:02d}"].rail_flagged for i in range(6)]
    assert grades.count("FAILING") == 2
    assert flagged.count(True) == 4
    state = out.rails[("r1", "c1")]
    assert state.isolations == (now, now)
    assert state.tripped_ts == now
    alert = next(e for e in out.events if e.kind == "rail.tripped")
    assert alert.node is None
    assert alert.event_id.startswith("r1.c1:rail.tripped:r")


def test_rail_counts_clusters_apart() -> None:
    records = healthy_cluster(10)
    other = NodeRecord(node=ident(0, "c2"), interval_s=INTERVAL, last_seen_ts=T0, last_seq=1)
    records[other.node.handle] = other
    c2_input = NodeInput(other.node, node_input(0, "FAILING", 2, T0 + 1, fatal=True).obs, "b2")
    inputs = [node_input(0, "FAILING", 2, T0 + 1, fatal=True), c2_input]
    out = decide(records, {}, inputs, T0 + 1, CFG)
    assert kinds(out) == ["node.isolated", "node.isolated"]
    assert set(out.rails) == {("r1", "c1"), ("r1", "c2")}


def test_rail_state_is_respected_across_rounds() -> None:
    records = healthy_cluster(10)
    first = decide(records, {}, [node_input(0, "FAILING", 2, T0 + 1, fatal=True)], T0 + 1, CFG)
    records.update(first.records)
    second = decide(
        records, first.rails, [node_input(1, "FAILING", 2, T0 + 2, fatal=True)], T0 + 2, CFG
    )
    assert kinds(second) == ["node.rail_flagged", "rail.tripped"]
    assert second.records["r1.c1.n01"].rail_flagged


def test_replays_change_nothing_and_announce_nothing() -> None:
    records = healthy_cluster(10)
    item = node_input(0, "FAILING", 2, T0 + 10, fatal=True)
    out = decide(records, {}, [item], T0 + 10, CFG)
    records.update(out.records)
    again = decide(records, out.rails, [item], T0 + 20, CFG)
    assert again == Outcome()
    older = node_input(0, "FAILING", 1, T0, fatal=True)
    assert decide(records, out.rails, [older], T0 + 30, CFG) == Outcome()


def test_same_input_same_state_same_event_ids() -> None:
    records = healthy_cluster(20)
    inputs = [node_input(i, "FAILING", 2, T0 + 10, fatal=True) for i in range(6)]
    first = decide(records, {}, inputs, T0 + 10, CFG)
    second = decide(records, {}, list(reversed(inputs)), T0 + 11, CFG)
    assert sorted(e.event_id for e in first.events) == sorted(e.event_id for e in second.events)


def test_one_input_per_node_per_round() -> None:
    with pytest.raises(ValueError, match="one input per node"):
        decide({}, {}, [node_input(0, "HEALTHY", 1, T0), node_input(0, "HEALTHY", 2, T0)], T0, CFG)


def test_silence_marks_unreachable_with_a_stable_id() -> None:
    records = healthy_cluster(2)
    assert decide_silence(records, T0 + 29, CFG) == Outcome()
    out = decide_silence(records, T0 + 30, CFG)
    assert kinds(out) == ["node.unreachable", "node.unreachable"]
    assert all(r.grade == "UNREACHABLE" for r in out.records.values())
    later = decide_silence(records, T0 + 45, CFG)
    assert [e.event_id for e in later.events] == [e.event_id for e in out.events]
    assert out.events[0].event_id == f"r1.c1.n00:node.unreachable:s{round(T0 * 1000)}"


def test_fatal_node_event_isolates_once() -> None:
    records = healthy_cluster(10)
    event = NodeEvent(
        node=ident(0),
        event_id="ev-1",
        ts=T0 + 5,
        kind="ecc_uncorrectable",
        source="edac",
        device="mc0/dimm3",
        message="1 uncorrectable error on mc0 DIMM 3",
    )
    item = event_input(event, records["r1.c1.n00"], T0 + 6)
    assert item is not None
    out = decide(records, {}, [item], T0 + 6, CFG)
    assert kinds(out) == ["node.isolated"]
    assert out.events[0].event_id == "r1.c1.n00:node.isolated:eev-1"
    assert out.events[0].reasons[0].signal == "event.ecc_uncorrectable"
    assert out.events[0].reasons[0].value == "mc0/dimm3"
    records.update(out.records)
    again = event_input(event, records["r1.c1.n00"], T0 + 7)
    assert again is not None
    assert decide(records, out.rails, [again], T0 + 7, CFG) == Outcome()
    # the next batch (a higher seq) is taken in as usual
    nxt = decide(records, out.rails, [node_input(0, "FAILING", 2, T0 + 10)], T0 + 10, CFG)
    assert nxt.records["r1.c1.n00"].last_seq == 2
    assert nxt.events == ()


def test_other_node_events_are_not_acted_on() -> None:
    event = NodeEvent(node=ident(0), event_id="x", ts=T0, kind="device_added")
    assert event_input(event, None, T0) is None


def test_operator_action_and_its_repeat() -> None:
    record = healthy_cluster(1)["r1.c1.n00"]
    out = decide_operator(record, "cordon", "swap PSU", "ana", T0 + 1, CFG)
    assert kinds(out) == ["node.cordoned"]
    assert out.events[0].event_id == f"r1.c1.n00:node.cordoned:o{round((T0 + 1) * 1000)}"
    assert out.records["r1.c1.n00"].cordoned
    again = decide_operator(out.records["r1.c1.n00"], "cordon", "swap PSU", "ana", T0 + 2, CFG)
    assert again == Outcome()


def test_batch_input_from_a_scored_ue_batch() -> None:
    batch = TelemetryBatch(node=ident(0), seq=3, ts=T0, interval_s=5.0, edac=(dimm_mc(ue=2),))
    _, assessment = assess(None, batch)
    item = batch_input(batch, assessment, T0 + 0.5)
    assert item.obs.fatal
    assert item.obs.ts == T0 + 0.5
    assert item.obs.sent_ts == T0
    assert item.tag == f"b3@{round(T0 * 1000)}"
    out = decide({}, {}, [item], T0 + 0.5, CFG)
    assert kinds(out) == ["node.isolated"]
