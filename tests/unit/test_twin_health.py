"""The twin's health system: synthesized telemetry through the REAL scoring, lifecycle and
rail (metalguard/twin/signals.py, metalguard/twin/health.py)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from metalguard.controller.core.lifecycle import LifecycleConfig
from metalguard.controller.core.scoring.config import DEFAULT_SCORING, ScoringConfig
from metalguard.controller.core.scoring.engine import assess
from metalguard.controller.jobs.scheduler import FleetNode
from metalguard.proto.base import NodeIdentity
from metalguard.proto.events import NodeEvent
from metalguard.twin import signals
from metalguard.twin.health import GradeChange, HealthModel
from metalguard.twin.model import Fault, FaultKind, Signal
from metalguard.twin.policies import POLICIES

INTERVAL = signals.AGENT_BATCH_INTERVAL_S
HOUR = 3600.0

ACTIVE = POLICIES["metalguard"]
STATIC_POLICY = POLICIES["static"]


def fleet(n: int = 20, clusters: int = 1) -> list[FleetNode]:
    """``n`` nodes per cluster, ``r1.c<k>.n<i>``."""
    return [
        FleetNode(handle=f"r1.c{k}.n{i}", region="r1", cluster=f"c{k}", rack=f"k{i // 4}", gpus=8)
        for k in range(clusters)
        for i in range(n)
    ]


def fault(
    node: str = "r1.c0.n0",
    signal: Signal = "ecc",
    at: float = 10 * HOUR,
    kind: FaultKind = "hardware",
    fault_id: int = 1,
) -> Fault:
    return Fault(
        fault_id=fault_id,
        node=node,
        at_s=at,
        cause=f"cause-{signal or 'none'}",
        kind=kind,
        signal=signal,
        precursor_at_s=at - HOUR,
        repair_s=HOUR,
    )


def changed(rule: str, **fields: Any) -> ScoringConfig:
    """The default scoring with rule ``rule``'s settings changed."""
    rules = DEFAULT_SCORING.rules
    settings = msgspec.structs.replace(getattr(rules, rule), **fields)
    return msgspec.structs.replace(
        DEFAULT_SCORING, rules=msgspec.structs.replace(rules, **{rule: settings})
    )


def path(changes: list[GradeChange]) -> list[tuple[str, str]]:
    return [(c.before, c.after) for c in changes]


# --- precursors: the real scoring decides ------------------------------------------------

NEVER = {"warning_threshold": 1e9, "severe_threshold": 1e9}
"""A rate rule's levels out of reach."""
SUB = [("HEALTHY", "SUB_HEALTHY"), ("SUB_HEALTHY", "MAINTENANCE")]
FAIL = [("HEALTHY", "FAILING")]
PRECURSORS = [
    # signal, score, the lifecycle's path (its second sub-healthy batch, no jobs known:
    # MAINTENANCE), a changed rule and the path under it
    ("ecc", 60.0, SUB, changed("gpu_ecc_correctable_rate", **NEVER), []),
    ("gpu", 70.0, SUB, changed("gpu_reset_pending", enabled=False), []),
    ("pcie", 65.0, SUB, changed("link_downgrade", enabled=False), []),
    ("smart", 30.0, FAIL, changed("nvme_critical_warning", enabled=False), SUB),
    ("thermal", 40.0, FAIL, changed("temp_near_critical", margin_celsius=1.0), SUB),
    ("network", 40.0, FAIL, changed("rdma_phys_error_rate", **NEVER), SUB),
]  # fmt: skip


@pytest.mark.parametrize(("signal", "score", "expected", "config", "under"), PRECURSORS)
def test_precursor_is_graded_by_the_real_scoring(
    signal: Signal,
    score: float,
    expected: list[tuple[str, str]],
    config: ScoringConfig,
    under: list[tuple[str, str]],
) -> None:
    now = 5 * HOUR
    health = HealthModel(fleet(), ACTIVE)
    changes = health.precursor(fault(signal=signal), now)
    assert path(changes) == expected
    assert health.grade("r1.c0.n0") == expected[-1][1]
    record = health.record("r1.c0.n0")
    assert record is not None
    assert record.score == score
    # one change per precursor batch, the batches one agent interval apart ending at now
    first = now - (signals.PRECURSOR_STEPS - 1) * INTERVAL
    assert [c.at_s for c in changes] == [first + k * INTERVAL for k in range(len(expected))]
    assert health.decisions[f"precursor:{'FAILING' if expected == FAIL else 'SUB_HEALTHY'}"] == 1
    assert health.decisions["precursor_missed"] == 0

    # the same readings under a changed rule: another outcome
    other = HealthModel(fleet(), ACTIVE, scoring=config)
    assert path(other.precursor(fault(signal=signal), now)) == under
    assert other.decisions["precursor_missed"] == (1 if not under else 0)


def test_a_sub_healthy_node_with_jobs_stays_sub_healthy() -> None:
    health = HealthModel(fleet(), ACTIVE, running=lambda _handle: 1)
    changes = health.precursor(fault(signal="pcie"), HOUR)
    assert path(changes) == [("HEALTHY", "SUB_HEALTHY")]
    assert "link_downgrade" in changes[0].reason
    assert health.grade("r1.c0.n0") == "SUB_HEALTHY"


def test_the_gpu_precursors_warning_xid_is_not_acted_on() -> None:
    health = HealthModel(fleet(), ACTIVE)
    health.precursor(fault(signal="gpu"), HOUR)
    assert health.decisions["event_ignored:gpu_xid"] == 1


def test_a_precursor_without_signal_is_missed_and_touches_nothing() -> None:
    health = HealthModel(fleet(), ACTIVE)
    assert health.precursor(fault(signal=""), HOUR) == []
    assert health.decisions["precursor_missed"] == 1
    assert health.records == {}
    node = NodeIdentity(region="r", cluster="c", node="n")
    assert signals.precursor("", node, seq=1, ts=0.0) is None


def test_a_rate_needs_the_baseline_the_model_sends_first() -> None:
    # a storm's first reading alone is no rate (one sample grows by nothing): the model
    # sends the node's clean reading first, as the agent did all along
    node = NodeIdentity(region="r", cluster="c", node="n")
    storm = signals.precursor("ecc", node, seq=2, ts=105.0, step=1)
    assert storm is not None
    assert assess(None, storm)[1].grade == "HEALTHY"
    history, _ = assess(None, signals.baseline("ecc", node, seq=1, ts=100.0))
    assert assess(history, storm)[1].grade == "SUB_HEALTHY"


# --- faults --------------------------------------------------------------------------------


@pytest.mark.parametrize("signal", signals.SIGNALS)
def test_a_fault_isolates_its_node(signal: Signal) -> None:
    health = HealthModel(fleet(), ACTIVE)
    changes = health.fault(fault(signal=signal), 3 * HOUR)
    assert path(changes) == [("HEALTHY", "FAILING")]
    assert changes[0].at_s == 3 * HOUR
    assert "isolate now" in changes[0].reason
    assert health.fleet_node(fleet()[0]).grade == "FAILING"
    assert not health.accepts_work("r1.c0.n0")


def test_a_fault_after_its_precursor_isolates_the_drained_node() -> None:
    health = HealthModel(fleet(), ACTIVE)
    health.precursor(fault(signal="ecc"), HOUR)
    changes = health.fault(fault(signal="ecc"), HOUR)  # at the same instant
    assert path(changes) == [("MAINTENANCE", "FAILING")]
    assert "gpu_ecc_dbe" in changes[0].reason


def test_a_fault_on_a_node_in_operator_maintenance_changes_nothing() -> None:
    health = HealthModel(fleet(), ACTIVE)
    health.drain("r1.c0.n0", HOUR, "precursor drain")
    assert health.fault(fault(signal="pcie"), 2 * HOUR) == []
    assert health.grade("r1.c0.n0") == "MAINTENANCE"


def test_a_fault_without_signal_leaves_the_node_silent_unreachable() -> None:
    health = HealthModel(fleet(), ACTIVE)
    changes = health.fault(fault(signal=""), HOUR)
    limit = LifecycleConfig().unreachable_after_intervals * INTERVAL
    assert path(changes) == [("HEALTHY", "UNREACHABLE")]
    assert changes[0].at_s == pytest.approx(HOUR + limit, abs=0.01)
    assert path(health.repaired("r1.c0.n0", 2 * HOUR)) == [("UNREACHABLE", "HEALTHY")]


@pytest.mark.parametrize("now", [242.31234933358033, 0.1, 1e5 + 0.3])
def test_a_silent_fault_is_unreachable_whatever_the_float_rounding(now: float) -> None:
    # (242.31234933358033 + 15) - 242.31234933358033 is 14.99999999999997: a silence
    # decided exactly one limit later would be one rounding short of the limit
    health = HealthModel(fleet(), ACTIVE)
    assert path(health.fault(fault(signal=""), now)) == [("HEALTHY", "UNREACHABLE")]


def test_software_faults_and_hangs_leave_the_node_alone() -> None:
    health = HealthModel(fleet(), ACTIVE)
    assert health.fault(fault(kind="software"), HOUR) == []
    assert health.fault(fault(kind="hang"), HOUR) == []
    assert health.records == {}


def test_the_rail_holds_isolations_beyond_the_clusters_share() -> None:
    # 10 nodes: the rail allows max(1, 10 % of 10) = 1 isolation per hour
    health = HealthModel(fleet(10), ACTIVE)
    first = health.fault(fault("r1.c0.n0", "pcie", fault_id=1), HOUR)
    second = health.fault(fault("r1.c0.n1", "smart", fault_id=2), HOUR + 60)
    assert path(first) == [("HEALTHY", "FAILING")]
    assert second == []
    held = health.record("r1.c0.n1")
    assert held is not None
    assert (held.grade, held.rail_flagged) == ("HEALTHY", True)
    assert not health.accepts_work("r1.c0.n1")
    assert health.decisions["rail_held"] == 1
    assert health.decisions["rail_tripped"] == 1
    # the window passed: the next fault is isolated
    third = health.fault(fault("r1.c0.n2", "gpu", fault_id=3), 3 * HOUR)
    assert path(third) == [("HEALTHY", "FAILING")]


def test_the_rail_holds_a_failing_precursor_once_per_call() -> None:
    health = HealthModel(fleet(10), ACTIVE)
    health.fault(fault("r1.c0.n0", "pcie", fault_id=1), HOUR)
    # both thermal precursor batches want an isolation; the rail refuses both
    assert health.precursor(fault("r1.c0.n1", "thermal", fault_id=2), HOUR + 60) == []
    assert health.decisions["rail_held"] == 1
    assert health.decisions["precursor:FAILING"] == 1
    assert not health.accepts_work("r1.c0.n1")


def test_the_rail_counts_the_whole_fleets_cluster_not_the_touched_nodes() -> None:
    # 20 nodes: 2 isolations per hour, though only the two faulty nodes have records
    health = HealthModel(fleet(20), ACTIVE)
    health.fault(fault("r1.c0.n0", "pcie", fault_id=1), HOUR)
    health.fault(fault("r1.c0.n1", "smart", fault_id=2), HOUR + 60)
    assert [health.grade(f"r1.c0.n{i}") for i in range(3)] == ["FAILING", "FAILING", "HEALTHY"]
    assert health.decisions["rail_held"] == 0
    # a stricter rail, from the lifecycle config, holds the second
    strict = HealthModel(fleet(20), ACTIVE, lifecycle=LifecycleConfig(rail_max_fraction=0.05))
    strict.fault(fault("r1.c0.n0", "pcie", fault_id=1), HOUR)
    strict.fault(fault("r1.c0.n1", "smart", fault_id=2), HOUR + 60)
    assert strict.grade("r1.c0.n1") == "HEALTHY"
    assert strict.decisions["rail_held"] == 1


def test_untouched_nodes_have_no_records() -> None:
    nodes = fleet(20, clusters=2)
    health = HealthModel(nodes, ACTIVE)
    health.precursor(fault("r1.c1.n3", "network"), HOUR)
    health.fault(fault("r1.c1.n3", "network"), 2 * HOUR)
    assert sorted(health.records) == ["r1.c1.n3"]
    assert sorted(health.rails) == [("r1", "c1")]
    assert health.grade("r1.c0.n0") == "HEALTHY"
    assert health.accepts_work("r1.c0.n0")
    assert health.fleet_node(nodes[0]) is nodes[0]


def test_an_unknown_node_is_an_error() -> None:
    with pytest.raises(KeyError, match=r"r1\.c9\.n9"):
        HealthModel(fleet(), ACTIVE).fault(fault("r1.c9.n9"), HOUR)


# --- drains and repairs ----------------------------------------------------------------------


def test_drain_puts_the_node_in_maintenance_and_repaired_brings_it_back() -> None:
    health = HealthModel(fleet(), ACTIVE)
    drained = health.drain("r1.c0.n0", HOUR, "sub-healthy: drain")
    assert path(drained) == [("HEALTHY", "MAINTENANCE")]
    assert "maintenance by twin" in drained[0].reason
    assert health.decisions["operator:maintenance"] == 1
    back = health.repaired("r1.c0.n0", 2 * HOUR)
    assert path(back) == [("MAINTENANCE", "HEALTHY")]
    assert back[0].at_s == 2 * HOUR
    assert health.decisions["operator:uncordon"] == 1
    assert health.accepts_work("r1.c0.n0")


def test_a_failing_node_needs_the_lifecycles_clean_cycles() -> None:
    for cycles in (3, 5):
        health = HealthModel(
            fleet(), ACTIVE, lifecycle=LifecycleConfig(clean_cycles_to_recover=cycles)
        )
        health.fault(fault(signal="pcie"), HOUR)
        back = health.repaired("r1.c0.n0", 5 * HOUR)
        assert path(back) == [("FAILING", "HEALTHY")]
        assert back[0].at_s == 5 * HOUR + (cycles - 1) * INTERVAL
        assert "clean_cycles_to_recover" in back[0].reason
        assert health.decisions["operator:uncordon"] == 0


def test_a_repair_within_the_rules_window_is_not_clean_yet() -> None:
    # the RDMA flap and error rates are judged over an hour: the repaired port's reset
    # counters do not hide the flaps of 2 minutes ago (the real scorer's window)
    health = HealthModel(fleet(), ACTIVE)
    health.precursor(fault(signal="network"), HOUR)
    health.fault(fault(signal="network"), HOUR + 60)
    assert health.repaired("r1.c0.n0", HOUR + 120) == []
    assert health.grade("r1.c0.n0") == "FAILING"
    assert health.decisions["repaired_not_healthy"] == 1
    # once the window has passed, the node comes back
    assert path(health.repaired("r1.c0.n0", 3 * HOUR)) == [("FAILING", "HEALTHY")]


def test_a_repeat_offender_is_held_until_the_repair_uncordons_it() -> None:
    health = HealthModel(fleet(), ACTIVE, lifecycle=LifecycleConfig(repeat_offender_count=2))
    health.fault(fault(signal="pcie", fault_id=1), HOUR)
    health.repaired("r1.c0.n0", 2 * HOUR)
    again = health.fault(fault(signal="pcie", fault_id=2), 3 * HOUR)
    assert path(again) == [("HEALTHY", "FAILING")]
    record = health.record("r1.c0.n0")
    assert record is not None
    assert record.held
    assert health.decisions["held"] == 1
    assert health.fleet_node(fleet()[0]).cordoned  # the controller's own fleet view
    back = health.repaired("r1.c0.n0", 4 * HOUR)
    assert path(back) == [("FAILING", "HEALTHY")]
    assert health.decisions["operator:uncordon"] == 1
    record = health.record("r1.c0.n0")
    assert record is not None
    assert (record.held, record.isolations) == (False, ())


def test_repaired_on_an_untouched_node_does_nothing() -> None:
    health = HealthModel(fleet(), ACTIVE)
    assert health.repaired("r1.c0.n0", HOUR) == []
    assert health.records == {}


# --- policies and determinism ---------------------------------------------------------------


def test_the_static_policy_changes_nothing() -> None:
    health = HealthModel(fleet(), STATIC_POLICY)
    assert health.precursor(fault(signal="smart"), HOUR) == []
    assert health.fault(fault(signal="smart"), 2 * HOUR) == []
    assert health.repaired("r1.c0.n0", 3 * HOUR) == []
    assert health.records == {}
    assert health.rails == {}
    assert health.grade("r1.c0.n0") == "HEALTHY"
    assert sum(health.decisions.values()) == 0


def test_the_same_inputs_give_the_same_decisions() -> None:
    def run() -> tuple[list[GradeChange], dict[str, int]]:
        health = HealthModel(fleet(10), ACTIVE)
        out: list[GradeChange] = []
        for i, signal in enumerate((*signals.SIGNALS, "")):
            f = fault(f"r1.c0.n{i}", signal, at=(i + 2) * HOUR, fault_id=i)
            out += health.precursor(f, f.at_s - 600)
            out += health.fault(f, f.at_s)
            out += health.repaired(f.node, f.at_s + 2 * HOUR)
        return out, dict(health.decisions)

    first, again = run(), run()
    assert first == again
    changes, decisions = first
    assert changes[0].node == "r1.c0.n0"
    assert decisions["grade:HEALTHY->FAILING"] == 3
    assert decisions["grade:HEALTHY->UNREACHABLE"] == 1


# --- the synthesized telemetry itself ---------------------------------------------------------


@pytest.mark.parametrize("signal", signals.SIGNALS)
def test_baselines_are_healthy_and_faults_are_fatal(signal: Signal) -> None:
    node = NodeIdentity(region="r", cluster="c", node="n")
    history, clean = assess(None, signals.baseline(signal, node, seq=1, ts=100.0))
    assert (clean.score, clean.grade) == (100.0, "HEALTHY")
    report = signals.fault_report(signal, node, seq=2, ts=105.0, event_id="e1")
    if isinstance(report, NodeEvent):
        from metalguard.controller.core.decide import is_fatal_event

        assert is_fatal_event(report)
    else:
        assert report is not None
        _, failed = assess(history, report)
        assert failed.fatal
        assert failed.grade == "FAILING"


def test_equal_readings_are_the_same_objects_for_the_scorers_memo() -> None:
    node = NodeIdentity(region="r", cluster="c", node="n")
    a = signals.precursor("gpu", node, seq=1, ts=1.0, step=1)
    b = signals.precursor("gpu", node, seq=2, ts=2.0, step=1)
    assert a is not None
    assert b is not None
    assert a.gpu is b.gpu
    # a repaired GPU is a new part: a new UUID (a new history for its counters)
    c = signals.baseline("gpu", node, seq=3, ts=3.0, generation=1)
    assert c.gpu[0].uuid != signals.baseline("gpu", node, seq=3, ts=3.0).gpu[0].uuid
