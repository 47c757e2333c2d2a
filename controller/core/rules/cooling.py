"""Cooling rules: fans stopped, slow, alarmed or far below their peers; hot sensors.

Each fan and each temperature sensor yields at most one finding, the worst that applies
(a stopped fan is not also "below its minimum"). hwmon limits of 0 °C or below are
treated as unset: several drivers report 0 when they have no limit.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator

from metalguard.controller.core.rules.base import Context, Finding, flagged, reads
from metalguard.controller.core.scoring.config import FanPeerRule
from metalguard.proto.telemetry import Fan, Temperature

UNSET_LIMIT_CELSIUS = 0.0


@reads("hwmon")
def fans(ctx: Context) -> Iterator[Finding]:
    """Rules ``fan_stopped``, ``fan_below_min``, ``fan_alarm`` and ``fan_peer_outlier``."""
    rules = ctx.rules
    readings = [(chip.chip, fan) for chip in ctx.batch.hwmon for fan in chip.fans]
    spinning = [fan.rpm for _, fan in readings if fan.rpm is not None and fan.rpm > 0]
    peer = rules.fan_peer_outlier
    # A fan at or above ratio x the fastest one cannot be below ratio x any median.
    peer_floor = peer.ratio * max(spinning) if spinning else 0.0
    for chip, fan in readings:
        rpm, low = fan.rpm, fan.min_rpm
        if (
            rpm is not None
            and rpm >= peer_floor
            and not fan.alarm
            and not (low and rpm < low)
            and rpm > 0
        ):
            continue  # the usual case: nothing to find, no name to format
        name = f"{chip} {fan.sensor}" + (f" {fan.label!r}" if fan.label else "")
        if rules.fan_stopped.enabled and rpm is not None and rpm <= 0:
            yield flagged(
                "fan_stopped",
                rules.fan_stopped,
                signal="hwmon.fan_rpm",
                value=rpm,
                threshold=low if low else None,
                message=f"fan {name} has stopped (0 rpm" + (f", minimum {low:g})" if low else ")"),
            )
        elif rules.fan_below_min.enabled and rpm is not None and low and 0 < rpm < low:
            yield flagged(
                "fan_below_min",
                rules.fan_below_min,
                signal="hwmon.fan_rpm",
                value=rpm,
                threshold=low,
                message=f"fan {name} runs at {rpm:g} rpm, below its minimum {low:g}",
            )
        elif rules.fan_alarm.enabled and fan.alarm:
            yield flagged(
                "fan_alarm",
                rules.fan_alarm,
                signal="hwmon.fan_alarm",
                value=True,
                message=f"fan {name} raises its alarm",
            )
        elif rules.fan_peer_outlier.enabled:
            yield from _peer_outlier(rules.fan_peer_outlier, name, fan, spinning)


def _peer_outlier(
    rule: FanPeerRule, name: str, fan: Fan, spinning: list[float]
) -> Iterator[Finding]:
    rpm = fan.rpm
    if rpm is None or rpm <= 0 or len(spinning) < rule.min_fans:
        return
    peers = list(spinning)
    peers.remove(rpm)
    floor = rule.ratio * statistics.median(peers)
    if rpm < floor:
        yield flagged(
            "fan_peer_outlier",
            rule,
            signal="hwmon.fan_rpm",
            value=rpm,
            threshold=round(floor, 1),
            message=f"fan {name} runs at {rpm:g} rpm, below {rule.ratio:g} x the median "
            f"{statistics.median(peers):g} rpm of the node's other {len(peers)} fans",
        )


@reads("hwmon")
def temperatures(ctx: Context) -> Iterator[Finding]:
    """Rules ``temp_critical``, ``temp_near_critical`` and ``temp_above_max``."""
    margin = ctx.rules.temp_near_critical.margin_celsius
    for chip in ctx.batch.hwmon:
        for temp in chip.temps:
            c, crit, high = temp.celsius, temp.crit_celsius, temp.max_celsius
            if c is None or ((crit is None or c < crit - margin) and (high is None or c < high)):
                continue  # the usual case: below every limit (unset ones included)
            name = f"{chip.chip} {temp.sensor}" + (f" {temp.label!r}" if temp.label else "")
            found = _temperature(ctx, name, temp)
            if found is not None:
                yield found


def _temperature(ctx: Context, name: str, temp: Temperature) -> Finding | None:
    rules = ctx.rules
    c = temp.celsius
    if c is None:
        return None
    crit = _limit(temp.crit_celsius)
    high = _limit(temp.max_celsius)
    if crit is not None and rules.temp_critical.enabled and c >= crit:
        return flagged(
            "temp_critical",
            rules.temp_critical,
            signal="hwmon.temperature",
            value=c,
            threshold=crit,
            message=f"{name} is at {c:g} °C, at or above its critical {crit:g} °C",
        )
    near = rules.temp_near_critical
    if crit is not None and near.enabled and crit - near.margin_celsius <= c < crit:
        return flagged(
            "temp_near_critical",
            near,
            signal="hwmon.temperature",
            value=c,
            threshold=crit - near.margin_celsius,
            message=f"{name} is at {c:g} °C, within {near.margin_celsius:g} °C "
            f"of its critical {crit:g} °C",
        )
    if high is not None and rules.temp_above_max.enabled and c >= high:
        return flagged(
            "temp_above_max",
            rules.temp_above_max,
            signal="hwmon.temperature",
            value=c,
            threshold=high,
            message=f"{name} is at {c:g} °C, at or above its max {high:g} °C",
        )
    return None


def _limit(celsius: float | None) -> float | None:
    return celsius if celsius is not None and celsius > UNSET_LIMIT_CELSIUS else None


RULES = (fans, temperatures)
