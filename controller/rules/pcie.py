"""PCIe rules: AER error counts and rates, and links running below their maximum."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from controller.rules.base import Context, Finding, finding, flagged, plural, rate_finding
from proto.telemetry import PcieDevice, TelemetryBatch

TOTAL_PREFIX = "TOTAL_ERR_"
"""The kernel's per-severity totals (``TOTAL_ERR_COR``, ``TOTAL_ERR_FATAL``, ...)."""


def counters(batch: TelemetryBatch) -> Iterator[tuple[str, int]]:
    """Per device: correctable AER errors and link retrains."""
    for dev in batch.pcie:
        if dev.aer is not None:
            yield _cor_key(dev), _total(dev.aer.correctable, "TOTAL_ERR_COR")
        yield _retrain_key(dev), dev.retrains


def aer_uncorrectable(ctx: Context) -> Iterator[Finding]:
    """Any fatal (rule ``aer_fatal``) or non-fatal (``aer_nonfatal``) AER error."""
    for key, counts, total, kind in (
        ("aer_fatal", "fatal", "TOTAL_ERR_FATAL", "fatal"),
        ("aer_nonfatal", "nonfatal", "TOTAL_ERR_NONFATAL", "non-fatal"),
    ):
        rule = ctx.rules.aer_fatal if key == "aer_fatal" else ctx.rules.aer_nonfatal
        if not rule.enabled:
            continue
        for dev in ctx.batch.pcie:
            if dev.aer is None:
                continue
            named: Mapping[str, int] = getattr(dev.aer, counts)
            count = _total(named, total)
            if count > 0 and count >= rule.threshold:
                which = ", ".join(
                    f"{name} {n}" for name, n in named.items() if n and not _is_total(name)
                )
                yield flagged(
                    key,
                    rule,
                    signal=f"pcie.aer.{counts}",
                    value=count,
                    threshold=rule.threshold,
                    message=f"{_subject(dev)} has {plural(count, f'{kind} AER error')}"
                    + (f" ({which})" if which else ""),
                )


def aer_correctable_rate(ctx: Context) -> Iterator[Finding]:
    """Correctable AER errors per hour per device over the rule's window."""
    rule = ctx.rules.aer_correctable_rate
    if not rule.enabled:
        return
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


def link_downgrade(ctx: Context) -> Iterator[Finding]:
    """A link below its max speed or width: severe on accelerators and NICs."""
    rule = ctx.rules.link_downgrade
    if not rule.enabled:
        return
    for dev in ctx.batch.pcie:
        width_down = _below(dev.current_link_width, dev.max_link_width)
        speed_down = _below(dev.current_link_speed_gts, dev.max_link_speed_gts)
        if speed_down and _is_class(dev, rule.speed_exempt_classes):
            speed_down = False
        known = None not in (dev.current_link_width, dev.max_link_width) or None not in (
            dev.current_link_speed_gts,
            dev.max_link_speed_gts,
        )
        if not (width_down or speed_down or (dev.downgraded and not known)):
            continue
        key_device = _is_class(dev, rule.key_classes)
        severity = rule.severity if key_device else rule.other_severity
        penalty = rule.penalty if key_device else rule.other_penalty
        current = _link(dev.current_link_speed_gts, dev.current_link_width)
        maximum = _link(dev.max_link_speed_gts, dev.max_link_width)
        yield finding(
            "link_downgrade",
            severity,
            penalty,
            signal="pcie.link_downgrade",
            value=current,
            threshold=maximum,
            message=f"link of {_subject(dev)} runs at {current}, below its max {maximum}",
        )


def link_retrains(ctx: Context) -> Iterator[Finding]:
    """Link state changes (downgrades and recoveries) within the rule's window."""
    rule = ctx.rules.link_retrains
    if not rule.enabled:
        return
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


RULES = (aer_uncorrectable, aer_correctable_rate, link_downgrade, link_retrains)


def _cor_key(dev: PcieDevice) -> str:
    return f"pcie.{dev.address}.aer.cor"


def _retrain_key(dev: PcieDevice) -> str:
    return f"pcie.{dev.address}.retrains"


def _is_total(name: str) -> bool:
    return name.startswith(TOTAL_PREFIX)


def _total(counts: Mapping[str, int], total: str) -> int:
    """The kernel's total, else the sum of the named counters (the larger if both)."""
    named = sum(n for name, n in counts.items() if not _is_total(name))
    return max(counts.get(total, 0), named)


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
