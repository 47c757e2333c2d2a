"""The fleet twin's tenants (issue 31): who shares the fleet, what each was promised and
what each asks for, day by day (docs/twin.md "Allocation: dedicated partitions vs one
pool").

A tenants file (TOML) lists ``[[tenant]]`` tables: ``name``, ``share`` (the fraction of
the fleet its contract covers), ``load`` (its mean demand, GPU-hours asked / its
contract's GPU-hours), ``burstiness`` (the fraction of the time it is idle: it submits
in active periods only, at ``load / (1 - burstiness)`` of its contract), ``cycle_days``
(the mean length of one active + idle cycle) and ``[tenant.jobs]``, its job mix; an
optional top-level ``load_scale`` multiplies every tenant's ``load`` (to ask how much
more demand an allocation carries).

- :func:`load_tenants` reads and checks a file strictly (:class:`TwinInputError` with the
  file, ``key tenant[i].<field>`` and the problem);
- :func:`partition` carves each tenant's contract out of the fleet: whole nodes, its
  share of each node size its jobs can use, in the fleet's order (contiguous racks);
- :func:`generate_tenant_jobs` draws every tenant's jobs (the same stream whatever the
  allocation): arrivals a Poisson process switched on and off by the tenant's activity.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import msgspec

from metalguard.controller.jobs.scheduler import FleetNode
from metalguard.proto.base import Token
from metalguard.twin.errors import TwinInputError, read_toml
from metalguard.twin.generator import GangParams, mean_duration_s
from metalguard.twin.model import DAY_S, JobSpec

DEFAULT_TENANTS_PATH = Path(__file__).parent / "data" / "tenants.toml"
GANG_GPUS_PER_NODE = 8
"""A job of 8 GPUs or more takes whole 8-GPU nodes (one member per node), as the gang
generator's; a smaller one is one member of that many GPUs on one node."""
SMALL_SIZES = frozenset({1, 2, 4})
SHARE_SLACK = 1e-9
"""Shares may add up to 1 within this (floating-point sums of decimal shares)."""


@dataclass(frozen=True, slots=True)
class JobMix:
    """What a tenant's jobs look like: sizes (GPUs = weight), how long they run, their
    priorities. Checkpoint and restart costs are the gang generator's defaults."""

    sizes: tuple[tuple[int, float], ...] = ((8, 3.0), (16, 3.0), (32, 2.0), (64, 1.0))
    duration_median_days: float = 2.0
    duration_sigma: float = 0.75
    duration_min_days: float = 0.25
    duration_max_days: float = 28.0
    high_priority_share: float = 0.2
    preemptible_share: float = 0.3
    elastic_share: float = 0.0
    """The fraction of its multi-node jobs that are elastic (``pooled`` runs only): from
    half their nodes (rounded up) to twice as many (:func:`elastic_range`)."""
    resize_interval_hours: float = 1.0
    """An elastic job's least time between growths (each restarts it from a checkpoint)."""

    def durations(self) -> GangParams:
        """The durations as the gang generator's parameters (for :func:`mean_duration_s`)."""
        return GangParams(
            duration_median_days=self.duration_median_days,
            duration_sigma=self.duration_sigma,
            duration_min_days=self.duration_min_days,
            duration_max_days=self.duration_max_days,
        )


@dataclass(frozen=True, slots=True)
class Tenant:
    """One tenant of the fleet (a ``[[tenant]]`` table)."""

    name: str
    share: float
    """Its contract: this fraction of each node size of the fleet (dedicated: its
    partition; pooled: its guarantee, the same GPUs)."""
    load: float
    """Mean GPU-hours asked (work only) / its contract's GPU-hours."""
    burstiness: float = 0.0
    """The fraction of the time it is idle (submits nothing); 0: steady."""
    cycle_days: float = 14.0
    """Mean length of one active period plus one idle period (exponential each)."""
    jobs: JobMix = field(default_factory=JobMix)

    @property
    def peak_load(self) -> float:
        """Its demand while active, / its contract: ``load / (1 - burstiness)``."""
        return self.load / (1.0 - self.burstiness)


@dataclass(frozen=True, slots=True)
class Tenants:
    """The tenants of a run, in the file's order, and where they came from."""

    tenants: tuple[Tenant, ...]
    source: str
    load_scale: float = 1.0
    """The file's ``load_scale`` (already applied to every tenant's ``load``)."""


TENANT_KEYS = frozenset({"name", "share", "load", "burstiness", "cycle_days", "jobs"})
MIX_KEYS = frozenset(f.name for f in fields(JobMix))
_MIX_SHARES = ("high_priority_share", "preemptible_share", "elastic_share")
ELASTIC_LOW = 0.5
ELASTIC_HIGH = 2
"""An elastic job runs on ``ceil(ELASTIC_LOW x nodes)`` to ``ELASTIC_HIGH x nodes``."""


def elastic_range(nodes: int) -> tuple[int, int]:
    """An elastic job's ``(min_nodes, max_nodes)`` for its ``nodes`` (a torchrun
    ``--nnodes=MIN:MAX``); ``(0, 0)`` for a one-node job (never elastic)."""
    if nodes < 2:
        return 0, 0
    return math.ceil(ELASTIC_LOW * nodes), ELASTIC_HIGH * nodes


# --- reading ------------------------------------------------------------------------------


def load_tenants(path: str | Path) -> Tenants:
    """The tenants of a TOML file (the module's format), checked strictly: an unknown
    key, a missing or wrong-typed value, a negative or zero share, shares adding up to
    more than 1, a burstiness outside [0, 1), a name given twice or not a token, a job
    size that is not 1, 2, 4 or a multiple of 8 raise :class:`TwinInputError`."""
    name = str(path)
    data = read_toml(path)
    unknown = sorted(k for k in data if k not in ("tenant", "load_scale"))
    if unknown:
        raise TwinInputError(name, f"key {unknown[0]}", "unknown key (known: load_scale, tenant)")
    scale = _number(name, "load_scale", data.get("load_scale", 1.0))
    tables = data.get("tenant")
    if not isinstance(tables, list) or not tables:
        raise TwinInputError(name, "key tenant", "no [[tenant]] tables")
    tenants = tuple(_tenant(name, i, t, scale) for i, t in enumerate(tables))
    seen: dict[str, int] = {}
    for i, t in enumerate(tenants):
        if t.name in seen:
            raise TwinInputError(
                name, f"key tenant[{i}].name", f"{t.name!r} is given twice (tenant[{seen[t.name]}])"
            )
        seen[t.name] = i
    total = math.fsum(t.share for t in tenants)
    if total > 1 + SHARE_SLACK:
        raise TwinInputError(
            name, "key tenant.share", f"the shares add up to {total:g}, above 1 (the fleet)"
        )
    return Tenants(tenants, name, scale)


def default_tenants() -> Tenants:
    """The shipped tenants (``data/tenants.toml``, with their reasons)."""
    return load_tenants(DEFAULT_TENANTS_PATH)


def _tenant(path: str, i: int, table: object, scale: float = 1.0) -> Tenant:
    where = f"tenant[{i}]"
    if not isinstance(table, dict):
        raise TwinInputError(path, f"key {where}", "must be a table")
    unknown = sorted(k for k in table if k not in TENANT_KEYS)
    if unknown:
        raise TwinInputError(
            path,
            f"key {where}.{unknown[0]}",
            f"unknown key (known: {', '.join(sorted(TENANT_KEYS))})",
        )
    for required in ("name", "share", "load"):
        if required not in table:
            raise TwinInputError(path, f"key {where}.{required}", "missing")
    name = table["name"]
    if not isinstance(name, str):
        raise TwinInputError(path, f"key {where}.name", f"{name!r} is not a name")
    try:
        msgspec.convert(name, Token)
    except msgspec.ValidationError:
        raise TwinInputError(
            path, f"key {where}.name", f"{name!r} is not a tenant name (no '.', '*', '>', space)"
        ) from None
    share = _number(path, f"{where}.share", table["share"])
    if share <= 0:
        raise TwinInputError(path, f"key {where}.share", f"{share:g} must be above 0")
    if share > 1:
        raise TwinInputError(path, f"key {where}.share", f"{share:g} is above 1")
    load = _number(path, f"{where}.load", table["load"])
    burst = _number(path, f"{where}.burstiness", table.get("burstiness", 0.0))
    if burst >= 1:
        raise TwinInputError(
            path, f"key {where}.burstiness", f"{burst:g} must be below 1 (the idle fraction)"
        )
    cycle = _number(path, f"{where}.cycle_days", table.get("cycle_days", 14.0))
    if cycle <= 0:
        raise TwinInputError(path, f"key {where}.cycle_days", f"{cycle:g} must be above 0")
    mix = _mix(path, f"{where}.jobs", table.get("jobs", {}))
    return Tenant(name, share, load * scale, burst, cycle, mix)


def _number(path: str, key: str, value: object) -> float:
    """A finite number >= 0."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TwinInputError(path, f"key {key}", f"{value!r} is not a number")
    if not math.isfinite(value):
        raise TwinInputError(path, f"key {key}", f"{value!r} is not finite")
    if value < 0:
        raise TwinInputError(path, f"key {key}", f"{value:g} is negative")
    return float(value)


def _mix(path: str, where: str, table: object) -> JobMix:
    if not isinstance(table, dict):
        raise TwinInputError(path, f"key {where}", "must be a table")
    unknown = sorted(k for k in table if k not in MIX_KEYS)
    if unknown:
        raise TwinInputError(
            path, f"key {where}.{unknown[0]}", f"unknown key (known: {', '.join(sorted(MIX_KEYS))})"
        )
    values: dict[str, Any] = {}
    for key, value in table.items():
        if key == "sizes":
            values[key] = _sizes(path, f"{where}.sizes", value)
        else:
            values[key] = _number(path, f"{where}.{key}", value)
    mix = JobMix(**values)
    for key in _MIX_SHARES:
        if getattr(mix, key) > 1:
            raise TwinInputError(path, f"key {where}.{key}", f"{getattr(mix, key):g} is above 1")
    if mix.high_priority_share + mix.preemptible_share > 1:
        raise TwinInputError(
            path,
            f"key {where}.preemptible_share",
            "high_priority_share + preemptible_share is above 1",
        )
    if mix.duration_median_days <= 0:
        raise TwinInputError(path, f"key {where}.duration_median_days", "must be above 0")
    if mix.duration_min_days > mix.duration_max_days:
        raise TwinInputError(path, f"key {where}.duration_min_days", "is above duration_max_days")
    return mix


def _sizes(path: str, where: str, value: object) -> tuple[tuple[int, float], ...]:
    if not isinstance(value, dict) or not value:
        raise TwinInputError(path, f"key {where}", "must be a table of GPUs = weight")
    sizes: list[tuple[int, float]] = []
    for key, weight in value.items():
        if not key.strip().isdigit():
            raise TwinInputError(path, f"key {where}.{key}", f"{key!r} is not a GPU count")
        gpus = int(key)
        if gpus not in SMALL_SIZES and (gpus <= 0 or gpus % GANG_GPUS_PER_NODE):
            raise TwinInputError(
                path,
                f"key {where}.{key}",
                f"{gpus} GPUs: a job is 1, 2 or 4 GPUs on one node, or whole 8-GPU nodes",
            )
        w = _number(path, f"{where}.{key}", weight)
        if w <= 0:
            raise TwinInputError(path, f"key {where}.{key}", f"weight {w:g} is not positive")
        sizes.append((gpus, w))
    return tuple(sorted(sizes))


# --- contracts ----------------------------------------------------------------------------


def partition(nodes: Sequence[FleetNode], tenants: Sequence[Tenant]) -> dict[str, tuple[str, ...]]:
    """Each tenant's contract as whole nodes, per node size (GPUs per node): the shares'
    sum of that size's nodes is contracted, split among the tenants whose job mix can
    use such a node (:func:`can_use`) in proportion to their shares, rounded by largest
    remainder (ties: the file's order), as contiguous runs in the fleet's order (whole
    racks where it can). On a fleet of 8-GPU nodes that is each tenant's ``share`` of
    the nodes; on a mixed one (the Alibaba node list) the 1-4 GPU nodes go to the
    tenants that run 1-4 GPU jobs, as each would have asked for the nodes it runs on.
    Nodes no share covers, or no tenant can use, stay out of every partition."""
    by_size: dict[int, list[str]] = {}
    for node in nodes:
        by_size.setdefault(node.gpus, []).append(node.handle)
    out: dict[str, list[str]] = {t.name: [] for t in tenants}
    contracted = math.fsum(t.share for t in tenants)
    for gpus in sorted(by_size):
        handles = by_size[gpus]
        users = [t for t in tenants if can_use(t.jobs, gpus)]
        among = math.fsum(t.share for t in users)
        if not users or among <= 0:
            continue
        shares = [t.share * contracted / among for t in users]
        counts = _largest_remainder(len(handles), shares)
        start = 0
        for t, n in zip(users, counts, strict=True):
            out[t.name].extend(handles[start : start + n])
            start += n
    return {name: tuple(h) for name, h in out.items()}


def can_use(mix: JobMix, node_gpus: int) -> bool:
    """Whether a job of ``mix`` can run on a node of ``node_gpus`` GPUs: a 1-4 GPU job on
    a node with as many, a gang on an 8-GPU node."""
    return any(
        g <= node_gpus if g < GANG_GPUS_PER_NODE else node_gpus >= GANG_GPUS_PER_NODE
        for g, _ in mix.sizes
    )


def _largest_remainder(total: int, shares: Sequence[float]) -> list[int]:
    """``total`` items split by ``shares`` (summing to at most 1): floors, then one more
    to the largest remainders while the shares' sum allows."""
    exact = [total * s for s in shares]
    counts = [math.floor(x + SHARE_SLACK) for x in exact]
    allowed = min(total, math.floor(total * math.fsum(shares) + SHARE_SLACK))
    order = sorted(range(len(shares)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: max(0, allowed - sum(counts))]:
        counts[i] += 1
    return counts


def fitting_sizes(mix: JobMix, part: Sequence[FleetNode]) -> tuple[tuple[int, float], ...]:
    """The sizes of ``mix`` its contract can run (a tenant signs for its largest job):
    1-4 GPUs on a node with that many, gangs on its 8-GPU nodes."""
    most = max((n.gpus for n in part), default=0)
    whole = sum(1 for n in part if n.gpus >= GANG_GPUS_PER_NODE)
    return tuple(
        (g, w)
        for g, w in mix.sizes
        if (g < GANG_GPUS_PER_NODE and g <= most) or g <= whole * GANG_GPUS_PER_NODE
    )


# --- demand -------------------------------------------------------------------------------


def active_periods(
    tenant: Tenant, horizon_s: float, rng: random.Random
) -> tuple[tuple[float, float], ...]:
    """When the tenant submits: alternating active and idle periods, exponential with
    means ``cycle_days x (1 - burstiness)`` and ``cycle_days x burstiness``, the first
    state drawn with those odds; the whole horizon when it is steady."""
    if tenant.burstiness == 0:
        return ((0.0, horizon_s),)
    cycle = tenant.cycle_days * DAY_S
    on_mean, off_mean = cycle * (1 - tenant.burstiness), cycle * tenant.burstiness
    active = rng.random() >= tenant.burstiness
    t = 0.0
    out: list[tuple[float, float]] = []
    while t < horizon_s:
        length = rng.expovariate(1 / (on_mean if active else off_mean))
        if active:
            out.append((t, min(t + length, horizon_s)))
        t += length
        active = not active
    return tuple(out)


def generate_tenant_jobs(
    tenant: Tenant,
    part: Sequence[FleetNode],
    days: float,
    rng: random.Random,
    elastic_rng: random.Random | None = None,
) -> tuple[JobSpec, ...]:
    """One tenant's jobs over ``days``: in its active periods a Poisson process whose
    rate makes the GPU-hours asked ``load`` of its contract's (``part``) in expectation,
    sizes from its mix (those its contract can run), lognormal work; ``elastic_share``
    of its multi-node jobs elastic, drawn from ``elastic_rng`` (its own stream: the
    other draws are the same whatever the share). Ids ``<tenant>-00001``...; the same
    ``rng`` state gives the same jobs (none when no size fits: :func:`all_tenant_jobs`
    refuses that)."""
    horizon = days * DAY_S
    contract = sum(n.gpus for n in part)
    sizes = fitting_sizes(tenant.jobs, part)
    periods = active_periods(tenant, horizon, rng)
    if tenant.load == 0 or not sizes:
        return ()
    mix = tenant.jobs
    total = sum(w for _, w in sizes)
    mean_gpus = sum(g * w for g, w in sizes) / total
    rate = tenant.peak_load * contract / (mean_gpus * mean_duration_s(mix.durations()))
    cumulative = list(itertools.accumulate(w for _, w in sizes))
    median = mix.duration_median_days * DAY_S
    lo, hi = mix.duration_min_days * DAY_S, mix.duration_max_days * DAY_S
    costs = GangParams()
    picks = elastic_rng or random.Random(f"{tenant.name}:elastic")
    jobs: list[JobSpec] = []
    for start, end in periods:
        t = start
        while True:
            t += rng.expovariate(rate)
            if t >= end:
                break
            gpus = sizes[
                min(bisect.bisect_right(cumulative, rng.random() * total), len(sizes) - 1)
            ][0]
            drawn = median * math.exp(mix.duration_sigma * rng.normalvariate(0.0, 1.0))
            u = rng.random()
            high = u < mix.high_priority_share
            i = len(jobs) + 1
            per_node = min(gpus, GANG_GPUS_PER_NODE)
            nodes = gpus // per_node
            fewest, most = elastic_range(nodes)
            if not (most and mix.elastic_share > 0 and picks.random() < mix.elastic_share):
                fewest, most = 0, 0
            jobs.append(
                JobSpec(
                    job_id=f"{tenant.name}-{i:05d}",
                    submit_s=t,
                    nodes=nodes,
                    gpus_per_node=per_node,
                    work_s=min(max(drawn, lo), hi),
                    priority=costs.high_priority if high else 0,
                    preemptible=not high and u < mix.high_priority_share + mix.preemptible_share,
                    checkpoint_interval_s=costs.checkpoint_interval_s,
                    checkpoint_cost_s=costs.checkpoint_cost_s,
                    restart_cost_s=costs.restart_cost_s,
                    source="gang",
                    origin=f"tenant {tenant.name} #{i}",
                    tenant=tenant.name,
                    min_nodes=fewest,
                    max_nodes=most,
                    resize_interval_s=mix.resize_interval_hours * 3600.0 if most else 0.0,
                )
            )
    return tuple(jobs)


def all_tenant_jobs(
    spec: Tenants,
    nodes: Sequence[FleetNode],
    parts: Mapping[str, Sequence[str]],
    days: float,
    seed: int,
) -> tuple[JobSpec, ...]:
    """Every tenant's jobs, each tenant drawing from ``Random("<seed>:tenants:<name>")``
    (adding a tenant changes no other's stream), sorted by submit time. A tenant whose
    contract runs none of its job sizes is a :class:`TwinInputError`."""
    by_handle = {n.handle: n for n in nodes}
    jobs: list[JobSpec] = []
    for i, t in enumerate(spec.tenants):
        part = [by_handle[h] for h in parts[t.name]]
        if not fitting_sizes(t.jobs, part):
            gpus = sum(n.gpus for n in part)
            raise TwinInputError(
                spec.source,
                f"key tenant[{i}].jobs.sizes",
                f"no job size fits its contract on this fleet ({len(part)} nodes, {gpus} GPUs)",
            )
        rng = random.Random(f"{seed}:tenants:{t.name}")
        elastic_rng = random.Random(f"{seed}:tenants:{t.name}:elastic")
        jobs.extend(generate_tenant_jobs(t, part, days, rng, elastic_rng))
    return tuple(sorted(jobs, key=lambda j: (j.submit_s, j.job_id)))


def tenants_dict(spec: Tenants) -> dict[str, object]:
    """The tenants as plain JSON values, for the report's ``workload``."""
    out: dict[str, object] = {"source": spec.source, "load_scale": spec.load_scale}
    for t in spec.tenants:
        mix = {f.name: getattr(t.jobs, f.name) for f in fields(JobMix)}
        mix["sizes"] = {str(g): w for g, w in t.jobs.sizes}
        mix["mean_duration_days"] = mean_duration_s(t.jobs.durations()) / DAY_S
        out[t.name] = {
            "share": t.share,
            "load": t.load,
            "burstiness": t.burstiness,
            "cycle_days": t.cycle_days,
            "peak_load": t.peak_load,
            "jobs": mix,
        }
    return out
