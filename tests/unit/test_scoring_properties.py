"""Properties of the scorer over random batches, and the real fixture node."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metalguard.agent.config import AgentConfig, CollectSection
from metalguard.agent.oneshot import collect_once
from metalguard.controller.core.rules import Finding
from metalguard.controller.core.scoring.config import DEFAULT_SCORING, RULE_KEYS, SEVERITIES
from metalguard.controller.core.scoring.engine import Assessment, assess, grade_for, summarize
from metalguard.proto.base import Reason
from metalguard.proto.telemetry import (
    AerCounters,
    BmcReading,
    CollectorRun,
    EdacController,
    Fan,
    HwmonChip,
    PcieDevice,
    SmartDevice,
    TelemetryBatch,
    Temperature,
)
from tests.support.batch_strategies import batches
from tests.support.scoring_helpers import T0

FIXTURES = Path(__file__).parents[1] / "fixtures"
GRADE_RANK = {"HEALTHY": 0, "SUB_HEALTHY": 1, "FAILING": 2}

FAULTS: list[tuple[str, Any]] = [
    ("edac", EdacController(mc=99, ue_count=1)),
    (
        "pcie",
        PcieDevice(
            address="0000:ff:00.0",
            pci_class="0x020000",
            aer=AerCounters(fatal={"TOTAL_ERR_FATAL": 1}),
        ),
    ),
    (
        "pcie",
        PcieDevice(
            address="0000:fe:00.0", pci_class="0x020000", current_link_width=8, max_link_width=16
        ),
    ),
    (
        "pcie",
        PcieDevice(
            address="0000:fd:00.0", pci_class="0x060400", current_link_width=8, max_link_width=16
        ),
    ),
    ("smart", SmartDevice(device="/dev/fault", passed=False)),
    ("smart", SmartDevice(device="/dev/fault", critical_warning=2)),
    ("smart", SmartDevice(device="/dev/fault", percentage_used=100)),
    ("smart", SmartDevice(device="/dev/fault", available_spare=1)),
    ("smart", SmartDevice(device="/dev/fault", pending_sectors=3)),
    ("hwmon", HwmonChip(chip="fault", fans=(Fan(sensor="fan9", rpm=0.0),))),
    ("hwmon", HwmonChip(chip="fault", fans=(Fan(sensor="fan9", alarm=True),))),
    (
        "hwmon",
        HwmonChip(chip="fault", temps=(Temperature(sensor="t", celsius=97.0, crit_celsius=100.0),)),
    ),
    (
        "hwmon",
        HwmonChip(chip="fault", temps=(Temperature(sensor="t", celsius=90.0, max_celsius=85.0),)),
    ),
    ("bmc", BmcReading(source="snmp", reachable=True, health="Critical")),
    ("collectors", CollectorRun(collector="fault", duration_s=1.0, success=False)),
]


def check_invariants(assessment: Assessment) -> None:
    assert 0.0 <= assessment.score <= 100.0
    if assessment.fatal:
        assert assessment.grade == "FAILING"
    assert assessment.grade == grade_for(assessment.score, assessment.fatal, DEFAULT_SCORING.grades)
    ranks = [SEVERITIES.index(f.severity) for f in assessment.findings]
    assert ranks == sorted(ranks)
    assert "info" not in {f.severity for f in assessment.findings}
    spent: dict[str, float] = {}
    for f in assessment.findings:
        assert f.reason.rule in RULE_KEYS
        assert f.penalty >= 0
        spent[f.reason.rule] = spent.get(f.reason.rule, 0.0) + f.penalty
    for rule, total in spent.items():
        assert total <= DEFAULT_SCORING.rules.get(rule).max_penalty + 1e-9
    assert assessment.score == pytest.approx(max(0.0, 100.0 - math.fsum(spent.values())))


@settings(max_examples=120, deadline=None)
@given(first=batches(), second=batches(600.0))
def test_score_bounds_and_grades(first: TelemetryBatch, second: TelemetryBatch) -> None:
    signals, assessment = assess(None, first)
    check_invariants(assessment)
    _signals, assessment = assess(signals, second)
    check_invariants(assessment)
    for reason in assessment.reasons:
        if reason.signal.endswith("_rate"):
            assert isinstance(reason.value, float)
            assert reason.value >= 0


@settings(max_examples=120, deadline=None)
@given(base=batches(), fault=st.sampled_from(FAULTS))
def test_adding_a_fault_never_raises_the_score(
    base: TelemetryBatch, fault: tuple[str, Any]
) -> None:
    field, item = fault
    worse = msgspec.structs.replace(base, **{field: (*getattr(base, field), item)})
    _, before = assess(None, base)
    _, after = assess(None, worse)
    assert after.score <= before.score
    assert GRADE_RANK[after.grade] >= GRADE_RANK[before.grade]
    assert len(after.findings) > len(before.findings)


findings = st.builds(
    lambda rule, severity, penalty: Finding(
        reason=Reason(signal="s", rule=rule, message="m"), severity=severity, penalty=penalty
    ),
    st.sampled_from(RULE_KEYS),
    st.sampled_from(SEVERITIES),
    st.floats(0, 100),
)


@settings(max_examples=200, deadline=None)
@given(found=st.lists(findings, max_size=12), extra=findings)
def test_summarize_is_monotonic(found: list[Finding], extra: Finding) -> None:
    before = summarize(found)
    after = summarize([*found, extra])
    check_invariants(before)
    check_invariants(after)
    assert after.score <= before.score
    assert GRADE_RANK[after.grade] >= GRADE_RANK[before.grade]


def fixture_batch() -> TelemetryBatch:
    collect = CollectSection(
        sysfs=str(FIXTURES / "node_exporter" / "sys"),
        smart_json_dir=str(FIXTURES / "smartctl"),
    )
    config = AgentConfig(collect=collect)
    return asyncio.run(collect_once(config, ["edac", "pcie", "hwmon", "smart"]))


def test_the_fixture_node_is_failing_for_the_right_reasons() -> None:
    node = fixture_batch()
    _signals, assessment = assess(None, msgspec.structs.replace(node, ts=T0))
    check_invariants(assessment)
    assert assessment.grade == "FAILING"
    assert assessment.fatal
    assert assessment.score == 0.0
    reasons = assessment.reasons
    fatal_rules = {f.reason.rule for f in assessment.findings if f.severity == "fatal"}
    assert fatal_rules == {"ecc_uncorrectable", "smart_failed"}
    ue = [r for r in reasons if r.rule == "ecc_uncorrectable"]
    assert {r.signal for r in ue} == {"edac.ue_count", "edac.ue_noinfo_count"}
    assert "mc0 (without DIMM information) has 6 uncorrectable ECC errors" in {
        r.message for r in ue
    }
    assert "mc0 csrow2 has 5 uncorrectable ECC errors" in {r.message for r in ue}
    (stopped,) = [r for r in reasons if r.rule == "fan_stopped"]
    assert (stopped.value, stopped.threshold) == (0.0, 2160.0)
    assert "applesmc" in stopped.message
    assert "'Left side'" in stopped.message
    (failed,) = [r for r in reasons if r.rule == "smart_failed"]
    assert "SAMSUNG MZWLL3T2HAJQ-00005" in failed.message
    (warning,) = [r for r in reasons if r.rule == "nvme_critical_warning"]
    assert "volatile memory backup failed" in warning.message
    assert {r.rule for r in reasons} >= {
        "fan_below_min",
        "ata_reallocated",
        "scsi_grown_defects",
        "link_downgrade_other",
    }
    assert "link_downgrade" not in {r.rule for r in reasons}
    assert all(r.rule in RULE_KEYS for r in reasons)
