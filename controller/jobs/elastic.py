"""Elastic jobs: how many nodes a job runs on inside ``[min_nodes, max_nodes]``.

Pure and synchronous, like the scheduler it asks (docs/jobs.md "Elastic jobs"): every
size is tried with the real :meth:`FleetIndex.place`, so an elastic job of ``n`` members
goes exactly where a fixed job of ``n`` would, and nothing here changes a decision of the
scheduler's queue pass.  Three questions, each answered for the job manager to carry out:

- :func:`initial_size`: the largest size that can start now (None: it waits in the queue
  for ``nodes``, as a fixed job would);
- :func:`grow_decision`: whether a running job grows into idle nodes now, and where to;
- :func:`shrink_plan` / :func:`shrink_victims`: which of its nodes a preemption victim
  gives up to stay running, never below ``min_nodes``, instead of being stopped whole.

A :class:`Resize` restarts the job from a fresh checkpoint on its new placement, with the
new ``MG_WORLD_SIZE`` (the manager's move; event ``job.resized``, :meth:`Resize.attributes`).
Functions that try sizes release and commit jobs on the ``index`` they are given and
leave it holding what it held.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from metalguard.controller.jobs.scheduler import (
    FleetIndex,
    JobRequest,
    Placement,
    Preemption,
    RunningJob,
    request_from_job,
)
from metalguard.proto.base import AttrValue
from metalguard.proto.jobs import Job, JobStatus

ResizeReason = Literal["grow", "shrink"]


@dataclass(frozen=True, slots=True)
class NodeRange:
    """The sizes a job may run at: ``low`` to ``high`` members, ``first`` the size it
    waits (and preempts) for in the queue, ``interval_s`` between growths."""

    low: int
    high: int
    first: int
    interval_s: float

    @property
    def elastic(self) -> bool:
        """Whether the job may run at more than one size."""
        return self.high > self.low


def node_range(job: Job) -> NodeRange:
    """A job's sizes: ``min_nodes`` and ``max_nodes``, each ``nodes`` when unset (a job
    that sets neither runs at ``nodes`` only)."""
    low = job.nodes if job.min_nodes is None else job.min_nodes
    high = job.nodes if job.max_nodes is None else job.max_nodes
    return NodeRange(low, high, job.nodes, job.resize_interval_s)


@dataclass(frozen=True, slots=True)
class Resize:
    """Restart ``job_id`` from a fresh checkpoint on ``to_nodes`` (rank order) instead of
    ``from_nodes``; ``by``: the job a shrink makes room for."""

    job_id: str
    reason: ResizeReason
    from_nodes: tuple[str, ...]
    to_nodes: tuple[str, ...]
    by: str = ""

    @property
    def released(self) -> tuple[str, ...]:
        """The nodes it gives up (a shrink's: those the preempting job needs)."""
        kept = set(self.to_nodes)
        return tuple(h for h in self.from_nodes if h not in kept)

    def attributes(self) -> dict[str, AttrValue]:
        """The ``job.resized`` event's attributes: sizes, reason, nodes (and ``by``)."""
        attrs: dict[str, AttrValue] = {
            "from": len(self.from_nodes),
            "to": len(self.to_nodes),
            "reason": self.reason,
            "from_nodes": ",".join(self.from_nodes),
            "to_nodes": ",".join(self.to_nodes),
        }
        if self.by:
            attrs["by"] = self.by
        return attrs


def may_grow(status: JobStatus) -> bool:
    """Whether a job may grow now: running elastic below its ``max_nodes``, not moving."""
    job = status.job
    if job is None or status.state != "running" or status.move is not None:
        return False
    span = node_range(job)
    return span.elastic and len(status.placement) < span.high


def largest_placement(req: JobRequest, index: FleetIndex, low: int, high: int) -> Placement | None:
    """The placement of the largest ``n`` in ``[low, high]`` for which ``index.place``
    finds one (``req`` asking for ``n`` members), or None when not even ``low`` fits.

    Whether ``n`` members fit only turns from yes to no as ``n`` grows (``n - 1`` of the
    same eligible nodes fit the same group), so the sizes are bisected."""
    low = max(low, 1)
    if high < low:
        return None
    best = index.place(replace(req, nodes=low))
    if best is None:
        return None
    lo, hi = low, high  # fits at lo; the answer is in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        placed = index.place(replace(req, nodes=mid))
        if placed is None:
            hi = mid - 1
        else:
            lo, best = mid, placed
    return best


def initial_size(job: Job, index: FleetIndex, exclude: Iterable[str] = ()) -> Placement | None:
    """Where ``job`` starts now: the largest placement of ``min_nodes`` to ``max_nodes``
    members on ``index`` (which must not hold the job), avoiding ``exclude`` (the bad
    nodes of a move, the nodes reserved for jobs ahead of it).  Its size is
    ``len(placement.nodes)``; None: not even ``min_nodes`` fit, and the job waits in the
    queue for ``nodes``.  A job that is not elastic gets ``nodes`` or None."""
    span = node_range(job)
    return largest_placement(request_from_job(job, exclude), index, span.low, span.high)


def start_placement(
    job: Job,
    placed: Placement,
    index: FleetIndex,
    exclude: Collection[str] = (),
    reserved: Collection[str] = (),
    allowed: Callable[[JobRequest, Sequence[str]], bool] = lambda _req, _nodes: True,
) -> Placement:
    """Where a job the queue pass ``placed`` starts: an elastic job at the largest size
    that fits now (:func:`initial_size`, never on ``exclude``, a move's bad nodes, nor
    on ``reserved``, the nodes held back for blocked jobs, but for those of ``placed``)
    when that is bigger and ``allowed`` (its tenant's quota); ``placed`` otherwise.
    ``index`` must not hold the job (the caller commits the answer)."""
    if not node_range(job).elastic:
        return placed
    avoid = (*exclude, *(set(reserved) - set(placed.nodes)))
    best = initial_size(job, index, avoid)
    if best is None or len(best.nodes) <= len(placed.nodes):
        return placed
    if not allowed(request_from_job(job, exclude), best.nodes):
        return placed
    return best


def grow_decision(
    job: Job,
    placement: Sequence[str],
    index: FleetIndex,
    now: float,
    last_resize_ts: float,
    waiting: Sequence[JobRequest] = (),
    reserved: Collection[str] = (),
) -> Resize | None:
    """Whether a running elastic job grows now, and onto which nodes.

    It grows when all of these hold:

    - it is elastic and runs on fewer than ``max_nodes`` (``placement``, held in
      ``index``);
    - ``resize_interval_s`` has passed since ``last_resize_ts`` (its last resize, or the
      start of its current run);
    - no other job of ``waiting`` (the queue) could be placed on ``index`` now: the idle
      nodes serve the queue first (its next pass places it);
    - a larger placement exists, of its own nodes and idle ones but none of
      ``reserved`` (the nodes the queue pass holds back for blocked jobs,
      ``Blocked.reserved``): like a backfill, a growth never delays a waiting job.

    The new placement is the largest that fits, up to ``max_nodes``, where the scheduler
    would put a fresh job of that size (its current nodes count as free for it, so it
    may move to a tighter group).  None: it keeps its size.
    """
    span = node_range(job)
    current = tuple(placement)
    if not span.elastic or len(current) >= span.high:
        return None
    if now - last_resize_ts < span.interval_s:
        return None
    if any(w.job_id != job.job_id and index.place(w) is not None for w in waiting):
        return None
    held = request_from_job(job)
    req = replace(held, exclude=frozenset(reserved) - frozenset(current))
    index.release(held, current)
    try:
        grown = largest_placement(req, index, len(current) + 1, span.high)
    finally:
        index.commit(held, current)
    if grown is None:
        return None
    return Resize(job.job_id, "grow", current, grown.nodes)


def shrink_plan(
    req: JobRequest,
    preemption: Preemption,
    victim: RunningJob,
    min_nodes: int,
    index: FleetIndex,
    gone: Sequence[RunningJob] = (),
) -> Resize | None:
    """The nodes a preemption victim gives up to keep running with at least
    ``min_nodes`` members, or None (it is preempted whole, as planned).

    ``req`` is the preempting job's request, ``preemption`` the scheduler's plan for it,
    ``index`` holds every running job (the victim too) but not ``req``; ``gone`` is what
    the plan's other victims free (a whole job, or a shrunk one as a ``RunningJob`` of
    its released nodes only).  The victim releases the fewest of its nodes whose release,
    with ``gone``, lets ``req`` fit (:func:`release_order`: those the plan would take
    first, then leaf by leaf, emptying the leaves and racks where it has the fewest
    nodes, so what it keeps stays compact), and never more than the plan's own nodes on
    it when those suffice.  The kept nodes stay in their rank order."""
    current = victim.placement
    spare = len(current) - min_nodes
    if victim.request.job_id not in preemption.victims or spare < 1:
        return None
    order = release_order(current, preemption.placement, index)
    wanted = set(preemption.placement.nodes)
    planned = tuple(h for h in current if h in wanted)

    def fits(released: Sequence[str]) -> bool:
        partial = RunningJob(victim.request, tuple(released))
        return _fits_without(index, req, (*gone, partial))

    if not fits(order[:spare]):
        return None
    lo, hi = 1, spare  # fits at hi
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(order[:mid]):
            hi = mid
        else:
            lo = mid + 1
    released = order[:lo]
    if 0 < len(planned) < lo and fits(planned):
        released = planned  # the plan's own nodes on it are fewer: the fewest win
    gives = set(released)
    keep = tuple(h for h in current if h not in gives)
    return Resize(victim.request.job_id, "shrink", current, keep, by=req.job_id)


def release_order(
    placement: Sequence[str], planned: Placement, index: FleetIndex
) -> tuple[str, ...]:
    """A victim's nodes in the order it gives them up: first the leaves where the plan
    puts a member, then the other leaves of the plan's group, then the rest; inside each,
    the racks and then the leaves where it has the fewest nodes first (emptied whole,
    the rest stays compact), the plan's nodes first inside a leaf.  Nodes no longer in
    the fleet come last (freeing them makes no room)."""
    nodes = index.nodes
    known = [h for h in placement if h in nodes]
    wanted = set(planned.nodes)
    racks = Counter(nodes[h].rack_key for h in known)
    leaves = Counter(nodes[h].leaf_key for h in known)
    hot = {nodes[h].leaf_key for h in known if h in wanted}

    def key(h: str) -> tuple[int, int, tuple[str, ...], int, tuple[str, ...], bool, str]:
        node = nodes[h]
        leaf = node.leaf_key
        near = 0 if leaf in hot else 1 if node.group_key(planned.level) == planned.group else 2
        return (near, racks[node.rack_key], node.rack_key, leaves[leaf], leaf, h not in wanted, h)

    return (*sorted(known, key=key), *(h for h in placement if h not in nodes))


def shrink_victims(
    req: JobRequest,
    preemption: Preemption,
    running: Sequence[RunningJob],
    jobs: Mapping[str, Job],
    index: FleetIndex,
) -> dict[str, Resize]:
    """:func:`shrink_plan` for each elastic victim of ``preemption`` (job id -> its
    shrink); the victims not listed are preempted whole.  The victims are decided in the
    plan's order, each seeing the earlier ones' shrinks and the later ones gone whole (a
    later one that shrinks too checks the fit with both), so together they still make
    room for ``req``.  ``jobs``: the victims' submitted jobs (their ``min_nodes``)."""
    by_id = {r.request.job_id: r for r in running}
    victims = [by_id[v] for v in preemption.victims if v in by_id]
    frees: dict[str, RunningJob] = {v.request.job_id: v for v in victims}
    plans: dict[str, Resize] = {}
    for victim in victims:
        job_id = victim.request.job_id
        job = jobs.get(job_id)
        if job is None or not node_range(job).elastic:
            continue
        gone = [free for other, free in frees.items() if other != job_id]
        plan = shrink_plan(req, preemption, victim, node_range(job).low, index, gone)
        if plan is not None:
            plans[job_id] = plan
            frees[job_id] = RunningJob(victim.request, plan.released)
    return plans


def _fits_without(index: FleetIndex, req: JobRequest, gone: Sequence[RunningJob]) -> bool:
    """Whether ``req`` fits on ``index`` once ``gone`` released their nodes (the index is
    left as it was)."""
    done: list[RunningJob] = []
    try:
        for job in gone:
            index.release(job.request, job.placement)
            done.append(job)
        return index.place(req) is not None
    finally:
        for job in done:
            index.commit(job.request, job.placement)
