"""The fleet twin's report: one run's :class:`~metalguard.twin.model.TwinResult` as a JSON
document with fixed keys (docs/twin.md "The report"), and the text table that compares
several runs.

Pure: the same result gives the same document, byte for byte once dumped (floats are
rounded to :data:`DECIMALS` places, keys sorted).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from metalguard.controller.cli.console import table
from metalguard.twin import sync as syncmodel
from metalguard.twin.allocation import contracts
from metalguard.twin.failures import model_dict
from metalguard.twin.model import DAY_S, JobOutcomeRecord, TwinResult

DECIMALS = 6
"""Every float in the report is rounded to this many decimal places."""

BIG_JOB_GPUS = 1000
"""``interruptions_per_job_month`` counts the jobs with more GPUs than this."""

MONTH_S = 30 * DAY_S

ETTR_DEFINITION = (
    "effective training time ratio. Per job that started: useful progress kept (done_s, "
    "seconds of work not redone) / wall seconds from its first start to its end (or to the "
    "end of the run while it still runs or waits again); the wall includes restarts, "
    "checkpoints, repairs and waits in the queue after an interruption, not the first wait. "
    "Fleet: the GPU-weighted ratio, sum(done_s x gpus) / sum(wall_s x gpus) over those jobs. "
    "An elastic job (pooled runs) counts in GPU-seconds: done_s x gpus (its work is at its "
    "nominal size) / (the GPU-seconds it held + the wall it held nothing x gpus), the same "
    "ratio for a job of one size. "
    "jobs_p10/p50/p90: percentiles of the per-job ratio over every started job; "
    "gang_jobs_p50: the median over the gang generator's jobs (null: none started)."
)

INTERRUPTION_PREFIX = "interruption:"
"""The engine's decision counters ``interruption:<unplanned|planned>:<cause>``: job
interruptions by a fault of that cause (unplanned), or by a move with notice (planned:
``precursor``, ``planned maintenance``, ``preempted``, ...)."""


def build_report(
    result: TwinResult,
    *,
    fabric: syncmodel.Fabric = syncmodel.FABRIC,
    step: syncmodel.StepModel = syncmodel.STEP,
) -> dict[str, Any]:
    """The report of one run (every key always present; null where nothing to measure);
    ``fabric`` and ``step``: the sync model's (:mod:`metalguard.twin.sync`)."""
    inputs = result.inputs
    run_end_s = inputs.days * DAY_S
    node_days = len(inputs.nodes) * inputs.days
    jobs = result.jobs
    unplanned = sum(j.unplanned for j in jobs)
    planned = sum(j.planned for j in jobs)
    redone_gpu_s = sum(j.redone_s * j.gpus for j in jobs)
    report: dict[str, Any] = {
        "policy": result.policy.name,
        "seed": inputs.seed,
        "days": inputs.days,
        "nodes": len(inputs.nodes),
        "gpus": sum(n.gpus for n in inputs.nodes),
        "gpu_hours_available": result.gpu_seconds_available / 3600,
        "gpu_hours_busy": result.gpu_seconds_busy / 3600,
        "gpu_hours_down": result.gpu_seconds_down / 3600,
        "utilisation": _ratio(result.gpu_seconds_busy, result.gpu_seconds_available),
        "goodput_gpu_hours": (result.gpu_seconds_busy - redone_gpu_s) / 3600,
        "ettr": ettr(jobs, run_end_s),
        "interruptions": {
            "unplanned": unplanned,
            "planned": planned,
            "unplanned_per_1000_node_days": _ratio(1000 * unplanned, node_days),
            "planned_per_1000_node_days": _ratio(1000 * planned, node_days),
            "by_cause": interruptions_by_cause(result),
        },
        "interruptions_per_job_month": interruptions_per_job_month(jobs),
        "stragglers": stragglers(result),
        "placement": inputs.placement,
        "sync": sync(result, fabric, step),
        "allocation": inputs.allocation,
        "tenants": tenants(result),
        "elastic": elastic(result),
        "queue_wait_s": queue_wait(jobs),
        "jobs": job_counts(jobs),
        "failure_model": model_dict(inputs.failures),
        "policy_parameters": dataclasses.asdict(result.policy),
        "workload": dict(inputs.workload),
        "decisions": dict(result.decisions),
        "events": result.events,
    }
    cleaned: dict[str, Any] = _clean(report)
    return cleaned


def ettr(jobs: Iterable[JobOutcomeRecord], run_end_s: float) -> dict[str, Any]:
    """The ``ettr`` section (see :data:`ETTR_DEFINITION`)."""
    per_job: list[float] = []
    gang: list[float] = []
    done_gpu_s = 0.0
    wall_gpu_s = 0.0
    for job in jobs:
        if job.first_start_s is None:
            continue
        end_s = job.end_s if job.end_s is not None else run_end_s
        wall_s = end_s - job.first_start_s
        if wall_s <= 0:
            continue
        job_wall_gpu_s = wall_s * job.gpus
        ratio = job.done_s / wall_s
        if job.held_gpu_s is not None:  # elastic: what it held at each size
            job_wall_gpu_s = job.held_gpu_s + max(0.0, wall_s - job.held_s) * job.gpus
            ratio = job.done_s * job.gpus / job_wall_gpu_s if job_wall_gpu_s > 0 else 0.0
        per_job.append(ratio)
        if job.source == "gang":
            gang.append(ratio)
        done_gpu_s += job.done_s * job.gpus
        wall_gpu_s += job_wall_gpu_s
    per_job.sort()
    gang.sort()
    return {
        "fleet": _ratio(done_gpu_s, wall_gpu_s),
        "jobs_p10": percentile(per_job, 10),
        "jobs_p50": percentile(per_job, 50),
        "jobs_p90": percentile(per_job, 90),
        "gang_jobs_p50": percentile(gang, 50),
        "definition": ETTR_DEFINITION,
    }


STRAGGLER_PREFIX = "straggler:"


def stragglers(result: TwinResult) -> dict[str, Any]:
    """The ``stragglers`` section: what fail-slow nodes cost the jobs, with or without the
    detector (``detection``): ``gpu_hours_slowed``, GPU-hours of slowed progress (each
    job's wall seconds lost to a slower pace x its GPUs); ``moves`` off a straggler and
    ``gpu_hours_moves``, what they cost by the jobs' own costs (a fresh checkpoint and a
    restart each, x GPUs; the wait in the queue not counted); ``episodes`` drawn and
    the engine's ``straggler:*`` counters (``decisions``)."""
    policy = result.policy
    detection = policy.straggler_detection and policy.auto_isolation
    counters = {
        key.removeprefix(STRAGGLER_PREFIX): value
        for key, value in result.decisions.items()
        if key.startswith(STRAGGLER_PREFIX)
    }
    return {
        "detection": detection,
        "detection_delay_s": policy.straggler_delay_s if detection else None,
        "episodes": len(result.stragglers),
        "gpu_hours_slowed": sum(j.slowed_s * j.gpus for j in result.jobs) / 3600,
        "moves": sum(j.straggler_moves for j in result.jobs),
        "gpu_hours_moves": sum(j.straggler_move_s * j.gpus for j in result.jobs) / 3600,
        "decisions": dict(sorted(counters.items())),
    }


SYNC_DEFINITION = (
    "multi-node gangs only (one node reduces over NVLink, off the fabric). Per gang and "
    "placement: step = compute_s + the all-reduce (alpha-beta: latency steps + 2(n-1)/n x "
    "message_bytes over each GPU's bottleneck share: on one leaf its NIC; across leaves or "
    "clusters its slowest node's share of the uplinks it crosses, shared with every gang "
    "crossing them), recomputed whenever those loads change, judged on the real topology "
    "whatever the scheduler saw. sync_time_share: all-reduce seconds / step seconds, "
    "GPU-time weighted. scaling_efficiency: steps per GPU done / the steps the same gangs "
    "would have done on one uncongested leaf. step_time_s, sync_time_s p50/p90: over gangs "
    "of their time-weighted means; sync_time_s.mean GPU-time weighted, one_leaf_mean the "
    "same gangs on one leaf. bound_by, spread: shares of the gangs' GPU-time."
)


def sync(
    result: TwinResult,
    fabric: syncmodel.Fabric = syncmodel.FABRIC,
    step: syncmodel.StepModel = syncmodel.STEP,
) -> dict[str, Any]:
    """The ``sync`` section: the multi-node gangs' step time, the share spent in the
    all-reduce and the scaling efficiency against one leaf, fleet-wide, per priority
    class and per gang size (:func:`metalguard.twin.sync.summarise`)."""
    gangs = syncmodel.summarise(result.segments, result.inputs.nodes, fabric, step)
    steps = sorted(g.mean_step_s for g in gangs)
    syncs = sorted(g.mean_sync_s for g in gangs)
    gpu_s = sum(g.gpus * g.wall_s for g in gangs)
    sizes: dict[int, list[syncmodel.GangSync]] = {}
    for g in gangs:
        sizes.setdefault(g.gpus, []).append(g)
    return {
        **_sync_totals(gangs),
        "step_time_s": {"p50": percentile(steps, 50), "p90": percentile(steps, 90)},
        "sync_time_s": {
            "mean": _ratio(sum(g.gpus * g.sync_s for g in gangs), gpu_s),
            "one_leaf_mean": _ratio(sum(g.gpus * g.one_leaf_sync_s for g in gangs), gpu_s),
            "p50": percentile(syncs, 50),
            "p90": percentile(syncs, 90),
        },
        "bound_by": _gpu_time_shares(gangs, "bound_s", syncmodel.BOUNDS),
        "spread": _gpu_time_shares(gangs, "spread_s", ("one_leaf", "leaves", "clusters")),
        "by_class": {
            "priority": _sync_totals([g for g in gangs if g.priority]),
            "other": _sync_totals([g for g in gangs if not g.priority]),
        },
        "by_gang_gpus": {str(n): _sync_totals(sizes[n]) for n in sorted(sizes)},
        "model": {"fabric": dataclasses.asdict(fabric), "step": dataclasses.asdict(step)},
        "definition": SYNC_DEFINITION,
    }


def _sync_totals(gangs: Sequence[syncmodel.GangSync]) -> dict[str, Any]:
    """Gangs, GPU-hours, GPU-time weighted ``sync_time_share`` and ``scaling_efficiency``."""
    return {
        "gangs": len(gangs),
        "gpu_hours": sum(g.gpus * g.wall_s for g in gangs) / 3600,
        "sync_time_share": _ratio(
            sum(g.gpus * g.sync_s for g in gangs), sum(g.gpus * g.step_s for g in gangs)
        ),
        "scaling_efficiency": _ratio(
            sum(g.gpus * g.steps for g in gangs), sum(g.gpus * g.one_leaf_steps for g in gangs)
        ),
    }


def _gpu_time_shares(
    gangs: Sequence[syncmodel.GangSync], attr: str, keys: Sequence[str]
) -> dict[str, float | None]:
    """Each key's share of the gangs' GPU-time, from a per-gang seconds table."""
    total = sum(g.gpus * g.wall_s for g in gangs)
    return {k: _ratio(sum(g.gpus * getattr(g, attr)[k] for g in gangs), total) for k in keys}


def interruptions_by_cause(result: TwinResult) -> dict[str, dict[str, int]]:
    """``{"unplanned": {cause: n}, "planned": {reason: n}}`` from the engine's
    ``interruption:<kind>:<cause>`` decision counters (sorted by name)."""
    counts: dict[str, Counter[str]] = {"unplanned": Counter(), "planned": Counter()}
    for key, value in result.decisions.items():
        if not key.startswith(INTERRUPTION_PREFIX):
            continue
        kind, _, cause = key.removeprefix(INTERRUPTION_PREFIX).partition(":")
        if kind in counts:
            counts[kind][cause] += value
    return {kind: dict(sorted(c.items())) for kind, c in counts.items()}


def interruptions_per_job_month(jobs: Iterable[JobOutcomeRecord]) -> float | None:
    """Unplanned interruptions of the jobs over :data:`BIG_JOB_GPUS` GPUs per 30 days of
    their running time (the wall seconds they held nodes); None when no such job ran."""
    count = 0
    held_s = 0.0
    for job in jobs:
        if job.gpus > BIG_JOB_GPUS:
            count += job.unplanned
            held_s += job.held_s
    return None if held_s <= 0 else count * MONTH_S / held_s


def tenants(result: TwinResult) -> dict[str, Any] | None:
    """Per tenant (with an allocation; None without): its contract, how it used it, what
    it borrowed and lent, its waits and reclaims (docs/twin.md "Allocation")."""
    inputs = result.inputs
    if inputs.allocation is None:
        return None
    end_s = inputs.days * DAY_S
    owner = {spec.job_id: spec.tenant for spec in inputs.jobs}
    asked: dict[str, float] = {}
    for spec in inputs.jobs:
        if spec.submit_s <= end_s:
            asked[spec.tenant] = asked.get(spec.tenant, 0.0) + spec.work_s * spec.gpus
    records: dict[str, list[JobOutcomeRecord]] = {t: [] for t in inputs.partitions}
    for job in result.jobs:
        records.setdefault(owner.get(job.job_id, ""), []).append(job)
    out: dict[str, Any] = {}
    for name, gpus in contracts(inputs.nodes, inputs.partitions).items():
        use = result.tenant_usage.get(name, {})
        mine = records.get(name, [])
        waits = sorted(
            [w for job in mine for w in job.queue_wait_s]
            + [job.waiting_s for job in mine if job.waiting_s is not None]
        )
        out[name] = {
            "guarantee_gpus": gpus,
            "nodes": len(inputs.partitions[name]),
            "guarantee_utilisation": _ratio(use.get("within", 0.0), gpus * end_s),
            "used_over_guarantee": _ratio(use.get("used", 0.0), gpus * end_s),
            "gpu_hours_asked": asked.get(name, 0.0) / 3600,
            "gpu_hours_used": use.get("used", 0.0) / 3600,
            "gpu_hours_borrowed": use.get("borrowed", 0.0) / 3600,
            "gpu_hours_lent": use.get("lent", 0.0) / 3600,
            "queue_wait_s": {f"p{q}": percentile(waits, q) for q in (50, 90)},
            "still_waiting": sum(1 for job in mine if job.waiting_s is not None),
            "reclaims": {
                "made": int(use.get("reclaims_made", 0)),
                "suffered": int(use.get("reclaims_suffered", 0)),
            },
            "jobs": job_counts(mine),
        }
    return out


def queue_wait(jobs: Iterable[JobOutcomeRecord]) -> dict[str, float | None]:
    """Percentiles of every wait in the queue (first waits and waits after a requeue)."""
    waits = sorted(w for job in jobs for w in job.queue_wait_s)
    return {f"p{q}": percentile(waits, q) for q in (50, 90, 99)}


def elastic(result: TwinResult) -> dict[str, Any]:
    """The ``elastic`` section: the elastic jobs that started (``pooled`` runs only),
    their growths and shrinks (each a fresh checkpoint and a restart at the new size),
    the generations (starts, restarts, resizes) that ran above their nominal ``nodes``,
    and ``gpu_hours_beyond_nominal``: the GPU-hours they held above their nominal size
    (idle capacity they filled);
    ``size_over_nominal``: their GPU-seconds held / (their time held x nominal GPUs),
    the mean size they ran at against their nominal one (their run time is its inverse:
    their work scales with their size)."""
    jobs = [j for j in result.jobs if j.held_gpu_s is not None and j.first_start_s is not None]
    beyond = sum(max(0.0, (j.held_gpu_s or 0.0) - j.held_s * j.gpus) for j in jobs)
    counts = result.decisions
    above = sum(
        n for k, n in counts.items() if k.startswith("elastic:size:+") and k != "elastic:size:+0"
    )
    nominal = sum(j.held_s * j.gpus for j in jobs)
    held = sum(j.held_gpu_s or 0.0 for j in jobs)
    return {
        "jobs": len(jobs),
        "size_over_nominal": _ratio(held, nominal),
        "grows": counts.get("elastic:grows", 0),
        "shrinks": counts.get("elastic:shrinks", 0),
        "generations_above_nominal": above,
        "gpu_hours_beyond_nominal": beyond / 3600,
    }


def job_counts(jobs: Sequence[JobOutcomeRecord]) -> dict[str, int]:
    """Every job counted once, by its state at the end of the run."""
    states = Counter(job.state for job in jobs)
    return {
        "submitted": len(jobs),
        "finished": states["succeeded"],
        "failed": states["failed"],
        "running": states["running"],
        "queued": states["queued"],
    }


def percentile(ordered: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile of ascending ``ordered``, linear between closest ranks
    (numpy's default); None for no values."""
    if not ordered:
        return None
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def dump_report(report: Mapping[str, Any], path: Path | str) -> None:
    """Write ``report`` as indented, key-sorted JSON with a trailing newline."""
    Path(path).write_text(dumps_report(report), encoding="utf-8")


def dumps_report(report: Mapping[str, Any]) -> str:
    """The report's file contents (what :func:`dump_report` writes)."""
    return json.dumps(report, sort_keys=True, indent=2) + "\n"


ROWS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("nodes", ("nodes",), "int"),
    ("GPUs", ("gpus",), "int"),
    ("days", ("days",), "num"),
    ("utilisation", ("utilisation",), "pct"),
    ("GPU-hours busy", ("gpu_hours_busy",), "int"),
    ("goodput GPU-hours", ("goodput_gpu_hours",), "int"),
    ("GPU-hours down", ("gpu_hours_down",), "int"),
    ("ETTR fleet", ("ettr", "fleet"), "pct"),
    ("ETTR jobs p10", ("ettr", "jobs_p10"), "pct"),
    ("ETTR jobs p50", ("ettr", "jobs_p50"), "pct"),
    ("ETTR jobs p90", ("ettr", "jobs_p90"), "pct"),
    ("ETTR gang jobs p50", ("ettr", "gang_jobs_p50"), "pct"),
    ("interruptions unplanned", ("interruptions", "unplanned"), "int"),
    ("interruptions planned", ("interruptions", "planned"), "int"),
    ("unplanned /1000 node-days", ("interruptions", "unplanned_per_1000_node_days"), "num"),
    ("planned /1000 node-days", ("interruptions", "planned_per_1000_node_days"), "num"),
    (f"per job-month (>{BIG_JOB_GPUS} GPUs)", ("interruptions_per_job_month",), "num"),
    ("queue wait p50 (s)", ("queue_wait_s", "p50"), "int"),
    ("queue wait p90 (s)", ("queue_wait_s", "p90"), "int"),
    ("queue wait p99 (s)", ("queue_wait_s", "p99"), "int"),
    ("jobs submitted", ("jobs", "submitted"), "int"),
    ("jobs finished", ("jobs", "finished"), "int"),
    ("jobs failed", ("jobs", "failed"), "int"),
    ("jobs running", ("jobs", "running"), "int"),
    ("jobs queued", ("jobs", "queued"), "int"),
)
"""The rows of :func:`compare_table`: label, the key path in the report, the format."""


STRAGGLER_ROWS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("straggler episodes", ("stragglers", "episodes"), "int"),
    ("straggler GPU-hours slowed", ("stragglers", "gpu_hours_slowed"), "int"),
    ("straggler moves", ("stragglers", "moves"), "int"),
    ("straggler GPU-hours moves", ("stragglers", "gpu_hours_moves"), "int"),
)
"""Rows added to :func:`compare_table` when a run had stragglers."""

SYNC_ROWS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("placement", ("placement",), "num"),
    ("sync time share", ("sync", "sync_time_share"), "pct"),
    ("scaling efficiency", ("sync", "scaling_efficiency"), "pct"),
    ("sync time mean (s)", ("sync", "sync_time_s", "mean"), "num"),
    ("step time p50 (s)", ("sync", "step_time_s", "p50"), "num"),
    ("step time p90 (s)", ("sync", "step_time_s", "p90"), "num"),
)
"""Rows added to :func:`compare_table` when a run had multi-node gangs."""

TENANT_ROWS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("guarantee GPUs", ("guarantee_gpus",), "int"),
    ("guarantee used", ("guarantee_utilisation",), "pct"),
    ("GPU-hours borrowed", ("gpu_hours_borrowed",), "int"),
    ("GPU-hours lent", ("gpu_hours_lent",), "int"),
    ("queue wait p50 (s)", ("queue_wait_s", "p50"), "int"),
    ("queue wait p90 (s)", ("queue_wait_s", "p90"), "int"),
    ("reclaims suffered", ("reclaims", "suffered"), "int"),
)
"""Rows added to :func:`compare_table` per tenant when a run had an allocation."""

ELASTIC_ROWS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("elastic jobs", ("elastic", "jobs"), "int"),
    ("elastic size / nominal", ("elastic", "size_over_nominal"), "num"),
    ("elastic grows", ("elastic", "grows"), "int"),
    ("elastic shrinks", ("elastic", "shrinks"), "int"),
    ("elastic GPU-h beyond nominal", ("elastic", "gpu_hours_beyond_nominal"), "int"),
)
"""Rows added to :func:`compare_table` when a run had elastic jobs."""


def compare_table(reports: Sequence[Mapping[str, Any]]) -> str:
    """One text table: a row per measure, a column per report (headed by its policy);
    the straggler rows only when a run had stragglers, the sync rows only when one had
    multi-node gangs."""
    headers = ["", *(_column(r) for r in reports)]
    rows_spec = ROWS
    if any(_lookup(r, ("stragglers", "episodes")) for r in reports):
        rows_spec = (*rows_spec, *STRAGGLER_ROWS)
    if any(_lookup(r, ("sync", "gangs")) for r in reports):
        rows_spec = (*rows_spec, *SYNC_ROWS)
    if any(_lookup(r, ("elastic", "jobs")) for r in reports):
        rows_spec = (*rows_spec, *ELASTIC_ROWS)
    names = sorted({t for r in reports for t in (r.get("tenants") or {})})
    for name in names:
        rows_spec = (
            *rows_spec,
            *((f"{name}: {label}", ("tenants", name, *path), kind)
              for label, path, kind in TENANT_ROWS),
        )  # fmt: skip
    rows = [
        [label, *(_format(_lookup(r, path), kind) for r in reports)]
        for label, path, kind in rows_spec
    ]
    return table(headers, rows)


def _column(report: Mapping[str, Any]) -> str:
    """A column's heading: the policy, or the allocation and its policy."""
    allocation = report.get("allocation")
    policy = str(report["policy"])
    return f"{allocation} ({policy})" if allocation else policy


def _lookup(report: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    value: Any = report
    for key in path:
        value = value.get(key) if isinstance(value, Mapping) else None
    return value


def _format(value: Any, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "pct":
        return f"{100 * value:.1f} %"
    if kind == "int":
        return f"{round(value):,}"
    return f"{value:,.3f}".rstrip("0").rstrip(".") if isinstance(value, float) else str(value)


def _ratio(numerator: float, denominator: float) -> float | None:
    return None if denominator <= 0 else numerator / denominator


def _clean(value: Any) -> Any:
    """JSON-ready and byte-stable: floats rounded (-0.0 and non-finite values made 0.0 and
    null), tuples and sets as lists (sets sorted), dataclasses as dicts, keys as str."""
    if isinstance(value, bool) or value is None or isinstance(value, int | str):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        rounded = round(value, DECIMALS)
        return 0.0 if rounded == 0 else rounded
    if isinstance(value, Mapping):
        return {str(k): _clean(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _clean(dataclasses.asdict(value))
    if isinstance(value, set | frozenset):
        return sorted(_clean(v) for v in value)
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON-ready in a twin report: {type(value).__name__}")
