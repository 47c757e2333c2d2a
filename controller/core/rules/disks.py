"""Disk (SMART) rules: the drive's own verdict, NVMe health, and growth of bad-sector counts.

Bad-sector and media-error counts are judged twice: their *growth* over the rule's window
(a disk getting worse now) and their *total* (old damage, usually a milder warning).
"""

from __future__ import annotations

from collections.abc import Iterator

from metalguard.controller.core.rules.base import (
    Context,
    Finding,
    configured,
    finding,
    flagged,
    plural,
    reads,
)
from metalguard.controller.core.scoring.config import FlagRule, GrowthRule, LevelRule, ThresholdRule
from metalguard.proto.telemetry import NVME_CRITICAL_WARNING_BITS, SmartDevice, TelemetryBatch

CRITICAL_WARNING_BITS = 8

GROWTH_RULES: tuple[tuple[str, str, str], ...] = (
    ("nvme_media_errors", "media_errors", "media error"),
    ("ata_reallocated", "reallocated_sectors", "reallocated sector"),
    ("ata_pending", "pending_sectors", "pending sector"),
    ("ata_offline_uncorrectable", "offline_uncorrectable", "offline uncorrectable sector"),
    ("ata_reported_uncorrectable", "reported_uncorrectable", "reported uncorrectable error"),
    ("scsi_grown_defects", "grown_defects", "grown defect"),
)
"""(rule key, SmartDevice field, what it counts, singular)"""


@reads("smart")
def counters(batch: TelemetryBatch) -> Iterator[tuple[str, int]]:
    """Per disk: every counter a growth rule judges."""
    for disk in batch.smart:
        for _rule, field, _what in GROWTH_RULES:
            value = getattr(disk, field)
            if value is not None:
                yield _key(disk, field), value


@reads("smart")
@configured
def smart_failed(ctx: Context, rule: FlagRule) -> Iterator[Finding]:
    """The drive's overall-health self-assessment failed: fatal by default."""
    for disk in ctx.batch.smart:
        if disk.passed is False:
            yield flagged(
                "smart_failed",
                rule,
                signal="smart.passed",
                value=False,
                threshold=None,
                message=f"{_subject(disk)} failed its SMART overall-health self-assessment",
            )


@reads("smart")
@configured
def nvme_critical_warning(ctx: Context, rule: FlagRule) -> Iterator[Finding]:
    """Any NVMe critical-warning bit set."""
    for disk in ctx.batch.smart:
        if disk.critical_warning:
            yield flagged(
                "nvme_critical_warning",
                rule,
                signal="smart.critical_warning",
                value=disk.critical_warning,
                threshold=0,
                message=f"{_subject(disk)} raises critical warning "
                f"{disk.critical_warning:#04x} ({_bits(disk.critical_warning)})",
            )


@reads("smart")
@configured
def nvme_wear(ctx: Context, rule: LevelRule) -> Iterator[Finding]:
    """NVMe ``percentage_used`` (rated endurance spent) at the warning or severe level."""
    for disk in ctx.batch.smart:
        used = disk.percentage_used
        if used is None or used < rule.warning_threshold:
            continue
        severe = used >= rule.severe_threshold
        threshold = rule.severe_threshold if severe else rule.warning_threshold
        yield finding(
            "nvme_wear",
            "severe" if severe else "warning",
            rule.severe_penalty if severe else rule.warning_penalty,
            signal="smart.percentage_used",
            value=used,
            threshold=threshold,
            message=f"{_subject(disk)} has used {used}% of its rated endurance (>= {threshold:g}%)",
        )


@reads("smart")
@configured
def nvme_spare(ctx: Context, rule: ThresholdRule) -> Iterator[Finding]:
    """NVMe ``available_spare`` at or below the threshold (percent)."""
    for disk in ctx.batch.smart:
        spare = disk.available_spare
        if spare is not None and spare <= rule.threshold:
            yield flagged(
                "nvme_spare",
                rule,
                signal="smart.available_spare",
                value=spare,
                threshold=rule.threshold,
                message=f"{_subject(disk)} has {spare}% spare left (<= {rule.threshold:g}%)",
            )


def growth(ctx: Context) -> Iterator[Finding]:
    """Every growth rule: counts that grew within the window, else totals past a threshold."""
    if not ctx.batch.smart:
        return  # no disk: nothing to judge (the usual case on a node without smartctl)
    for key, field, what in GROWTH_RULES:
        rule: GrowthRule = getattr(ctx.rules, key)
        if not rule.enabled:
            continue
        for disk in ctx.batch.smart:
            total = getattr(disk, field)
            if total is not None:
                yield from _growth(ctx, key, rule, disk, field, what, total)


def _growth(
    ctx: Context, key: str, rule: GrowthRule, disk: SmartDevice, field: str, what: str, total: int
) -> Iterator[Finding]:
    grown = ctx.signals.increase(_key(disk, field), rule.window_s, ctx.now)
    if rule.growth_threshold > 0 and grown >= rule.growth_threshold:
        yield finding(
            key,
            rule.growth_severity,
            rule.growth_penalty,
            signal=f"smart.{field}.growth",
            value=grown,
            threshold=rule.growth_threshold,
            message=f"{_subject(disk)}: {plural(grown, 'new ' + what)} "
            f"in the last {rule.window_s:g} s (now {total})",
        )
    elif rule.total_threshold > 0 and total >= rule.total_threshold:
        yield finding(
            key,
            rule.total_severity,
            rule.total_penalty,
            signal=f"smart.{field}",
            value=total,
            threshold=rule.total_threshold,
            message=f"{_subject(disk)} has {plural(total, what)} (>= {rule.total_threshold:g})",
        )


RULES = (smart_failed, nvme_critical_warning, nvme_wear, nvme_spare, growth)


def _key(disk: SmartDevice, field: str) -> str:
    """History key: the device path with model and serial, so a swapped disk starts anew."""
    return f"smart.{disk.device}|{disk.model}|{disk.serial}.{field}"


def _subject(disk: SmartDevice) -> str:
    details = [
        part for part in (disk.model, f"serial {disk.serial}" if disk.serial else "") if part
    ]
    return f"{disk.device} ({', '.join(details)})" if details else disk.device


def _bits(value: int) -> str:
    names = [
        NVME_CRITICAL_WARNING_BITS.get(bit, f"bit {bit}")
        for bit in range(CRITICAL_WARNING_BITS)
        if value >> bit & 1
    ]
    return ", ".join(names)
