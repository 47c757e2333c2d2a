"""GPU rules: the NVML readings of the agent's ``gpu`` collector (docs/collectors-udev-gpu.md).

Double-bit ECC errors and a failed row remap are fatal (the GPU needs service; NVIDIA's
guidance is to drain it); a pending remap or retired page, and an XID of NVIDIA's
``reset_gpu`` or ``decode`` class, ask for a GPU reset once the node is drained (severe:
SUB_HEALTHY, signal ``gpu.reset_required``, docs/decisions.md); an XID of the ``reboot``
class (79: fallen off the bus) is fatal; an XID NVIDIA says to investigate (92, unlisted
ones) is a warning; the application's XIDs (13, 31, ...) and 63 cost nothing. A PCIe
link below its maximum is severe; hardware thermal slowdown is a warning. Corrected ECC
errors, PCIe replays and NVLink errors are judged by their rate over a window.
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
from metalguard.controller.core.scoring.config import FlagRule, RateRule, ThresholdRule
from metalguard.proto.telemetry import GpuDevice, TelemetryBatch
from metalguard.proto.xid import XidClass, XidEntry, classify

THERMAL_REASONS = frozenset(
    {"hw_slowdown", "hw_thermal_slowdown", "sw_thermal_slowdown", "hw_power_brake_slowdown"}
)
"""Throttle reasons that mean the hardware holds the GPU's clocks down: heat, or the
board's slowdown or power brake signal (not a power cap, not idle). The names are the
collector's (agent/collectors/gpu_parse.py ``THROTTLE_REASONS``: NVML's clock-event bits);
the power brake was listed as ``hw_power_brake`` before, a name the collector never
gives, so it was never flagged."""
RESET_SIGNAL = "gpu.reset_required"
"""The signal of every finding that a GPU reset clears; its value is the GPU's index
(the controller's remediation resets those GPUs once the node is drained)."""
RESET_ACTION = "GPU reset when drained"
RESET_CLASSES: frozenset[XidClass] = frozenset({"reset_gpu", "decode"})
"""XID classes a GPU reset clears (``decode``: an NVLink XID whose data NVML does not
give, taken at its worst recoverable action, a reset)."""
ATTENTION_CLASSES: frozenset[XidClass] = frozenset({"contact_support", "other"})
"""XID classes that cost a warning: NVIDIA says to investigate (92, unlisted XIDs)."""


@reads("gpu")
def counters(batch: TelemetryBatch) -> Iterator[tuple[str, int]]:
    """Per GPU: corrected ECC errors, PCIe replays, NVLink errors (all links summed)."""
    for gpu in batch.gpu:
        if gpu.ecc_sbe_volatile is not None:
            yield _key(gpu, "ecc_sbe"), gpu.ecc_sbe_volatile
        if gpu.pcie_replay_count is not None:
            yield _key(gpu, "pcie_replay"), gpu.pcie_replay_count
        nvlink = _nvlink_errors(gpu)
        if nvlink is not None:
            yield _key(gpu, "nvlink_errors"), nvlink


@reads("gpu")
@configured
def gpu_ecc_uncorrectable(ctx: Context, rule: ThresholdRule) -> Iterator[Finding]:
    """Double-bit (uncorrectable) ECC errors since the driver loaded: fatal by default."""
    for gpu in ctx.batch.gpu:
        count = gpu.ecc_dbe_volatile
        if count is None:
            count = gpu.ecc_uncorrected
        if count and count >= rule.threshold:
            yield flagged(
                "gpu_ecc_uncorrectable",
                rule,
                signal="gpu.ecc_dbe",
                value=count,
                threshold=rule.threshold,
                message=f"{_subject(gpu)} has {plural(count, 'uncorrectable ECC error')}",
            )


@reads("gpu")
@configured
def gpu_row_remap_failure(ctx: Context, rule: FlagRule) -> Iterator[Finding]:
    """A memory row that could not be remapped: the GPU needs service."""
    for gpu in ctx.batch.gpu:
        if gpu.row_remap_failure:
            yield flagged(
                "gpu_row_remap_failure",
                rule,
                signal="gpu.row_remap_failure",
                value=True,
                message=f"{_subject(gpu)}: a row remap failed (the GPU needs service)",
            )


@reads("gpu")
@configured
def gpu_reset_pending(ctx: Context, rule: FlagRule) -> Iterator[Finding]:
    """A GPU that waits for a reset: a row remap or page retirement that takes effect at
    the next reset, or an XID of NVIDIA's ``reset_gpu`` or ``decode`` class since its last
    reset. One finding per GPU; the rule's ``max_penalty`` (30) keeps a node with several
    such GPUs SUB_HEALTHY: they are reset together once it is drained."""
    for gpu in ctx.batch.gpu:
        what = [
            name
            for name, pending in (
                ("row remap", gpu.row_remap_pending),
                ("page retirement", gpu.retired_pages_pending),
            )
            if pending
        ]
        said = [f"{' and '.join(what)} pending until a GPU reset"] if what else []
        xids = _xids(gpu, RESET_CLASSES)
        if xids:
            said.append(_named(xids))
        if said:
            yield flagged(
                "gpu_reset_pending",
                rule,
                signal=RESET_SIGNAL,
                value=gpu.index,
                message=f"{_subject(gpu)}: {'; '.join(said)}: {RESET_ACTION}",
            )


@reads("gpu")
@configured
def gpu_xid_reboot(ctx: Context, rule: FlagRule) -> Iterator[Finding]:
    """An XID of the ``reboot`` class (79: the GPU fell off the bus): fatal by default."""
    for gpu in ctx.batch.gpu:
        found = _xids(gpu, frozenset({"reboot"}))
        if found:
            yield flagged(
                "gpu_xid_reboot",
                rule,
                signal="gpu.lost",
                value=gpu.index,
                message=f"{_subject(gpu)}: {_named(found)}: reboot the node",
            )


@reads("gpu")
@configured
def gpu_xid_attention(ctx: Context, rule: FlagRule) -> Iterator[Finding]:
    """XIDs NVIDIA says to investigate (92: excessive single-bit ECC interrupts, unlisted
    XIDs); the value counts every report of them within the agent's XID window."""
    for gpu in ctx.batch.gpu:
        found = _xids(gpu, ATTENTION_CLASSES)
        if found:
            count = sum(1 for x in gpu.xid_errors if classify(x).xid_class in ATTENTION_CLASSES)
            yield flagged(
                "gpu_xid_attention",
                rule,
                signal="gpu.xid_attention",
                value=count,
                message=f"{_subject(gpu)}: {_named(found)}, {plural(count, 'report')}: "
                f"{found[0].action}",
            )


@reads("gpu")
@configured
def gpu_pcie_downgrade(ctx: Context, rule: FlagRule) -> Iterator[Finding]:
    """A GPU's PCIe link narrower than its maximum, or slower while busy."""
    for gpu in ctx.batch.gpu:
        if gpu.pcie_downgraded:
            now = f"gen{gpu.pcie_link_gen} x{gpu.pcie_link_width}"
            top = f"gen{gpu.pcie_link_gen_max} x{gpu.pcie_link_width_max}"
            yield flagged(
                "gpu_pcie_downgrade",
                rule,
                signal="gpu.pcie_link",
                value=now,
                threshold=top,
                message=f"{_subject(gpu)}: PCIe link at {now}, its maximum is {top}",
            )


@reads("gpu")
@configured
def gpu_thermal_slowdown(ctx: Context, rule: FlagRule) -> Iterator[Finding]:
    """Clocks held down because the GPU is too hot."""
    for gpu in ctx.batch.gpu:
        hot = sorted(THERMAL_REASONS.intersection(gpu.throttle_reasons))
        if hot:
            shown = ", ".join(hot)
            temp = f" at {gpu.temperature_c:g} °C" if gpu.temperature_c is not None else ""
            yield flagged(
                "gpu_thermal_slowdown",
                rule,
                signal="gpu.throttle",
                value=shown,
                message=f"{_subject(gpu)} throttled{temp}: {shown}",
            )


@growth_only
@configured
def gpu_ecc_correctable_rate(ctx: Context, rule: RateRule) -> Iterator[Finding]:
    """Corrected (single-bit) ECC errors per hour per GPU."""
    yield from _rates(ctx, "gpu_ecc_correctable_rate", rule, "ecc_sbe", "corrected ECC errors")


@growth_only
@configured
def gpu_pcie_replay_rate(ctx: Context, rule: RateRule) -> Iterator[Finding]:
    """PCIe replays (link-level retransmissions) per hour per GPU."""
    yield from _rates(ctx, "gpu_pcie_replay_rate", rule, "pcie_replay", "PCIe replays")


@growth_only
@configured
def gpu_nvlink_error_rate(ctx: Context, rule: RateRule) -> Iterator[Finding]:
    """NVLink CRC, replay and recovery errors per hour per GPU (all its links)."""
    yield from _rates(ctx, "gpu_nvlink_error_rate", rule, "nvlink_errors", "NVLink errors")


RULES = (
    gpu_ecc_uncorrectable,
    gpu_row_remap_failure,
    gpu_reset_pending,
    gpu_xid_reboot,
    gpu_xid_attention,
    gpu_pcie_downgrade,
    gpu_thermal_slowdown,
    gpu_ecc_correctable_rate,
    gpu_pcie_replay_rate,
    gpu_nvlink_error_rate,
)


def _rates(ctx: Context, key: str, rule: RateRule, counter: str, what: str) -> Iterator[Finding]:
    """The rate rule ``key`` over each GPU's ``counter`` (signal ``gpu.<counter>_rate``)."""
    signal = f"gpu.{counter}_rate"
    for gpu in ctx.batch.gpu:
        found = rate_finding(
            key, rule, ctx, _key(gpu, counter), signal=signal, what=what, subject=_subject(gpu)
        )
        if found is not None:
            yield found


def _xids(gpu: GpuDevice, classes: frozenset[XidClass]) -> list[XidEntry]:
    """The distinct XIDs of ``gpu.xid_errors`` in ``classes``, in order of first report."""
    entries = (classify(x) for x in dict.fromkeys(gpu.xid_errors))
    return [e for e in entries if e.xid_class in classes]


def _named(entries: list[XidEntry]) -> str:
    """``XID 48 (double-bit ECC error), XID 74 (NVLink error)``."""
    return ", ".join(
        e.name if e.name.startswith("XID ") else f"XID {e.xid} ({e.name})" for e in entries
    )


def _nvlink_errors(gpu: GpuDevice) -> int | None:
    counts = [
        n
        for link in gpu.nvlinks
        for n in (link.crc_flit, link.crc_data, link.replay, link.recovery)
        if n is not None
    ]
    return sum(counts) if counts else None


def _key(gpu: GpuDevice, counter: str) -> str:
    return f"gpu.{gpu.uuid or gpu.pci_address or gpu.index}.{counter}"


def _subject(gpu: GpuDevice) -> str:
    where = gpu.pci_address or gpu.uuid
    return f"GPU {gpu.index}" + (f" ({where})" if where else "")
