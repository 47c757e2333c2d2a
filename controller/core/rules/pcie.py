"""PCIe rules: AER error counts and rates, and links running below their maximum."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Literal

from metalguard.controller.core.rules.base import (
    Context,
    Finding,
    configured,
    flagged,
    growth_only,
    plural,
    rate_finding,
    reads,
)
from metalguard.controller.core.scoring.config import RateRule, ThresholdRule, WindowThresholdRule
from metalguard.proto.telemetry import PcieDevice, TelemetryBatch

TOTAL_PREFIX = "TOTAL_ERR_"
"""The kernel's per-severity totals (``TOTAL_ERR_COR``, ``TOTAL_ERR_FATAL``, ...)."""


@reads("pcie")
def counters(batch: TelemetryBatch) -> Iterator[tuple[str, int]]:
    """Per device: correctable AER errors and link retrains."""
    for dev in batch.pcie:
        if dev.aer is not None:
            yield _cor_key(dev), _correctable(dev.aer.correctable)
        yield _retrain_key(dev), dev.retrains


@reads("pcie")
@configured
def aer_fatal(ctx: Context, rule: ThresholdRule) -> Iterator[Finding]:
    """Any fatal AER error (``TOTAL_ERR_FATAL`` or a named counter): fatal by default."""
    yield from _uncorrectable(ctx, "aer_fatal", rule, "fatal")


@reads("pcie")
@configured
def aer_nonfatal(ctx: Context, rule: ThresholdRule) -> Iterator[Finding]:
    """Any non-fatal uncorrectable AER error: fatal by default."""
    yield from _uncorrectable(ctx, "aer_nonfatal", rule, "nonfatal")


def _uncorrectable(
    ctx: Context, key: str, rule: ThresholdRule, kind: Literal["fatal", "nonfatal"]
) -> Iterator[Finding]:
    for dev in ctx.batch.pcie:
        if dev.aer is None:
            continue
        counts = dev.aer.fatal if kind == "fatal" else dev.aer.nonfatal
        if not any(counts.values()):
            continue  # the usual case, checked cheaply
        named = {name: n for name, n in counts.items() if n and not _is_total(name)}
        count = max(counts.get(f"{TOTAL_PREFIX}{kind.upper()}", 0), sum(named.values()))
        if count > 0 and count >= rule.threshold:
            which = ", ".join(f"{name} {n}" for name, n in named.items())
            label = "fatal" if kind == "fatal" else "non-fatal"
            yield flagged(
                key,
                rule,
                signal=f"pcie.aer.{kind}",
                value=count,
                threshold=rule.threshold,
                message=f"{_subject(dev)} has {plural(count, f'{label} AER error')}"
                + (f" ({which})" if which else ""),
            )


@growth_only
@configured
def aer_correctable_rate(ctx: Context, rule: RateRule) -> Iterator[Finding]:
    """Correctable AER errors per hour per device over the rule's window."""
    for dev in ctx.batch.pcie:
        if dev.aer is None:
            continue
        found = rate_finding(
            "aer_correctable_rate",
            rule,
            ctx,
            _cor_key(dev),
            signal="pcie.aer.correctable_rate",
            what="correctable AER errors",
            subject=_subject(dev),
        )
        if found is not None:
            yield found


@reads("pcie")
def link_downgrade(ctx: Context) -> Iterator[Finding]:
    """A link below its max speed or width: ``link_downgrade`` on accelerators and NICs,
    ``link_downgrade_other`` on the rest (bridges, disks, ...)."""
    key_rule, other_rule = ctx.rules.link_downgrade, ctx.rules.link_downgrade_other
    for dev in ctx.batch.pcie:
        if not _downgraded(dev, key_rule.speed_exempt_classes):
            continue
        key_device = _is_class(dev, key_rule.key_classes)
        rule = key_rule if key_device else other_rule
        if not rule.enabled:
            continue
        current = _link(dev.current_link_speed_gts, dev.current_link_width)
        maximum = _link(dev.max_link_speed_gts, dev.max_link_width)
        yield flagged(
            "link_downgrade" if key_device else "link_downgrade_other",
            rule,
            signal="pcie.link_downgrade",
            value=current,
            threshold=maximum,
            message=f"link of {_subject(dev)} runs at {current}, below its max {maximum}",
        )


@growth_only
@configured
def link_retrains(ctx: Context, rule: WindowThresholdRule) -> Iterator[Finding]:
    """Link state changes (downgrades and recoveries) within the rule's window."""
    for dev in ctx.batch.pcie:
        grown = ctx.signals.increase(_retrain_key(dev), rule.window_s, ctx.now)
        if grown > 0 and grown >= rule.threshold:
            yield flagged(
                "link_retrains",
                rule,
                signal="pcie.link_retrains",
                value=grown,
                threshold=rule.threshold,
                message=f"link of {_subject(dev)} changed state {plural(grown, 'time')} "
                f"in the last {rule.window_s:g} s",
            )


RULES = (aer_fatal, aer_nonfatal, aer_correctable_rate, link_downgrade, link_retrains)


def _cor_key(dev: PcieDevice) -> str:
    return f"pcie.{dev.address}.aer.cor"


def _retrain_key(dev: PcieDevice) -> str:
    return f"pcie.{dev.address}.retrains"


def _is_total(name: str) -> bool:
    return name.startswith(TOTAL_PREFIX)


def _correctable(counts: Mapping[str, int]) -> int:
    """``TOTAL_ERR_COR``, else the sum of the named correctable counters."""
    total = counts.get(f"{TOTAL_PREFIX}COR")
    return total if total is not None else sum(n for k, n in counts.items() if not _is_total(k))


def _downgraded(dev: PcieDevice, speed_exempt: tuple[str, ...]) -> bool:
    """Below max width, or below max speed unless the class is exempt from speed drops.

    Without both readings of either pair, the agent's own ``downgraded`` flag decides.
    """
    width = (dev.current_link_width, dev.max_link_width)
    speed = (dev.current_link_speed_gts, dev.max_link_speed_gts)
    if None in width and None in speed:
        return dev.downgraded
    if _below(*width):
        return True
    return _below(*speed) and not _is_class(dev, speed_exempt)


def _is_class(dev: PcieDevice, prefixes: tuple[str, ...]) -> bool:
    cls = dev.pci_class.lower()
    return any(cls.startswith(prefix.lower()) for prefix in prefixes)


def _below(current: float | None, maximum: float | None) -> bool:
    return current is not None and maximum is not None and current < maximum


def _link(speed: float | None, width: int | None) -> str:
    gts = "? GT/s" if speed is None else f"{speed:g} GT/s"
    return f"{gts} x{'?' if width is None else width}"


def _subject(dev: PcieDevice) -> str:
    return f"{dev.address} (class {dev.pci_class or 'unknown'})"
