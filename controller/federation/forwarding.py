"""Which region a submitted job goes to (pure; docs/federation.md).

A job stays in its home region when the home region could hold it (allowed, healthy
capacity of its GPU type and count); else it is forwarded to the region that fits best
among those it allows, that are not stale, and whose latency to the home region is
within its ``max_latency_ms``: fewest queued jobs, then the lowest latency, then the
name.  When none fits, it is queued at home with every region's reason, and never sent
to a region beyond its latency bound.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from metalguard.proto.federation import RegionSummary
from metalguard.proto.jobs import Job


@dataclass(frozen=True, slots=True)
class RegionOffer:
    """What this controller knows of one region when it places a job."""

    summary: RegionSummary
    stale: bool = False
    latency_ms: float | None = None
    """Round trip from the home region (0 for the home region; None: unknown)."""

    @property
    def region(self) -> str:
        """The region's name."""
        return self.summary.region


@dataclass(frozen=True, slots=True)
class RegionChoice:
    """Where a job goes: ``region`` (the home region when not ``forward``) and why."""

    region: str
    forward: bool
    reason: str


def healthy_fit(job: Job, summary: RegionSummary) -> bool:
    """Whether the region's healthy capacity could hold the whole gang: ``job.nodes``
    healthy nodes of the job's GPU type (any type when it names none) with at least
    ``gpus_per_node`` GPUs each (a type's GPUs per node: its GPUs over its nodes)."""
    healthy = 0
    for row in summary.capacity:
        if job.gpu_type and row.gpu_type != job.gpu_type:
            continue
        per_node = row.gpus // row.nodes if row.nodes else 0
        if per_node >= job.gpus_per_node:
            healthy += row.healthy_nodes
    return healthy >= job.nodes


def why_not(job: Job, home: str, offer: RegionOffer) -> str | None:
    """Why ``offer``'s region cannot take ``job`` (None: it can)."""
    region = offer.region
    if job.allowed_regions and region not in job.allowed_regions:
        return "not in allowed_regions"
    if offer.stale:
        return "stale (cut off)"
    if region != home and job.max_latency_ms is not None:
        if offer.latency_ms is None:
            return f"latency unknown (max_latency_ms {job.max_latency_ms:g})"
        if offer.latency_ms > job.max_latency_ms:
            return f"latency {offer.latency_ms:g} ms > max_latency_ms {job.max_latency_ms:g}"
    if not healthy_fit(job, offer.summary):
        gpus = f" with >= {job.gpus_per_node} GPUs" if job.gpus_per_node else ""
        kind = f" of type {job.gpu_type}" if job.gpu_type else ""
        return f"fewer than {job.nodes} healthy nodes{gpus}{kind}"
    return None


def choose_region(job: Job, home: str, offers: Sequence[RegionOffer]) -> RegionChoice:
    """Where ``job``, submitted in ``home``, goes among ``offers`` (home's included)."""
    reasons = {o.region: why_not(job, home, o) for o in offers}
    if home in reasons and reasons[home] is None:
        return RegionChoice(home, False, f"fits {home}")
    fitting = [o for o in offers if o.region != home and reasons[o.region] is None]
    home_why = reasons.get(home) or "unknown"
    if fitting:
        best = min(fitting, key=_preference)
        return RegionChoice(best.region, True, f"{home}: {home_why}; forwarded to {best.region}")
    told = "; ".join(f"{r}: {why}" for r, why in sorted(reasons.items()))
    return RegionChoice(home, False, f"no region fits ({told})")


def _preference(offer: RegionOffer) -> tuple[int, float, str]:
    latency = offer.latency_ms if offer.latency_ms is not None else math.inf
    return (offer.summary.queued_jobs, latency, offer.region)


def effective_latency(
    region: str, home: str, configured: Mapping[str, float], measured: Mapping[str, float]
) -> float | None:
    """The latency used for ``region``: 0 at home, else the configured value (the
    operators' declared WAN latency), else the one measured over NATS, else None."""
    if region == home:
        return 0.0
    if region in configured:
        return configured[region]
    return measured.get(region)


def median(values: Iterable[float]) -> float | None:
    """The median of ``values`` (None when empty)."""
    ordered = sorted(values)
    if not ordered:
        return None
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
