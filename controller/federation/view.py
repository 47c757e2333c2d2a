"""The fleet view of federation (pure; docs/federation.md): what a region tells the others
and what a controller keeps of what it heard.

:func:`summarize` makes this region's :class:`RegionSummary` (nodes per grade, GPU
capacity per type, jobs); :class:`FleetView` keeps the newest summary of every region
heard, each *stale* once older than ``STALE_INTERVALS`` of its interval; :func:`find_uuid`
answers a node lookup from this region's records.  Time is always an argument; the NATS
side is controller/federation/service.py.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from metalguard.controller.jobs.scheduler import FleetNode, Level
from metalguard.proto.federation import GpuCapacity, NodeLookupReply, RegionSummary
from metalguard.proto.jobs import TERMINAL_JOB_STATES, JobStatus
from metalguard.proto.nodes import GRADES, NodeRecord

STALE_INTERVALS = 3.0
"""A summary older than this many of its region's intervals is stale."""
SPREAD_LEVELS: tuple[Level, ...] = ("rack", "cluster", "zone")
"""The ``max_spread`` levels narrower than a region (``GpuCapacity.free_in``'s keys)."""


def summarize(
    region: str,
    records: Mapping[str, NodeRecord],
    fleet: Iterable[FleetNode],
    now: float,
    interval_s: float,
    *,
    controller: str = "",
    queued_jobs: int = 0,
    running_jobs: int = 0,
    busy: Collection[str] = frozenset(),
) -> RegionSummary:
    """The region's summary: nodes per grade and GPU capacity per type, with the free
    nodes (healthy, not in ``busy``: the nodes unfinished jobs hold) in all and in the
    fullest rack, cluster and zone (pure)."""
    grades = Counter(r.grade for r in records.values())
    by_type: dict[str, list[int]] = {}
    groups: dict[str, list[Counter[tuple[str, ...]]]] = defaultdict(
        lambda: [Counter() for _ in SPREAD_LEVELS]
    )
    for node in fleet:
        healthy = node.schedulable  # takes new work: not cordoned, held or rail-flagged
        free = healthy and node.handle not in busy
        row = by_type.setdefault(node.gpu_type, [0, 0, 0, 0, 0])
        row[0] += 1
        row[1] += healthy
        row[2] += node.gpus
        row[3] += node.gpus if healthy else 0
        row[4] += free
        if free:
            for counter, level in zip(groups[node.gpu_type], SPREAD_LEVELS, strict=True):
                counter[node.group_key(level)] += 1
    capacity = tuple(
        GpuCapacity(
            gpu_type=t,
            nodes=n,
            healthy_nodes=h,
            gpus=g,
            healthy_gpus=hg,
            free_nodes=f,
            free_in={
                level: max(counter.values(), default=0)
                for level, counter in zip(SPREAD_LEVELS, groups[t], strict=True)
            },
        )
        for t, (n, h, g, hg, f) in sorted(by_type.items())
    )
    return RegionSummary(
        region=region,
        ts=now,
        interval_s=interval_s,
        controller=controller,
        nodes=len(records),
        grades={g: grades.get(g, 0) for g in GRADES},
        capacity=capacity,
        queued_jobs=queued_jobs,
        running_jobs=running_jobs,
    )


@dataclass(frozen=True, slots=True)
class Heard:
    """A region's newest summary and when this controller received it."""

    summary: RegionSummary
    received_ts: float


@dataclass(frozen=True, slots=True)
class HeardNow:
    """A region's newest summary, its age and staleness at some moment."""

    summary: RegionSummary
    age_s: float
    stale: bool


class FleetView:
    """The newest summary of every region heard, by region (pure; time as arguments)."""

    def __init__(self) -> None:
        self._heard: dict[str, Heard] = {}

    def take(self, summary: RegionSummary, received_ts: float) -> bool:
        """Keep ``summary`` unless an as-new one of its region is kept; whether kept."""
        held = self._heard.get(summary.region)
        if held is not None and held.summary.ts > summary.ts:
            return False
        self._heard[summary.region] = Heard(summary, received_ts)
        return True

    @property
    def regions(self) -> list[str]:
        """The regions heard from, sorted."""
        return sorted(self._heard)

    def heard(self, now: float) -> list[HeardNow]:
        """Every region's newest summary with whether it is stale at ``now``, sorted."""
        out = []
        for region in self.regions:
            heard = self._heard[region]
            age = max(0.0, now - heard.received_ts)
            stale = age > STALE_INTERVALS * max(heard.summary.interval_s, 0.001)
            out.append(HeardNow(heard.summary, age, stale))
        return out

    def snapshot(self, now: float) -> list[dict[str, Any]]:
        """Every region's summary with ``age_s`` and ``stale``, sorted by region."""
        return [
            msgspec.to_builtins(h.summary) | {"age_s": h.age_s, "stale": h.stale}
            for h in self.heard(now)
        ]


def busy_nodes(jobs: Mapping[str, JobStatus]) -> frozenset[str]:
    """The nodes unfinished jobs hold (their placements; pure)."""
    return frozenset(
        node for s in jobs.values() if s.state not in TERMINAL_JOB_STATES for node in s.placement
    )


def job_counts(jobs: Mapping[str, JobStatus]) -> tuple[int, int]:
    """(queued, running) among ``jobs`` (the job manager's statuses; pure)."""
    states = Counter(s.state for s in jobs.values())
    return states.get("queued", 0), states.get("running", 0)


def find_uuid(region: str, records: Mapping[str, NodeRecord], uuid: str) -> NodeLookupReply:
    """The reply for ``uuid`` from this region's records (pure)."""
    if uuid:
        for handle, record in records.items():
            if record.node.uuid == uuid:
                return NodeLookupReply(
                    uuid=uuid, found=True, region=region, handle=handle, record=record
                )
    return NodeLookupReply(uuid=uuid, found=False)
