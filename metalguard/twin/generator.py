"""The gang generator: large training jobs (8 to 2,048 GPUs, days to weeks, periodic
checkpoints) arriving as a Poisson process sized to an offered load of the fleet.

The defaults (:class:`GangParams`, also ``data/gangs.toml`` with their reasons) are the
model's assumptions, stated in the report (:func:`params_dict`).
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path

from metalguard.controller.jobs.scheduler import FleetNode
from metalguard.twin.errors import TwinInputError, read_toml
from metalguard.twin.model import DAY_S, JobSpec

DEFAULT_GANGS_PATH = Path(__file__).parent / "data" / "gangs.toml"
GENERATOR_ORIGIN = "gang generator"

DEFAULT_SIZES: tuple[tuple[int, float], ...] = (
    (8, 30.0),
    (16, 20.0),
    (32, 15.0),
    (64, 12.0),
    (128, 9.0),
    (256, 6.0),
    (512, 4.0),
    (1024, 2.5),
    (2048, 1.5),
)
"""(GPUs, weight): most gangs are small, most GPU-hours go to the big ones (the weights
fall by about a third per doubling, so a size's share of GPU-hours grows with it)."""


@dataclass(frozen=True, slots=True)
class GangParams:
    """What the generator draws: sizes, durations, checkpointing, priorities, load."""

    sizes: tuple[tuple[int, float], ...] = DEFAULT_SIZES
    """(GPUs, relative weight) per gang size; each a multiple of ``gpus_per_node``."""
    gpus_per_node: int = 8
    """GPUs per member: whole 8-GPU nodes."""
    duration_median_days: float = 4.0
    """Median useful work of a gang (lognormal) ..."""
    duration_sigma: float = 0.75
    """... its shape (the mean is ``median * exp(sigma**2 / 2)`` before clipping) ..."""
    duration_min_days: float = 1.0
    duration_max_days: float = 28.0
    """... clipped to [1 day, 4 weeks]."""
    checkpoint_interval_s: float = 3600.0
    """Progress between periodic checkpoints (hourly)."""
    checkpoint_cost_s: float = 120.0
    """Wall seconds one checkpoint pauses the job."""
    restart_cost_s: float = 600.0
    """From a (re)start to progress: load the checkpoint, set up NCCL, warm up."""
    high_priority_share: float = 0.2
    """Share of gangs at ``high_priority`` (never preemptible) ..."""
    high_priority: int = 1
    preemptible_share: float = 0.3
    """... and of gangs at priority 0 that may be preempted (the rest: priority 0, not
    preemptible); the two shares sum to at most 1."""
    offered_load: float = 0.8
    """GPU-hours the gangs ask (work only), as a fraction of the fleet's GPU-hours over
    the run."""


_INT_KEYS = frozenset({"gpus_per_node", "high_priority"})
_SHARE_KEYS = frozenset({"high_priority_share", "preemptible_share"})
_POSITIVE_KEYS = frozenset({"gpus_per_node", "duration_median_days"})


def check_params(params: GangParams, path: str = GENERATOR_ORIGIN) -> None:
    """Raise :class:`TwinInputError` (``path``, ``key <name>``) for a parameter out of
    range: negative numbers, shares outside [0, 1] or summing above 1, weights that are
    not positive, a size that is not a positive multiple of ``gpus_per_node``, a
    priority outside 0..7, ``duration_min_days`` above ``duration_max_days``."""
    for f in fields(GangParams):
        if f.name == "sizes":
            continue
        value = getattr(params, f.name)
        key = f"key {f.name}"
        if not math.isfinite(value) or value < 0:
            raise TwinInputError(path, key, f"{value} is negative (or not finite)")
        if f.name in _POSITIVE_KEYS and value == 0:
            raise TwinInputError(path, key, "must be above 0")
        if f.name in _SHARE_KEYS and value > 1:
            raise TwinInputError(path, key, f"{value} is above 1")
    if params.high_priority > 7:
        raise TwinInputError(path, "key high_priority", f"{params.high_priority} is above 7")
    if params.high_priority_share + params.preemptible_share > 1:
        raise TwinInputError(
            path,
            "key preemptible_share",
            f"high_priority_share + preemptible_share = "
            f"{params.high_priority_share + params.preemptible_share:g} is above 1",
        )
    if params.duration_min_days > params.duration_max_days:
        raise TwinInputError(
            path,
            "key duration_min_days",
            f"{params.duration_min_days} is above duration_max_days {params.duration_max_days}",
        )
    if not params.sizes:
        raise TwinInputError(path, "key sizes", "no gang sizes")
    for gpus, weight in params.sizes:
        key = f"key sizes.{gpus}"
        if gpus <= 0 or gpus % params.gpus_per_node:
            raise TwinInputError(
                path,
                key,
                f"{gpus} GPUs is not a positive multiple of gpus_per_node "
                f"({params.gpus_per_node}): gangs take whole nodes",
            )
        if not math.isfinite(weight) or weight <= 0:
            raise TwinInputError(path, key, f"weight {weight} is not positive")


def load_gang_params(path: str | Path) -> GangParams:
    """Parameters from a TOML file: top-level keys named as :class:`GangParams`' fields
    (missing ones keep their defaults) and a ``[sizes]`` table ``GPUs = weight`` (when
    given, it replaces the default sizes whole). Unknown keys, wrong types and values
    out of range (:func:`check_params`) raise :class:`TwinInputError` with the key."""
    name = str(path)
    data = read_toml(path)
    known = {f.name for f in fields(GangParams)}
    values: dict[str, object] = {}
    for key, value in data.items():
        if key not in known:
            raise TwinInputError(
                name, f"key {key}", f"unknown key (known: {', '.join(sorted(known))})"
            )
        if key == "sizes":
            values["sizes"] = _sizes(name, value)
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TwinInputError(name, f"key {key}", f"{value!r} is not a number")
        if key in _INT_KEYS and not isinstance(value, int):
            raise TwinInputError(name, f"key {key}", f"{value!r} is not a whole number")
        values[key] = value if key in _INT_KEYS else float(value)
    params = GangParams(**values)  # type: ignore[arg-type]
    check_params(params, name)
    return params


def _sizes(path: str, value: object) -> tuple[tuple[int, float], ...]:
    if not isinstance(value, dict):
        raise TwinInputError(path, "key sizes", "must be a table of GPUs = weight")
    sizes: list[tuple[int, float]] = []
    for key, weight in value.items():
        where = f"key sizes.{key}"
        if not key.strip().isdigit():
            raise TwinInputError(path, where, f"{key!r} is not a GPU count")
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            raise TwinInputError(path, where, f"weight {weight!r} is not a number")
        if weight <= 0:
            raise TwinInputError(path, where, f"weight {weight} is not positive")
        sizes.append((int(key), float(weight)))
    return tuple(sorted(sizes))


def default_gang_params() -> GangParams:
    """The shipped defaults (``data/gangs.toml``; equal to ``GangParams()``)."""
    return load_gang_params(DEFAULT_GANGS_PATH)


def mean_duration_s(params: GangParams) -> float:
    """Expected work of one gang: the clipped lognormal's mean (closed form)."""
    median = params.duration_median_days * DAY_S
    lo, hi = params.duration_min_days * DAY_S, params.duration_max_days * DAY_S
    s = params.duration_sigma
    if s == 0:
        return min(max(median, lo), hi)
    mu = math.log(median)

    def cdf(z: float) -> float:
        return 0.5 * (1 + math.erf(z / math.sqrt(2)))

    za = (math.log(lo) - mu) / s if lo > 0 else -math.inf
    zb = (math.log(hi) - mu) / s
    inside = math.exp(mu + s * s / 2) * (cdf(zb - s) - cdf(za - s))
    return lo * cdf(za) + hi * (1 - cdf(zb)) + inside


def gang_sizes(params: GangParams, largest_gpus: int) -> tuple[tuple[int, float], ...]:
    """The sizes (and weights) that fit ``largest_gpus`` GPUs."""
    return tuple((g, w) for g, w in params.sizes if g <= largest_gpus)


def gang_capacity_gpus(nodes: Sequence[FleetNode], gpus_per_node: int = 8) -> int:
    """GPUs a whole-node gang can use: ``gpus_per_node`` on each node with that many
    (the ``largest_gang_gpus`` of a mixed fleet such as the Alibaba node list)."""
    return gpus_per_node * sum(1 for n in nodes if n.gpus >= gpus_per_node)


def generate_gangs(
    params: GangParams,
    fleet_gpus: int,
    days: float,
    rng: random.Random,
    *,
    largest_gang_gpus: int | None = None,
) -> tuple[JobSpec, ...]:
    """Gangs arriving over ``days`` as a Poisson process whose rate makes the asked
    GPU-hours (members x GPUs x work) ``offered_load`` of ``fleet_gpus`` x the run, in
    expectation. Sizes above ``fleet_gpus`` (or ``largest_gang_gpus``) are left out and
    the others' weights renormalised. Sorted by submit time, ids ``gang-00001``...;
    the same ``rng`` state gives the same jobs."""
    check_params(params)
    largest = fleet_gpus if largest_gang_gpus is None else min(fleet_gpus, largest_gang_gpus)
    sizes = gang_sizes(params, largest)
    if not sizes:
        raise TwinInputError(
            GENERATOR_ORIGIN,
            "key sizes",
            f"no gang size fits the fleet's {largest} GPUs "
            f"(the smallest is {min(g for g, _ in params.sizes)})",
        )
    horizon = days * DAY_S
    if params.offered_load == 0 or horizon <= 0:
        return ()
    total = sum(w for _, w in sizes)
    mean_gpus = sum(g * w for g, w in sizes) / total
    rate = params.offered_load * fleet_gpus / (mean_gpus * mean_duration_s(params))
    cumulative = list(itertools.accumulate(w for _, w in sizes))
    median = params.duration_median_days * DAY_S
    lo, hi = params.duration_min_days * DAY_S, params.duration_max_days * DAY_S
    jobs: list[JobSpec] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= horizon:
            break
        gpus = sizes[min(bisect.bisect_right(cumulative, rng.random() * total), len(sizes) - 1)][0]
        drawn = median * math.exp(params.duration_sigma * rng.normalvariate(0.0, 1.0))
        work = min(max(drawn, lo), hi)
        u = rng.random()
        high = u < params.high_priority_share
        preemptible = not high and u < params.high_priority_share + params.preemptible_share
        i = len(jobs) + 1
        jobs.append(
            JobSpec(
                job_id=f"gang-{i:05d}",
                submit_s=t,
                nodes=gpus // params.gpus_per_node,
                gpus_per_node=params.gpus_per_node,
                work_s=work,
                priority=params.high_priority if high else 0,
                preemptible=preemptible,
                checkpoint_interval_s=params.checkpoint_interval_s,
                checkpoint_cost_s=params.checkpoint_cost_s,
                restart_cost_s=params.restart_cost_s,
                source="gang",
                origin=f"{GENERATOR_ORIGIN} #{i}",
            )
        )
    return tuple(jobs)


def params_dict(params: GangParams) -> dict[str, object]:
    """The parameters as plain JSON values (sizes as ``{"8": weight}``), with the mean
    gang size and work they imply, for the report."""
    out: dict[str, object] = {}
    for f in fields(GangParams):
        value = getattr(params, f.name)
        out[f.name] = {str(g): w for g, w in value} if f.name == "sizes" else value
    total = sum(w for _, w in params.sizes)
    out["mean_gpus"] = sum(g * w for g, w in params.sizes) / total if total else 0.0
    out["mean_duration_days"] = mean_duration_s(params) / DAY_S
    return out
