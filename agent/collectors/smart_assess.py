"""Pure judgement of one :class:`SmartDevice`: which problems it shows, how bad each is.

The thresholds are data (:class:`SmartThresholds`), documented in docs/collectors-smart.md.
Only actionable signs are problems: ATA error-log records (exit bit 6), past threshold
crossings (bit 5), NVMe error-log entries and unsafe shutdowns are not, because healthy
disks accumulate them (a UDMA CRC error from a cable, thousands of benign NVMe
error-log entries for unsupported commands).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from metalguard.agent.collectors.smart_parse import (
    ExitStatus,
    decode_exit_status,
    describe_critical_warning,
)
from metalguard.proto.telemetry import SmartDevice

Severity = Literal["failing", "degraded"]
"""failing: replace or drain now; degraded: still working, plan a replacement."""


@dataclass(frozen=True, slots=True)
class SmartThresholds:
    """Where a reading becomes a problem.  Counts trigger at ``>=`` the value."""

    worn_percentage_used: int = 50
    """NVMe percentage_used: half the vendor's rated endurance spent -> degraded (worn)."""
    worn_out_percentage_used: int = 100
    """NVMe percentage_used: rated endurance reached -> failing (worn_out)."""
    low_spare_percent: int = 20
    """NVMe available_spare at or below this -> degraded (the drive's own threshold,
    usually 5-10 %, raises critical-warning bit 0, which makes it failing)."""
    media_errors: int = 1
    reallocated_sectors: int = 1
    pending_sectors: int = 1
    offline_uncorrectable: int = 1
    reported_uncorrectable: int = 1
    grown_defects: int = 1
    hot_celsius: float = 70.0
    """Current temperature at or above this -> degraded (hot)."""


DEFAULT_THRESHOLDS = SmartThresholds()


@dataclass(frozen=True, slots=True)
class SmartProblem:
    """One sign of trouble on one disk."""

    kind: str
    """failed | prefail_threshold | worn_out | worn | low_spare | media_errors |
    reallocated | pending | offline_uncorrectable | reported_uncorrectable |
    grown_defects | selftest_errors | hot"""
    severity: Severity
    value: int | float | bool | None
    threshold: int | float | None
    message: str


def assess(
    device: SmartDevice, thresholds: SmartThresholds = DEFAULT_THRESHOLDS
) -> list[SmartProblem]:
    """The problems ``device`` shows under ``thresholds``, failing ones first.

    Unknown (None) fields never make a problem.
    """
    t = thresholds
    out: list[SmartProblem] = []
    flags = decode_exit_status(device.exit_status or 0)

    if device.passed is False:
        why = "SMART overall health self-assessment failed"
        if device.critical_warning:
            bits = ", ".join(describe_critical_warning(device.critical_warning))
            why += f": critical warning {device.critical_warning:#04x} ({bits})"
        out.append(SmartProblem("failed", "failing", False, None, why))
    if ExitStatus.PREFAIL_AT_THRESHOLD in flags:
        msg = "a prefailure attribute is at or below its threshold now"
        out.append(SmartProblem("prefail_threshold", "failing", True, None, msg))

    used = device.percentage_used
    if used is not None and used >= t.worn_out_percentage_used:
        msg = f"rated endurance used up: percentage_used {used}%"
        out.append(SmartProblem("worn_out", "failing", used, t.worn_out_percentage_used, msg))
    elif used is not None and used >= t.worn_percentage_used:
        msg = f"worn: percentage_used {used}% (>= {t.worn_percentage_used}%)"
        out.append(SmartProblem("worn", "degraded", used, t.worn_percentage_used, msg))

    spare = device.available_spare
    if spare is not None and spare <= t.low_spare_percent:
        msg = f"available spare {spare}% (<= {t.low_spare_percent}%)"
        out.append(SmartProblem("low_spare", "degraded", spare, t.low_spare_percent, msg))

    counts: tuple[tuple[str, int | None, int, str], ...] = (
        ("media_errors", device.media_errors, t.media_errors, "NVMe media errors"),
        ("reallocated", device.reallocated_sectors, t.reallocated_sectors, "reallocated sectors"),
        ("pending", device.pending_sectors, t.pending_sectors, "pending sectors"),
        (
            "offline_uncorrectable",
            device.offline_uncorrectable,
            t.offline_uncorrectable,
            "offline uncorrectable sectors",
        ),
        (
            "reported_uncorrectable",
            device.reported_uncorrectable,
            t.reported_uncorrectable,
            "reported uncorrectable errors",
        ),
        ("grown_defects", device.grown_defects, t.grown_defects, "grown defects (SCSI)"),
    )
    for kind, value, limit, label in counts:
        if value is not None and value >= limit:
            out.append(SmartProblem(kind, "degraded", value, limit, f"{value} {label}"))

    if ExitStatus.SELFTEST_LOG_HAS_ERRORS in flags:
        msg = "the self-test log has errors"
        out.append(SmartProblem("selftest_errors", "degraded", True, None, msg))
    temp = device.temperature_c
    if temp is not None and temp >= t.hot_celsius:
        msg = f"temperature {temp:g} C (>= {t.hot_celsius:g} C)"
        out.append(SmartProblem("hot", "degraded", temp, t.hot_celsius, msg))
    return out


def is_failing(problems: list[SmartProblem]) -> bool:
    """Whether any problem says the disk is failing (as opposed to degraded)."""
    return any(p.severity == "failing" for p in problems)
