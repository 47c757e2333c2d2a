"""Out-of-band rules: what the BMC says about the node's health and its sensors.

An unreachable BMC says nothing about the node (the management path is independent of
the data path): rule ``bmc_unreachable`` is a note by default and costs nothing.
"""

from __future__ import annotations

from collections.abc import Iterator

from metalguard.controller.core.rules.base import (
    Context,
    Finding,
    configured,
    finding,
    flagged,
    reads,
)
from metalguard.controller.core.scoring.config import FlagRule, LevelPenalties
from metalguard.proto.telemetry import BmcReading, BmcSensor

HEALTH_SEVERE = "critical"
HEALTH_WARNING = "warning"
"""Health and sensor status words (Redfish ``Status.Health``; normalised sensor status)."""


@reads("bmc")
@configured
def bmc_health(ctx: Context, rule: LevelPenalties) -> Iterator[Finding]:
    """The BMC's overall health: Critical is severe, Warning a warning."""
    for reading in ctx.batch.bmc:
        health = reading.health.strip().lower()
        if not reading.reachable or health not in (HEALTH_SEVERE, HEALTH_WARNING):
            continue
        severe = health == HEALTH_SEVERE
        yield finding(
            "bmc_health",
            "severe" if severe else "warning",
            rule.severe_penalty if severe else rule.warning_penalty,
            signal="bmc.health",
            value=reading.health,
            threshold=HEALTH_SEVERE if severe else HEALTH_WARNING,
            message=f"the BMC ({reading.source}) reports health {reading.health}"
            + (f": {reading.message}" if reading.message else ""),
        )


@reads("bmc")
@configured
def bmc_sensor(ctx: Context, rule: LevelPenalties) -> Iterator[Finding]:
    """A BMC sensor in critical (severe) or warning status."""
    for reading in ctx.batch.bmc:
        for sensor in reading.sensors:
            status = sensor.status.strip().lower()
            if status not in (HEALTH_SEVERE, HEALTH_WARNING):
                continue
            severe = status == HEALTH_SEVERE
            yield finding(
                "bmc_sensor",
                "severe" if severe else "warning",
                rule.severe_penalty if severe else rule.warning_penalty,
                signal="bmc.sensor",
                value=sensor.value,
                threshold=_crossed(sensor),
                message=f"BMC ({reading.source}) {sensor.kind} sensor {sensor.name!r} "
                f"is {status}{_reading(sensor)}",
            )


@reads("bmc")
@configured
def bmc_unreachable(ctx: Context, rule: FlagRule) -> Iterator[Finding]:
    """A BMC source that did not answer (a note by default)."""
    for reading in ctx.batch.bmc:
        if not reading.reachable:
            yield flagged(
                "bmc_unreachable",
                rule,
                signal="bmc.reachable",
                value=False,
                message=_unreachable(reading),
            )


RULES = (bmc_health, bmc_sensor, bmc_unreachable)


def _crossed(sensor: BmcSensor) -> float | None:
    """The critical limit the value is past, else the one it is nearest to."""
    value, low, high = sensor.value, sensor.lower_critical, sensor.upper_critical
    if value is not None and low is not None and value <= low:
        return low
    return high if high is not None else low


def _reading(sensor: BmcSensor) -> str:
    if sensor.value is None:
        return ""
    unit = f" {sensor.unit}" if sensor.unit else ""
    limits = [
        f"{name} {limit:g}"
        for name, limit in (
            ("lower critical", sensor.lower_critical),
            ("upper critical", sensor.upper_critical),
        )
        if limit is not None
    ]
    return f": {sensor.value:g}{unit}" + (f" ({', '.join(limits)})" if limits else "")


def _unreachable(reading: BmcReading) -> str:
    detail = f": {reading.message}" if reading.message else ""
    return f"the BMC ({reading.source}) did not answer{detail}"
