"""Which region a submitted job goes to (pure; docs/federation.md).

A job stays in its home region when the home region can hold it now (allowed, enough
*free* nodes of its GPU type and count: healthy and held by no unfinished job, within one
rack, cluster or zone when its ``max_spread`` asks for that); else it is forwarded to the
region that fits best among those it allows, that are not stale, and whose latency to
the home region is within its ``max_latency_ms``: fewest queued jobs, then the lowest
latency, then the name.  When none fits, it is queued at home with every region's
reason, and never sent to a region beyond its latency bound.

A region whose summary does not tell its free nodes (an older controller) is judged by
its healthy nodes, and without the per-level counts its ``max_spread`` is not checked.
With several GPU types fitting a job that names none, the spread check takes the type
with the fullest group (a rack holding two types is counted per type: conservative).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from metalguard.proto.federation import GpuCapacity, RegionSummary
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


def fitting_rows(job: Job, summary: RegionSummary) -> list[GpuCapacity]:
    """The capacity rows whose nodes could run a member: the job's GPU type (any when it
    names none) with at least ``gpus_per_node`` GPUs each (its GPUs over its nodes)."""
    rows = []
    for row in summary.capacity:
        if job.gpu_type and row.gpu_type != job.gpu_type:
            continue
        per_node = row.gpus // row.nodes if row.nodes else 0
        if per_node >= job.gpus_per_node:
            rows.append(row)
    return rows


def healthy_fit(job: Job, summary: RegionSummary) -> bool:
    """Whether the region's healthy capacity could hold the whole gang: ``job.nodes``
    healthy nodes of the fitting rows (:func:`fitting_rows`), busy or not."""
    return sum(row.healthy_nodes for row in fitting_rows(job, summary)) >= job.nodes


def free_nodes(row: GpuCapacity) -> int:
    """A row's free nodes; its healthy ones when the region does not tell."""
    return row.healthy_nodes if row.free_nodes is None else row.free_nodes


def why_no_room(job: Job, summary: RegionSummary) -> str | None:
    """Why the region cannot hold the gang now (None: it can): too few healthy nodes,
    too few of them free, or too few free within one ``max_spread`` group."""
    rows = fitting_rows(job, summary)
    gpus = f" with >= {job.gpus_per_node} GPUs" if job.gpus_per_node else ""
    kind = f" of type {job.gpu_type}" if job.gpu_type else ""
    healthy = sum(row.healthy_nodes for row in rows)
    if healthy < job.nodes:
        return f"fewer than {job.nodes} healthy nodes{gpus}{kind}"
    free = sum(free_nodes(row) for row in rows)
    if free < job.nodes:
        return f"{free} of {healthy} healthy nodes{gpus}{kind} free, {job.nodes} needed"
    level = job.max_spread
    if level != "region":
        told = [row.free_in.get(level) for row in rows]
        known = [n for n in told if n is not None]
        if len(known) == len(told) and max(known, default=0) < job.nodes:
            most = max(known, default=0)
            return (
                f"at most {most} free nodes{gpus}{kind} in one {level}, "
                f"{job.nodes} needed (max_spread {level})"
            )
    return None


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
    return why_no_room(job, offer.summary)


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
