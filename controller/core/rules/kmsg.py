"""Kernel log rules: the kernel log monitor's findings per kind (``TelemetryBatch.kmsg``,
counts since the agent started; docs/kmsg.md), judged by their growth within a window.

The agent also sends each finding of severity warning or above as an immediate NodeEvent
(``kmsg_<kind>``; a critical one of a fatal kind isolates the node at once,
``decide.is_fatal_event``); these rules keep the grade for the window after it: a file
system remounted read-only, an NVMe controller down, a GPU off the bus or a kernel panic
(read back after the reboot) is fatal; hung tasks, lockups and RCU stalls severe; I/O,
file system, NVMe timeouts and NIC faults a warning. XIDs are graded by the gpu rules
(their class), OOM kills and segfaults are the workload's, not the node's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final

from metalguard.controller.core.rules.base import (
    Context,
    Finding,
    configured,
    flagged,
    growth_only,
    plural,
    reads,
)
from metalguard.controller.core.scoring.config import WindowThresholdRule
from metalguard.proto.telemetry import TelemetryBatch

FATAL_KINDS: Final = ("fs_readonly", "nvme_down", "gpu_fallen_off_bus", "kernel_panic")
CRITICAL_FATAL_KINDS: Final = ("gpu_sxid", "memory_uncorrected", "pcie_aer", "pcie_link_down")
"""Fatal when the agent rated them critical (a fatal SXid or AER; the shipped rules rate
every uncorrected memory error and link down so): counted in ``KmsgCounts.critical``."""
SEVERE_KINDS: Final = ("hung_task", "soft_lockup", "hard_lockup", "rcu_stall")
WARNING_KINDS: Final = ("io_error", "fs_error", "nvme_timeout", "nic_fault", "pcie_link_down")


@reads("kmsg")
def counters(batch: TelemetryBatch) -> Iterator[tuple[str, int]]:
    """The findings per kind, and the records lost."""
    counts = batch.kmsg
    if counts is None:
        return
    for kind, n in counts.findings.items():
        yield _key(kind), n
    for kind, n in counts.critical.items():
        yield _critical_key(kind), n
    yield "kmsg.lost", counts.lost


@growth_only
@configured
def kmsg_fatal(ctx: Context, rule: WindowThresholdRule) -> Iterator[Finding]:
    """A file system remounted read-only, an NVMe controller down, a GPU off the bus, a
    kernel panic; a critical fatal SXid or AER, uncorrected memory error, PCIe link down:
    fatal (for the window: the node the event isolated stays out)."""
    yield from _grown(ctx, rule, "kmsg_fatal", FATAL_KINDS)
    yield from _grown(ctx, rule, "kmsg_fatal", CRITICAL_FATAL_KINDS, critical=True)


@growth_only
@configured
def kmsg_severe(ctx: Context, rule: WindowThresholdRule) -> Iterator[Finding]:
    """Hung tasks, soft and hard lockups, RCU stalls: severe."""
    yield from _grown(ctx, rule, "kmsg_severe", SEVERE_KINDS)


@growth_only
@configured
def kmsg_warning(ctx: Context, rule: WindowThresholdRule) -> Iterator[Finding]:
    """Block I/O and file system errors, NVMe timeouts, NIC faults, a PCIe link down."""
    yield from _grown(ctx, rule, "kmsg_warning", WARNING_KINDS)


RULES = (kmsg_fatal, kmsg_severe, kmsg_warning)


def _grown(
    ctx: Context,
    rule: WindowThresholdRule,
    name: str,
    kinds: tuple[str, ...],
    *,
    critical: bool = False,
) -> Iterator[Finding]:
    counts = ctx.batch.kmsg
    if counts is None:
        return
    for kind in kinds:
        if kind not in (counts.critical if critical else counts.findings):
            continue
        key = _critical_key(kind) if critical else _key(kind)
        grown = ctx.signals.increase(key, rule.window_s, ctx.now)
        if grown > 0 and grown >= rule.threshold:
            yield flagged(
                name,
                rule,
                signal=key,
                value=grown,
                threshold=rule.threshold,
                message=f"kernel log: {plural(grown, _said(kind, critical=critical))} "
                f"in the last {rule.window_s:g} s",
            )


def _key(kind: str) -> str:
    return f"kmsg.{kind}"


def _critical_key(kind: str) -> str:
    return f"kmsg.critical.{kind}"


def _said(kind: str, *, critical: bool) -> str:
    said = kind.replace("_", " ")
    return f"critical {said}" if critical else said
