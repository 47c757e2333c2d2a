"""One owner for "does this node take new work" (controller/core/grades.py): the lifecycle,
the scheduler, the federation's capacity, provisioning and the Slurm bridge agree over
every grade x cordoned x held x rail-flagged; the rail's flag is announced when it is set
and when it clears (``node.rail_flagged``)."""

from __future__ import annotations

import itertools
from typing import get_args

import msgspec
import pytest

from metalguard.controller.core import grades
from metalguard.controller.core.decide import NodeInput, decide, decide_operator
from metalguard.controller.core.lifecycle import (
    AssessedGrade,
    LifecycleConfig,
    Observation,
    accepts_new_work,
)
from metalguard.controller.core.topology import fleet_node
from metalguard.controller.federation.view import summarize
from metalguard.controller.provision.machine import why_not_deployable
from metalguard.controller.slurm.actions import trigger_of, trigger_of_record
from metalguard.proto.base import NodeIdentity, Reason
from metalguard.proto.nodes import Grade, NodeRecord
from metalguard.proto.topology import NodeTopology

FLAGS = list(itertools.product(get_args(Grade), (False, True), (False, True), (False, True)))
FAULT = Reason(signal="pcie.aer_fatal", value=1, rule="aer", message="fatal AER")


def record(grade: Grade, cordoned: bool, held: bool, rail_flagged: bool) -> NodeRecord:
    node = NodeIdentity(region="r1", cluster="c1", node="n1")
    return NodeRecord(
        node=node, grade=grade, cordoned=cordoned, held=held, rail_flagged=rail_flagged
    )


@pytest.mark.parametrize(("grade", "cordoned", "held", "rail_flagged"), FLAGS)
def test_every_path_asks_the_same_question(
    grade: Grade, cordoned: bool, held: bool, rail_flagged: bool
) -> None:
    rec = record(grade, cordoned, held, rail_flagged)
    expected = grade == "HEALTHY" and not (cordoned or held or rail_flagged)
    assert grades.record_takes_new_work(rec) is expected
    assert accepts_new_work(rec) is expected
    node = fleet_node(rec.node.handle, rec, NodeTopology(gpus=8, gpu_type="h100"))
    assert node.schedulable is expected
    summary = summarize("r1", {rec.node.handle: rec}, [node], now=0.0, interval_s=5.0)
    (capacity,) = summary.capacity
    assert (capacity.healthy_nodes, capacity.free_nodes) == (int(expected), int(expected))
    deployable = why_not_deployable(
        "n1", grade, cordoned, None, True, held=held, rail_flagged=rail_flagged
    )
    assert (deployable is None) is expected
    if not expected:
        assert deployable == f"n1 is {grades.record_why_no_new_work(rec)}"


def test_a_flagged_node_says_why() -> None:
    rec = record("HEALTHY", False, False, True)
    assert grades.record_why_no_new_work(rec) is not None
    assert "rail-flagged" in (grades.record_why_no_new_work(rec) or "")


# --- node.rail_flagged through decide ---------------------------------------------------

CFG = LifecycleConfig()  # 10 % of a cluster per window, at least one


def node(i: int) -> NodeIdentity:
    return NodeIdentity(region="r1", cluster="c1", node=f"n{i}")


def inputs(ts: float, seq: int, grades_of: dict[int, AssessedGrade]) -> list[NodeInput]:
    score = {"HEALTHY": 95.0, "SUB_HEALTHY": 65.0, "FAILING": 20.0}
    return [
        NodeInput(
            node=node(i),
            obs=Observation(
                ts=ts,
                seq=seq,
                score=score[g],
                grade=g,
                reasons=(FAULT,) if g == "FAILING" else (),
                interval_s=5.0,
            ),
            tag=f"b{seq}",
        )
        for i, g in grades_of.items()
    ]


def ten_healthy() -> dict[str, NodeRecord]:
    out = decide({}, {}, inputs(0.0, 1, dict.fromkeys(range(10), "HEALTHY")), 0.0, CFG)
    return dict(out.records)


def test_three_of_ten_failing_isolate_one_and_flag_two_announced() -> None:
    records = ten_healthy()
    out = decide(records, {}, inputs(10.0, 2, dict.fromkeys((1, 2, 3), "FAILING")), 10.0, CFG)
    records |= out.records
    rails = out.rails
    kinds = [(e.kind, e.node.node if e.node else "") for e in out.events]
    isolated = [n for k, n in kinds if k == "node.isolated"]
    flagged = sorted(n for k, n in kinds if k == "node.rail_flagged")
    assert len(isolated) == 1
    assert flagged == sorted({"n1", "n2", "n3"} - set(isolated))
    assert ("rail.tripped", "") in kinds
    for e in out.events:
        if e.kind == "node.rail_flagged":
            assert e.attributes["flagged"] is True
            assert e.attributes["by"] == "rail"
            assert e.message.startswith("rail-flagged:")
            assert e.reasons == (FAULT,)
            assert not accepts_new_work(records[e.node.handle])  # type: ignore[union-attr]
    # a repeat of the same fault: still flagged, announced once only
    again = decide(records, rails, inputs(11.0, 3, {int(flagged[0][1:]): "FAILING"}), 11.0, CFG)
    assert [e.kind for e in again.events] == []

    # N clean assessments clear the flag, announced with takes_new_work
    name = flagged[0]
    i = int(name[1:])
    cleared = []
    for k in range(CFG.clean_cycles_to_recover):
        out = decide(records, rails, inputs(20.0 + k, 10 + k, {i: "HEALTHY"}), 20.0 + k, CFG)
        records |= out.records
        cleared += [e for e in out.events if e.kind == "node.rail_flagged"]
    (clear,) = cleared
    assert clear.attributes["flagged"] is False
    assert clear.attributes["takes_new_work"] is True
    assert "assessed clean" in clear.message
    assert accepts_new_work(records[clear.node.handle])  # type: ignore[union-attr]


def test_an_uncordon_clears_the_flag_and_says_so() -> None:
    records = ten_healthy()
    out = decide(records, {}, inputs(10.0, 2, dict.fromkeys((1, 2), "FAILING")), 10.0, CFG)
    records |= out.records
    name = next(h for h, r in records.items() if r.rail_flagged)
    done = decide_operator(records[name], "uncordon", "checked", "ann", 20.0, CFG)
    flags = [e for e in done.events if e.kind == "node.rail_flagged"]
    assert [e.attributes["flagged"] for e in flags] == [False]
    assert flags[0].message == "rail flag cleared: an operator's action (operator:ann)"
    assert flags[0].attributes["by"] == "operator:ann"


def test_the_slurm_bridge_drains_a_flagged_node_and_resumes_it_once_cleared() -> None:
    records = ten_healthy()
    out = decide(records, {}, inputs(10.0, 2, dict.fromkeys((1, 2), "FAILING")), 10.0, CFG)
    (flag,) = [e for e in out.events if e.kind == "node.rail_flagged"]
    trigger = trigger_of(flag)
    assert trigger is not None
    assert (trigger.intent, trigger.automatic) == ("drain", False)  # not capped
    assert trigger.why.startswith("rail-flagged:")
    rec = out.records[flag.node.handle]  # type: ignore[union-attr]
    from_record = trigger_of_record(rec)
    assert from_record is not None
    assert (from_record.intent, from_record.kind) == ("drain", "node.rail_flagged")
    for takes, intent in ((True, "resume"), (False, None)):
        attrs = {**flag.attributes, "flagged": False, "takes_new_work": takes}
        got = trigger_of(msgspec.structs.replace(flag, attributes=attrs))
        assert (got.intent if got else None) == intent


@pytest.mark.parametrize("grade", get_args(Grade))
def test_running_work_has_one_owner_and_never_moves_what_takes_new_work(grade: Grade) -> None:
    from metalguard.controller.jobs.machine import EVACUATE

    cause = grades.running_work(grade)
    assert EVACUATE.get(grade) == cause  # the job manager asks the same table
    assert (cause is None) is (grade in grades.RUNNING_WORK_GRADES)
    if grades.takes_new_work(grade, cordoned=False, held=False, rail_flagged=False):
        assert cause is None
    expected = {"FAILING": "node_failing", "MAINTENANCE": "maintenance", "UNREACHABLE": "lost"}
    assert cause == expected.get(grade)


def test_the_worst_grade_ranks_maintenance_with_healthy_and_unreachable_last() -> None:
    from metalguard.controller.core.grades import worst_grade

    assert worst_grade(["HEALTHY", "MAINTENANCE"]) == "HEALTHY"
    assert worst_grade(["MAINTENANCE", "SUB_HEALTHY", "HEALTHY"]) == "SUB_HEALTHY"
    assert worst_grade(["FAILING", "SUB_HEALTHY"]) == "FAILING"
    assert worst_grade(["FAILING", "UNREACHABLE"]) == "UNREACHABLE"
    assert worst_grade(["HEALTHY", "NEW_GRADE"]) == "NEW_GRADE"
    with pytest.raises(ValueError, match="empty"):
        worst_grade([])
