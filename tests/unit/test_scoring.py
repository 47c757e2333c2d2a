"""The scorer, table-driven: every rule fires at its threshold and not just below it.

Time is injected through ``batch.ts`` (offsets from T0); nothing sleeps.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest

from metalguard.controller.core.rules.disks import GROWTH_RULES
from metalguard.controller.core.scoring.config import RULE_KEYS, Severity
from metalguard.proto.telemetry import CollectorError, CollectorRun, EdacController, EdacCsrow
from tests.support.rule_cases import GPU_CASES, KMSG_CASES, NETWORK_CASES, RDMA_CASES
from tests.support.scoring_helpers import (
    DIMM_LABEL,
    Step,
    bmc,
    by_rule,
    dimm_mc,
    disk,
    fans,
    pci,
    run,
    temp,
)


class Case(NamedTuple):
    id: str
    steps: list[Step]
    rule: str
    severity: Severity | None
    """None: the rule must not fire, and nothing else either."""


def one(**readings: Any) -> list[Step]:
    """A single batch."""
    return [(0.0, readings)]


def two(first: dict[str, Any], second: dict[str, Any], after_s: float = 1800.0) -> list[Step]:
    """A baseline batch and one ``after_s`` later."""
    return [(0.0, first), (after_s, second)]


def csrow_mc(**counts: int) -> EdacController:
    row = EdacCsrow(csrow=0, ce_count=counts.get("ce", 0), ue_count=counts.get("ue", 0))
    return EdacController(mc=0, csrows=(row,))


def ce(n: int) -> dict[str, Any]:
    return {"edac": (dimm_mc(ce=n),)}


def cor(n: int, key: str = "TOTAL_ERR_COR") -> dict[str, Any]:
    return {"pcie": (pci(cor={key: n}),)}


def growth_cases() -> list[Case]:
    cases = []
    for rule, field, _what in GROWTH_RULES:
        growth_sev: Severity = "warning" if rule == "scsi_grown_defects" else "severe"
        total = {"ata_reallocated": 10, "scsi_grown_defects": 100}.get(rule, 1)
        cases += [
            Case(
                f"{rule} grows by 1",
                two({"smart": (disk(**{field: 0}),)}, {"smart": (disk(**{field: 1}),)}),
                rule,
                growth_sev,
            ),
            Case(
                f"{rule} total at threshold",
                one(smart=(disk(**{field: total}),)),
                rule,
                "warning",
            ),
            Case(
                f"{rule} total just below, no growth",
                two(
                    {"smart": (disk(**{field: total - 1}),)},
                    {"smart": (disk(**{field: total - 1}),)},
                ),
                rule,
                None,
            ),
        ]
    return cases


CASES: list[Case] = [
    # memory
    Case("ue on a DIMM", one(edac=(dimm_mc(ue=1),)), "ecc_uncorrectable", "fatal"),
    Case("no ue", one(edac=(dimm_mc(ue=0),)), "ecc_uncorrectable", None),
    Case(
        "ue on the controller only",
        one(edac=(EdacController(mc=0, ue_count=1),)),
        "ecc_uncorrectable",
        "fatal",
    ),
    Case(
        "ue without DIMM information",
        one(edac=(EdacController(mc=0, ue_count=0, ue_noinfo_count=1),)),
        "ecc_uncorrectable",
        "fatal",
    ),
    Case("ue on a csrow", one(edac=(csrow_mc(ue=1),)), "ecc_uncorrectable", "fatal"),
    Case("ce 10/h", two(ce(0), ce(10)), "ecc_correctable_rate", "warning"),
    Case("ce 9/h", two(ce(0), ce(9)), "ecc_correctable_rate", None),
    Case("ce 100/h", two(ce(0), ce(100), after_s=3600), "ecc_correctable_rate", "severe"),
    Case("ce 99/h", two(ce(0), ce(99), after_s=3600), "ecc_correctable_rate", "warning"),
    Case(
        "ce on the controller only",
        two(
            {"edac": (EdacController(mc=0, ce_count=0),)},
            {"edac": (EdacController(mc=0, ce_count=100),)},
        ),
        "ecc_correctable_rate",
        "severe",
    ),
    Case(
        "ce on a csrow",
        two({"edac": (csrow_mc(ce=0),)}, {"edac": (csrow_mc(ce=10),)}),
        "ecc_correctable_rate",
        "warning",
    ),
    Case(
        "old ce totals are a baseline",
        one(edac=(dimm_mc(ce=10_000),)),
        "ecc_correctable_rate",
        None,
    ),
    # PCIe AER
    Case("aer fatal total", one(pcie=(pci(fatal={"TOTAL_ERR_FATAL": 1}),)), "aer_fatal", "fatal"),
    Case(
        "aer fatal named",
        one(pcie=(pci(fatal={"DLP": 1, "TOTAL_ERR_FATAL": 0}),)),
        "aer_fatal",
        "fatal",
    ),
    Case(
        "aer fatal zero",
        one(pcie=(pci(fatal={"DLP": 0, "TOTAL_ERR_FATAL": 0}),)),
        "aer_fatal",
        None,
    ),
    Case(
        "aer nonfatal",
        one(pcie=(pci(nonfatal={"TOTAL_ERR_NONFATAL": 1}),)),
        "aer_nonfatal",
        "fatal",
    ),
    Case(
        "aer nonfatal zero",
        one(pcie=(pci(nonfatal={"TOTAL_ERR_NONFATAL": 0}),)),
        "aer_nonfatal",
        None,
    ),
    Case("aer cor 10/h", two(cor(0), cor(10)), "aer_correctable_rate", "warning"),
    Case("aer cor 9/h", two(cor(0), cor(9), after_s=3600), "aer_correctable_rate", None),
    Case("aer cor 100/h", two(cor(0), cor(100)), "aer_correctable_rate", "severe"),
    Case(
        "aer cor summed without a total",
        two(cor(0, "RxErr"), cor(100, "RxErr")),
        "aer_correctable_rate",
        "severe",
    ),
    # PCIe links
    Case("NIC width x8 of x16", one(pcie=(pci(width=8),)), "link_downgrade", "severe"),
    Case("NIC at full width and speed", one(pcie=(pci(),)), "link_downgrade", None),
    Case("NIC speed 16 of 32", one(pcie=(pci(speed=16.0),)), "link_downgrade", "severe"),
    Case("InfiniBand width", one(pcie=(pci("0x020700", width=4),)), "link_downgrade", "severe"),
    Case("GPU width", one(pcie=(pci("0x030200", width=8),)), "link_downgrade", "severe"),
    Case(
        "GPU idle speed is no downgrade",
        one(pcie=(pci("0x030200", speed=2.5),)),
        "link_downgrade",
        None,
    ),
    Case("accelerator speed", one(pcie=(pci("0x120000", speed=16.0),)), "link_downgrade", "severe"),
    Case("bridge width", one(pcie=(pci("0x060400", width=4),)), "link_downgrade_other", "warning"),
    Case("NVMe speed", one(pcie=(pci("0x010802", speed=8.0),)), "link_downgrade_other", "warning"),
    Case("bridge at full width", one(pcie=(pci("0x060400"),)), "link_downgrade_other", None),
    Case(
        "3 retrains within the hour",
        two({"pcie": (pci(retrains=0),)}, {"pcie": (pci(retrains=3),)}),
        "link_retrains",
        "warning",
    ),
    Case(
        "2 retrains within the hour",
        two({"pcie": (pci(retrains=0),)}, {"pcie": (pci(retrains=2),)}),
        "link_retrains",
        None,
    ),
    # disks
    Case("SMART failed", one(smart=(disk(passed=False),)), "smart_failed", "fatal"),
    Case("SMART passed", one(smart=(disk(passed=True),)), "smart_failed", None),
    Case(
        "critical warning",
        one(smart=(disk(critical_warning=4),)),
        "nvme_critical_warning",
        "severe",
    ),
    Case(
        "no critical warning", one(smart=(disk(critical_warning=0),)), "nvme_critical_warning", None
    ),
    Case("wear 80%", one(smart=(disk(percentage_used=80),)), "nvme_wear", "warning"),
    Case("wear 79%", one(smart=(disk(percentage_used=79),)), "nvme_wear", None),
    Case("wear 100%", one(smart=(disk(percentage_used=100),)), "nvme_wear", "severe"),
    Case("wear 99%", one(smart=(disk(percentage_used=99),)), "nvme_wear", "warning"),
    Case("spare 20%", one(smart=(disk(available_spare=20),)), "nvme_spare", "warning"),
    Case("spare 21%", one(smart=(disk(available_spare=21),)), "nvme_spare", None),
    *growth_cases(),
    # cooling
    Case("fan at 0 rpm", one(hwmon=fans(0.0, min_rpm=600.0)), "fan_stopped", "severe"),
    Case("fan at 1 rpm, no minimum", one(hwmon=fans(1.0, min_rpm=0.0)), "fan_stopped", None),
    Case(
        "fan below its minimum", one(hwmon=fans(1999.0, min_rpm=2000.0)), "fan_below_min", "warning"
    ),
    Case("fan at its minimum", one(hwmon=fans(2000.0, min_rpm=2000.0)), "fan_below_min", None),
    Case("fan alarm", one(hwmon=fans(2000.0, alarm=True)), "fan_alarm", "warning"),
    Case("no fan alarm", one(hwmon=fans(2000.0, alarm=False)), "fan_alarm", None),
    Case(
        "fan below half its peers",
        one(hwmon=fans(499.0, 1000.0, 1000.0)),
        "fan_peer_outlier",
        "warning",
    ),
    Case("fan at half its peers", one(hwmon=fans(500.0, 1000.0, 1000.0)), "fan_peer_outlier", None),
    Case("too few fans to compare", one(hwmon=fans(100.0, 1000.0)), "fan_peer_outlier", None),
    Case("temp at crit", one(hwmon=temp(100.0, crit=100.0)), "temp_critical", "fatal"),
    Case("temp at crit - 5", one(hwmon=temp(95.0, crit=100.0)), "temp_near_critical", "severe"),
    Case("temp below crit - 5", one(hwmon=temp(94.9, crit=100.0)), "temp_near_critical", None),
    Case("temp at max", one(hwmon=temp(80.0, high=80.0)), "temp_above_max", "warning"),
    Case("temp below max", one(hwmon=temp(79.9, crit=100.0, high=80.0)), "temp_above_max", None),
    Case("crit 0 means unset", one(hwmon=temp(40.0, crit=0.0, high=0.0)), "temp_critical", None),
    # out of band
    Case("BMC Critical", one(bmc=bmc(health="Critical")), "bmc_health", "severe"),
    Case("BMC Warning", one(bmc=bmc(health="Warning")), "bmc_health", "warning"),
    Case("BMC OK", one(bmc=bmc(health="OK")), "bmc_health", None),
    Case("BMC sensor critical", one(bmc=bmc(sensor_status="critical")), "bmc_sensor", "severe"),
    Case("BMC sensor warning", one(bmc=bmc(sensor_status="warning")), "bmc_sensor", "warning"),
    Case("BMC sensor ok", one(bmc=bmc(sensor_status="ok")), "bmc_sensor", None),
    Case("BMC unreachable", one(bmc=bmc(reachable=False)), "bmc_unreachable", "info"),
    Case("BMC reachable", one(bmc=bmc(reachable=True)), "bmc_unreachable", None),
    # the telemetry itself
    Case(
        "collector failed",
        one(collectors=(CollectorRun(collector="smart", duration_s=1.0, success=False),)),
        "collector_failed",
        "warning",
    ),
    Case(
        "collector ok",
        one(collectors=(CollectorRun(collector="smart", duration_s=1.0, success=True),)),
        "collector_failed",
        None,
    ),
    Case("a counter drops", two(ce(50), ce(3)), "counter_reset", "info"),
    Case("a counter stays", two(ce(50), ce(50)), "counter_reset", None),
]
CASES += [Case(*c) for c in NETWORK_CASES]  # the network, GPU and RDMA rules' tables
CASES += [Case(*c) for c in GPU_CASES]  # are shared with their own tests (rule_cases.py)
CASES += [Case(*c) for c in RDMA_CASES]
CASES += [Case(*c) for c in KMSG_CASES]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_rule(case: Case) -> None:
    _signals, assessment = run(case.steps)
    if case.severity is None:
        assert assessment.findings == ()
        assert assessment.notes == ()
        assert assessment.score == 100.0
        assert assessment.grade == "HEALTHY"
        return
    severities = {f.severity for f in assessment.findings if f.reason.rule == case.rule}
    if case.severity == "info":
        assert by_rule(assessment, case.rule)
        assert not severities
        assert assessment.score == 100.0
    else:
        assert severities == {case.severity}
    assert {r.rule for r in (*assessment.reasons, *assessment.notes)} == {case.rule}
    for reason in by_rule(assessment, case.rule):
        assert reason.signal
        assert reason.message
    if case.severity == "fatal":
        assert assessment.fatal
        assert assessment.grade == "FAILING"


def test_every_rule_has_a_firing_case() -> None:
    fired = {c.rule for c in CASES if c.severity is not None}
    silent = {c.rule for c in CASES if c.severity is None}
    assert fired == set(RULE_KEYS)
    assert silent == set(RULE_KEYS)


@pytest.mark.parametrize(
    ("steps", "rule", "signal", "value", "threshold", "message"),
    [
        (
            one(edac=(dimm_mc(ue=1),)),
            "ecc_uncorrectable",
            "edac.ue_count",
            1,
            1,
            f"mc0 DIMM '{DIMM_LABEL}' has 1 uncorrectable ECC error",
        ),
        (
            two(ce(0), ce(120), after_s=600),
            "ecc_correctable_rate",
            "edac.ce_rate",
            120.0,
            100,
            f"mc0 DIMM '{DIMM_LABEL}': 120 correctable ECC errors in the last 3600 s "
            "(120.0/h, severe at 100/h)",
        ),
        (
            one(pcie=(pci(fatal={"MalfTLP": 2, "TOTAL_ERR_FATAL": 2}),)),
            "aer_fatal",
            "pcie.aer.fatal",
            2,
            1,
            "0000:41:00.0 (class 0x020000) has 2 fatal AER errors (MalfTLP 2)",
        ),
        (
            one(pcie=(pci(width=8, speed=16.0),)),
            "link_downgrade",
            "pcie.link_downgrade",
            "16 GT/s x8",
            "32 GT/s x16",
            "link of 0000:41:00.0 (class 0x020000) runs at 16 GT/s x8, below its max 32 GT/s x16",
        ),
        (
            two({"smart": (disk(media_errors=2),)}, {"smart": (disk(media_errors=5),)}),
            "nvme_media_errors",
            "smart.media_errors.growth",
            3,
            1,
            "/dev/nvme0 (M, serial S1): 3 new media errors in the last 86400 s (now 5)",
        ),
        (
            one(smart=(disk(critical_warning=0x11),)),
            "nvme_critical_warning",
            "smart.critical_warning",
            0x11,
            0,
            "/dev/nvme0 (M, serial S1) raises critical warning 0x11 "
            "(available spare below threshold, volatile memory backup failed)",
        ),
        (
            one(hwmon=fans(499.0, 1000.0, 1000.0)),
            "fan_peer_outlier",
            "hwmon.fan_rpm",
            499.0,
            500.0,
            "fan nct6779 fan1 runs at 499 rpm, below 0.5 x the median 1000 rpm "
            "of the node's other 2 fans",
        ),
        (
            one(bmc=bmc(sensor_status="critical")),
            "bmc_sensor",
            "bmc.sensor",
            300.0,
            500.0,
            "BMC (redfish) fan sensor 'FAN1' is critical: 300 RPM (lower critical 500)",
        ),
        (
            one(
                collectors=(CollectorRun(collector="edac", duration_s=0.1, success=False),),
                errors=(CollectorError(collector="edac", message="EIO reading mc0"),),
            ),
            "collector_failed",
            "collector.success",
            False,
            None,
            "collector 'edac' failed: EIO reading mc0",
        ),
    ],
)
def test_reason_fields(
    steps: list[Step],
    rule: str,
    signal: str,
    value: object,
    threshold: object,
    message: str,
) -> None:
    _signals, assessment = run(steps)
    (reason,) = by_rule(assessment, rule)
    assert (reason.signal, reason.value, reason.threshold) == (signal, value, threshold)
    assert reason.message == message


def test_every_kernel_log_kind_an_event_isolates_is_kept_fatal_by_the_batches() -> None:
    """A critical ``kmsg_<kind>`` event isolates at once (decide.is_fatal_event); the
    batch's counts must then keep the node FAILING for the window, or it would come back
    after three clean assessments with its uncorrected memory error."""
    from metalguard.controller.core.decide import FATAL_WHEN_CRITICAL_KINDS
    from metalguard.controller.core.rules.kmsg import CRITICAL_FATAL_KINDS, FATAL_KINDS

    isolating = {
        k.removeprefix("kmsg_") for k in FATAL_WHEN_CRITICAL_KINDS if k.startswith("kmsg_")
    }
    assert isolating == set(FATAL_KINDS) | set(CRITICAL_FATAL_KINDS)
