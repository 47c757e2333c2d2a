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
    BmcSensor,
    CollectorRun,
    EdacController,
    EdacDimm,
    Fan,
    HwmonChip,
    PcieDevice,
    SmartDevice,
    TelemetryBatch,
    Temperature,
)
from tests.unit.scoring_helpers import T0, batch

FIXTURES = Path(__file__).parents[1] / "fixtures"
GRADE_RANK = {"HEALTHY": 0, "SUB_HEALTHY": 1, "FAILING": 2}

small = st.integers(0, 3)
maybe_small = st.none() | small
temps_c = st.none() | st.sampled_from([0.0, 40.0, 79.0, 80.0, 94.0, 95.0, 99.0, 100.0, 120.0])

dimms = st.builds(
    EdacDimm, name=st.sampled_from(["dimm0", "dimm1"]), ce_count=maybe_small, ue_count=maybe_small
)
controllers = st.builds(
    EdacController,
    mc=st.integers(0, 3),
    ce_count=maybe_small,
    ue_count=maybe_small,
    ue_noinfo_count=maybe_small,
    dimms=st.lists(dimms, max_size=2).map(tuple),
)
aer = st.builds(
    AerCounters,
    correctable=st.dictionaries(st.sampled_from(["RxErr", "TOTAL_ERR_COR"]), small),
    fatal=st.dictionaries(st.sampled_from(["DLP", "TOTAL_ERR_FATAL"]), small),
    nonfatal=st.dictionaries(st.sampled_from(["CmpltTO", "TOTAL_ERR_NONFATAL"]), small),
)
devices = st.builds(
    PcieDevice,
    address=st.sampled_from(["0000:41:00.0", "0000:42:00.0"]),
    pci_class=st.sampled_from(["0x020000", "0x030200", "0x060400", "0x010802"]),
    current_link_speed_gts=st.sampled_from([2.5, 16.0, 32.0]),
    max_link_speed_gts=st.just(32.0),
    current_link_width=st.sampled_from([4, 8, 16]),
    max_link_width=st.just(16),
    retrains=small,
    aer=st.none() | aer,
)
fans = st.builds(
    Fan,
    sensor=st.sampled_from(["fan1", "fan2", "fan3"]),
    rpm=st.none() | st.sampled_from([0.0, 300.0, 900.0, 1000.0, 2000.0]),
    min_rpm=st.none() | st.sampled_from([0.0, 950.0]),
    alarm=st.none() | st.booleans(),
)
temps = st.builds(
    Temperature,
    sensor=st.sampled_from(["temp1", "temp2"]),
    celsius=temps_c,
    crit_celsius=temps_c,
    max_celsius=temps_c,
)
chips = st.builds(
    HwmonChip,
    chip=st.sampled_from(["nct6779", "coretemp"]),
    fans=st.lists(fans, max_size=4).map(tuple),
    temps=st.lists(temps, max_size=2).map(tuple),
)
disks = st.builds(
    SmartDevice,
    device=st.sampled_from(["/dev/nvme0", "/dev/sda"]),
    passed=st.none() | st.booleans(),
    critical_warning=maybe_small,
    media_errors=maybe_small,
    percentage_used=st.none() | st.sampled_from([0, 80, 100, 120]),
    available_spare=st.none() | st.sampled_from([0, 20, 100]),
    reallocated_sectors=st.none() | st.sampled_from([0, 10, 500]),
    pending_sectors=maybe_small,
    grown_defects=st.none() | st.sampled_from([0, 100]),
)
sensors = st.builds(
    BmcSensor,
    name=st.just("FAN1"),
    kind=st.just("fan"),
    value=st.none() | st.just(300.0),
    status=st.sampled_from(["ok", "warning", "critical", "unknown"]),
)
bmcs = st.builds(
    BmcReading,
    source=st.sampled_from(["redfish", "ipmi"]),
    reachable=st.booleans(),
    health=st.sampled_from(["OK", "Warning", "Critical", ""]),
    sensors=st.lists(sensors, max_size=2).map(tuple),
)
runs = st.builds(
    CollectorRun,
    collector=st.sampled_from(["edac", "smart"]),
    duration_s=st.just(0.1),
    success=st.booleans(),
)


@st.composite
def batches(draw: st.DrawFn, offset_s: float = 0.0) -> TelemetryBatch:
    return batch(
        offset_s,
        edac=tuple(draw(st.lists(controllers, max_size=2))),
        pcie=tuple(draw(st.lists(devices, max_size=2))),
        hwmon=tuple(draw(st.lists(chips, max_size=2))),
        smart=tuple(draw(st.lists(disks, max_size=2))),
        bmc=tuple(draw(st.lists(bmcs, max_size=1))),
        collectors=tuple(draw(st.lists(runs, max_size=2))),
    )


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
