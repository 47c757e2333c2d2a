"""Memory (EDAC) rules: uncorrectable errors are fatal; correctable ones are judged by rate.

Counts are judged at the most specific level the driver reports: DIMMs (``dimm*/``),
else csrow channels, else csrows (legacy ``csrow*/``), else the controller; the
``*_noinfo_count`` errors, which no DIMM can be blamed for, are judged on their own.
EDAC counts are totals since boot, so a node with an old uncorrectable error stays
fatal until an operator deals with it (replaces the DIMM, reboots, clears the node).
"""

from __future__ import annotations

from collections.abc import Iterator

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
from metalguard.controller.core.scoring.config import RateRule, ThresholdRule
from metalguard.proto.telemetry import EdacController, TelemetryBatch


@reads("edac")
def counters(batch: TelemetryBatch) -> Iterator[tuple[str, int]]:
    """Correctable-error counters, one per DIMM (or the nearest level reported)."""
    for mc in batch.edac:
        if mc.dimms and all(d.ce_count is not None for d in mc.dimms):
            # the usual layout, without the subjects only findings need
            prefix = f"edac.mc{mc.mc}"
            yield from ((f"{prefix}.{d.name}.ce", d.ce_count or 0) for d in mc.dimms)
            if mc.ce_noinfo_count is not None:
                yield f"{prefix}.ce_noinfo", mc.ce_noinfo_count
            continue
        for key, _subject, count in _correctable(mc):
            yield key, count


@reads("edac")
@configured
def ecc_uncorrectable(ctx: Context, rule: ThresholdRule) -> Iterator[Finding]:
    """Any uncorrectable ECC error, at any level: fatal by default."""
    for mc in ctx.batch.edac:
        for signal, subject, count in _uncorrectable(mc):
            if count > 0 and count >= rule.threshold:
                yield flagged(
                    "ecc_uncorrectable",
                    rule,
                    signal=signal,
                    value=count,
                    threshold=rule.threshold,
                    message=f"{subject} has {plural(count, 'uncorrectable ECC error')}",
                )


@growth_only
@configured
def ecc_correctable_rate(ctx: Context, rule: RateRule) -> Iterator[Finding]:
    """Correctable ECC errors per hour per DIMM over the rule's window."""
    for mc in ctx.batch.edac:
        for key, subject, _count in _correctable(mc):
            found = rate_finding(
                "ecc_correctable_rate",
                rule,
                ctx,
                key,
                signal="edac.ce_rate",
                what="correctable ECC errors",
                subject=subject,
            )
            if found is not None:
                yield found


RULES = (ecc_uncorrectable, ecc_correctable_rate)


def _dimm(mc: int, name: str, label: str) -> str:
    return f"mc{mc} DIMM {label!r}" if label else f"mc{mc} {name}"


def _correctable(mc: EdacController) -> Iterator[tuple[str, str, int]]:
    """(history key, subject, count) of each correctable counter of ``mc``."""
    prefix = f"edac.mc{mc.mc}"
    dimms = [(d, d.ce_count) for d in mc.dimms if d.ce_count is not None]
    rows = [r for r in mc.csrows if r.ce_count is not None or r.channels]
    if dimms:
        for dimm, count in dimms:
            yield f"{prefix}.{dimm.name}.ce", _dimm(mc.mc, dimm.name, dimm.label), count
    elif rows:
        for row in rows:
            channels = [(c, c.ce_count) for c in row.channels if c.ce_count is not None]
            for ch, count in channels:
                name = f"csrow{row.csrow} channel {ch.channel}"
                yield (
                    f"{prefix}.csrow{row.csrow}.ch{ch.channel}.ce",
                    _dimm(mc.mc, name, ch.label),
                    count,
                )
            if not channels and row.ce_count is not None:
                yield f"{prefix}.csrow{row.csrow}.ce", f"mc{mc.mc} csrow{row.csrow}", row.ce_count
    elif mc.ce_count is not None:
        yield f"{prefix}.ce", f"mc{mc.mc}", mc.ce_count
    if mc.ce_noinfo_count is not None:
        yield f"{prefix}.ce_noinfo", f"mc{mc.mc} (without DIMM information)", mc.ce_noinfo_count


def _uncorrectable(mc: EdacController) -> Iterator[tuple[str, str, int]]:
    """(signal, subject, count) of each uncorrectable counter of ``mc`` worth judging."""
    parts: list[tuple[str, str, int]] = []
    for dimm in mc.dimms:
        if dimm.ue_count:
            parts.append(("edac.ue_count", _dimm(mc.mc, dimm.name, dimm.label), dimm.ue_count))
    if not parts:
        for row in mc.csrows:
            channels = [c for c in row.channels if c.ue_count]
            for ch in channels:
                name = f"csrow{row.csrow} channel {ch.channel}"
                parts.append(("edac.ue_count", _dimm(mc.mc, name, ch.label), ch.ue_count or 0))
            if not channels and row.ue_count:
                parts.append(("edac.ue_count", f"mc{mc.mc} csrow{row.csrow}", row.ue_count))
    if not parts and mc.ue_count:
        parts.append(("edac.ue_count", f"mc{mc.mc}", mc.ue_count))
    if mc.ue_noinfo_count:
        parts.append(
            ("edac.ue_noinfo_count", f"mc{mc.mc} (without DIMM information)", mc.ue_noinfo_count)
        )
    yield from parts
