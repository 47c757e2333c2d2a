"""A job trace: the Alibaba GPU cluster trace's pod list (``openb_pod_list_*.csv``,
Weng et al., ATC 2023) as the twin's :class:`~metalguard.twin.model.JobSpec` jobs, and
the check that every job can fit the fleet at all.

The mapping (each rule stated here and in docs/twin.md):

- one pod = one single-node job (``nodes`` 1) named by ``name``; submitted at
  ``creation_time`` minus the trace's first ``creation_time`` (plus ``start_s``);
- its work is ``deletion_time - scheduled_time``: the time it ran. A pod with no
  ``scheduled_time`` column counts from ``creation_time``. A pod whose
  ``scheduled_time`` is empty (or 0 while created later) never ran: when it is
  ``Pending`` it is skipped (it was deleted before any placement: nothing to replay,
  counted in :attr:`Trace.skipped`), otherwise its work counts from ``creation_time``;
- ``num_gpu`` GPUs per node; a GPU-sharing pod (``num_gpu`` 1 with ``gpu_milli`` below
  1000) takes one whole GPU, since the scheduler has no GPU sharing; ``num_gpu`` 0 is a
  CPU-only job asking ``ceil(cpu_milli / 1000)`` cores (at least 1) and its memory;
  every job asks ``ceil(cpu_milli / 1000)`` cores and ``ceil(memory_mib / 1024)`` GB;
- ``gpu_spec`` names the allowed GPU models ('|'-separated): exactly one model becomes
  the job's ``gpu_type``, several (or none) mean any type;
- ``qos``: ``Guaranteed`` priority 2, ``LS`` (latency-sensitive) 1, ``Burstable`` 0,
  ``BE`` (best effort) 0 and preemptible; other values 0;
- ``pod_phase`` ``Failed``: the job fails by itself once its work is done;
- trace jobs never checkpoint (``checkpoint_interval_s`` 0: an interruption loses the
  run) and restart in :data:`TRACE_RESTART_COST_S` (a container start).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from metalguard.controller.jobs.scheduler import FleetNode
from metalguard.twin.csvrows import Table, cell, number, read_table
from metalguard.twin.errors import TwinInputError
from metalguard.twin.model import JobOutcome, JobSpec

TRACE_COLUMNS = ("name", "num_gpu", "creation_time", "deletion_time")
"""The pod list's required columns (``cpu_milli, memory_mib, gpu_milli, gpu_spec, qos,
pod_phase, scheduled_time`` are optional)."""
TRACE_RESTART_COST_S = 30.0
"""Seconds from a trace job's (re)start until it makes progress: a container start."""
QOS_CLASSES: dict[str, tuple[int, bool]] = {
    "guaranteed": (2, False),
    "ls": (1, False),
    "burstable": (0, False),
    "be": (0, True),
}
"""``qos`` (lower case) -> (priority, preemptible)."""


@dataclass(frozen=True, slots=True)
class Trace:
    """A pod list read: its jobs and what was left out or rounded, for the report."""

    path: str
    jobs: tuple[JobSpec, ...]
    rows: int
    """Data rows in the file."""
    skipped: dict[str, int] = field(default_factory=dict)
    """Rows that are no job, by reason (``pending_never_scheduled``)."""
    gpu_shared_rounded_up: int = 0
    """Pods asking a share of one GPU (``gpu_milli`` < 1000) given a whole one."""
    cpu_only: int = 0
    start_s: float = 0.0
    restart_cost_s: float = TRACE_RESTART_COST_S


def _t(seconds: float) -> str:
    """A time as written in the file (``12537496``, ``12.5``), not in exponent form."""
    return f"{seconds:.0f}" if seconds.is_integer() else repr(seconds)


def _first_creation(table: Table) -> float:
    """The trace's first ``creation_time`` (cells that are no number are left to the
    row-by-row check, which names them)."""
    i = table.columns["creation_time"]
    first = math.inf
    for _, cells in table.rows:
        try:
            first = min(first, float(cells[i]))
        except ValueError:
            continue
    return first if math.isfinite(first) else 0.0


def read_trace(
    path: str | Path, *, start_s: float = 0.0, restart_cost_s: float = TRACE_RESTART_COST_S
) -> Trace:
    """Read a pod list (the module docstring has the mapping). Errors
    (:class:`TwinInputError` with the file and the row; rows count the header as row 1,
    so the first pod is row 2): missing columns (all named), a cell that is not a
    non-negative number, ``deletion_time`` before ``creation_time`` or before
    ``scheduled_time``, ``scheduled_time`` before ``creation_time``, an empty or repeated
    name."""
    table = read_table(path, TRACE_COLUMNS)
    has_scheduled = table.has("scheduled_time")
    raw: list[JobSpec] = []
    seen: dict[str, int] = {}
    skipped: Counter[str] = Counter()
    first = _first_creation(table)
    shared = cpu_only = 0
    for row, cells in table.rows:
        name = cell(table, cells, "name")
        if not name:
            raise TwinInputError(table.path, f"row {row}", "column name is empty")
        if name in seen:
            raise TwinInputError(table.path, f"row {row}", f"name {name} repeats row {seen[name]}")
        seen[name] = row
        gpus = int(number(table, row, "num_gpu", cell(table, cells, "num_gpu"), integer=True))
        values: dict[str, float] = {}
        for col in ("cpu_milli", "memory_mib", "gpu_milli"):
            text = cell(table, cells, col)
            values[col] = number(table, row, col, text) if text else 0.0
        created = number(table, row, "creation_time", cell(table, cells, "creation_time"))
        deleted = number(table, row, "deletion_time", cell(table, cells, "deletion_time"))
        if deleted < created:
            raise TwinInputError(
                table.path,
                f"row {row}",
                f"deletion_time {_t(deleted)} is before creation_time {_t(created)}",
            )
        phase = cell(table, cells, "pod_phase").lower()
        started = created
        if has_scheduled:
            text = cell(table, cells, "scheduled_time")
            scheduled = number(table, row, "scheduled_time", text) if text else 0.0
            if not text or (scheduled == 0.0 and created > 0.0):
                if phase == "pending":
                    skipped["pending_never_scheduled"] += 1
                    continue
            else:
                if scheduled < created:
                    raise TwinInputError(
                        table.path,
                        f"row {row}",
                        f"scheduled_time {_t(scheduled)} is before creation_time {_t(created)}",
                    )
                if deleted < scheduled:
                    raise TwinInputError(
                        table.path,
                        f"row {row}",
                        f"deletion_time {_t(deleted)} is before scheduled_time {_t(scheduled)}",
                    )
                started = scheduled
        cpu = math.ceil(values["cpu_milli"] / 1000)
        if gpus == 0:
            cpu_only += 1
            cpu = max(cpu, 1)
        elif gpus == 1 and 0 < values["gpu_milli"] < 1000:
            shared += 1
        models = [m.strip() for m in cell(table, cells, "gpu_spec").split("|") if m.strip()]
        priority, preemptible = QOS_CLASSES.get(cell(table, cells, "qos").lower(), (0, False))
        outcome: JobOutcome = "failed" if phase == "failed" else "succeeded"
        raw.append(
            JobSpec(
                job_id=name,
                submit_s=created - first + start_s,
                nodes=1,
                gpus_per_node=gpus,
                work_s=deleted - started,
                cpu=cpu,
                memory_gb=math.ceil(values["memory_mib"] / 1024),
                gpu_type=models[0] if len(models) == 1 else "",
                priority=priority,
                preemptible=preemptible,
                restart_cost_s=restart_cost_s,
                outcome=outcome,
                source="trace",
                origin=f"{table.path}:row {row}",
            )
        )
    raw.sort(key=lambda j: j.submit_s)  # stable: rows in file order at equal times
    return Trace(
        path=table.path,
        jobs=tuple(raw),
        rows=len(table.rows),
        skipped=dict(sorted(skipped.items())),
        gpu_shared_rounded_up=shared,
        cpu_only=cpu_only,
        start_s=start_s,
        restart_cost_s=restart_cost_s,
    )


def load_trace(
    path: str | Path, *, start_s: float = 0.0, restart_cost_s: float = TRACE_RESTART_COST_S
) -> tuple[JobSpec, ...]:
    """The jobs of a pod list (:func:`read_trace`), sorted by submit time."""
    return read_trace(path, start_s=start_s, restart_cost_s=restart_cost_s).jobs


def trace_dict(trace: Trace) -> dict[str, object]:
    """The trace's stated reading, for the report's workload parameters."""
    return {
        "path": trace.path,
        "rows": trace.rows,
        "jobs": len(trace.jobs),
        "skipped": dict(trace.skipped),
        "gpu_shared_rounded_up": trace.gpu_shared_rounded_up,
        "cpu_only": trace.cpu_only,
        "start_s": trace.start_s,
        "restart_cost_s": trace.restart_cost_s,
        "checkpoint_interval_s": 0.0,
    }


# --- does every job fit the fleet at all ----------------------------------------------

_Shape = tuple[str, int, int, int]
"""(gpu_type, gpus, cpu_cores, memory_gb) of a node."""


def _eligible(shape: _Shape, job: JobSpec) -> bool:
    gpu_type, gpus, cpu, memory = shape
    if job.gpu_type and gpu_type != job.gpu_type:
        return False
    return gpus >= job.gpus_per_node and cpu >= job.cpu and memory >= job.memory_gb


def _need(job: JobSpec) -> str:
    s = "s" if job.nodes != 1 else ""
    of_type = f" of type {job.gpu_type}" if job.gpu_type else ""
    if job.gpus_per_node == 0 and job.cpu == 0 and job.memory_gb == 0:
        return f"{job.nodes} whole node{s}{of_type}"
    parts = []
    if job.gpus_per_node:
        parts.append(f"{job.gpus_per_node} GPU{'s' if job.gpus_per_node != 1 else ''}{of_type}")
        of_type = ""
    if job.cpu:
        parts.append(f"{job.cpu} CPU cores")
    if job.memory_gb:
        parts.append(f"{job.memory_gb} GB of memory")
    listed = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return f"{job.nodes} node{s}{of_type} with {listed}{' each' if job.nodes != 1 else ''}"


def _shortfall(job: JobSpec, shapes: Counter[_Shape], eligible: int) -> str:
    if eligible:
        return f"the fleet has only {eligible} such node{'s' if eligible != 1 else ''}"
    candidates = [s for s in shapes if not job.gpu_type or s[0] == job.gpu_type]
    if not candidates:
        types = ", ".join(sorted({s[0] or "(none)" for s in shapes}))
        return f"the fleet has no {job.gpu_type} nodes (its GPU types: {types})"
    kind = f"{job.gpu_type} " if job.gpu_type else ""
    best = max(s[1] for s in candidates)
    if best < job.gpus_per_node:
        return f"the fleet's largest {kind}node has {best} GPUs"
    candidates = [s for s in candidates if s[1] >= job.gpus_per_node]
    best = max(s[2] for s in candidates)
    if best < job.cpu:
        return f"the fleet's largest such {kind}node has {best} CPU cores"
    best = max(s[3] for s in candidates if s[2] >= job.cpu)
    return f"the fleet's largest such {kind}node has {best} GB of memory"


def _origin(job: JobSpec) -> tuple[str, str]:
    path, sep, row = job.origin.rpartition(":row ")
    if sep:
        return path, f"row {row}"
    return job.origin or job.job_id, f"job {job.job_id}"


def check_fits(jobs: Iterable[JobSpec], nodes: Sequence[FleetNode]) -> None:
    """Raise :class:`TwinInputError` (the job's origin file and row, what it needs,
    what the fleet has) for the first job whose gang cannot fit the fleet even when the
    fleet is empty and healthy: fewer nodes of its GPU type with enough GPUs, CPU cores
    and memory than the gang has members. Runs over node shapes, not nodes."""
    shapes: Counter[_Shape] = Counter((n.gpu_type, n.gpus, n.cpu_cores, n.memory_gb) for n in nodes)
    known: dict[tuple[str, int, int, int], int] = {}
    for job in jobs:
        key = (job.gpu_type, job.gpus_per_node, job.cpu, job.memory_gb)
        eligible = known.get(key)
        if eligible is None:
            eligible = known[key] = sum(c for s, c in shapes.items() if _eligible(s, job))
        if eligible < job.nodes:
            path, where = _origin(job)
            raise TwinInputError(
                path, where, f"needs {_need(job)} but {_shortfall(job, shapes, eligible)}"
            )
