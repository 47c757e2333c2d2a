"""Gang scheduler: pure, topology-aware placement, priority queue, preemption.

Inputs are plain frozen records (``FleetNode``, ``JobRequest``, ``RunningJob``);
nothing here touches NATS, the clock or the KV store.  The jobs manager builds the
inputs from MG_NODES / MG_JOBS and the topology view, calls ``schedule_queue`` (or
``place`` / ``plan_preemption`` directly) and carries out the decisions.

Rules (docs/scheduler.md):

- a member goes only on a node that is HEALTHY and not cordoned, one member per node,
  never over the node's free GPUs, CPU cores or memory, only on the asked GPU type and a
  bandwidth tier at least the asked one; a request that names no resources at all
  (0 GPUs, 0 CPU, 0 memory) takes whole, idle nodes;
- all ``nodes`` members or none;
- the tightest level that fits: one rack, else one cluster, else one zone, else one
  region, never wider than ``max_spread``; among the groups of that level the one with
  the fewest eligible nodes (best fit), inside it the nodes left with the least free
  capacity, leaves filled in order;
- a sensitive tenant never shares a leaf switch with another tenant, and no tenant
  joins a leaf where another tenant's sensitive job runs;
- a job naming a ``dataset``: among the groups of the chosen level that are equally
  good (as many eligible nodes), the one with the most nodes where the dataset is warm;
  inside the group, warm nodes before the others.  Only a tie-breaker: it never changes
  the level, nor which nodes are eligible;
- preemption: the fewest running jobs of lower priority that are preemptible whose
  removal lets the job fit (ties: lowest priorities, then fewest nodes disturbed).

For speed (a 1,024-node gang on 100,000 nodes) ``FleetIndex`` groups the schedulable
nodes by leaf and, inside a leaf, by their free-capacity shape; a placement walks
leaves and shapes, not nodes, and only the chosen group's nodes are listed.
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from metalguard.proto.jobs import Job
from metalguard.proto.topology import NodeTopology

Level = Literal["rack", "cluster", "zone", "region"]
LEVELS: tuple[Level, ...] = ("rack", "cluster", "zone", "region")
"""Topology levels from the tightest to the widest."""

PREEMPTION_SEARCH_BUDGET = 20_000
"""Victim sets tried exactly before the preemption planner falls back to greedy."""
PREEMPTION_SEARCH_WORK = 2_000_000
"""... and at most this many (victim sets x fleet nodes): exact on small fleets, a quick
greedy answer on big ones."""
GREEDY_GROUPS = 4
"""The greedy planner aims at this many groups per level (those nearest to fitting) ..."""
GREEDY_DROP_TRIES = 64
"""... and then tries to spare at most this many of the victims it picked."""


class FleetNode(NodeTopology, frozen=True, kw_only=True):
    """One node as the scheduler sees it: who it is, its topology (place and capacity;
    a ``leaf`` of "" is the rack's single leaf, or the node's own when ``rack`` is "" too),
    and whether it takes work."""

    handle: str
    """``region.cluster.node``."""
    region: str
    cluster: str
    grade: str = "HEALTHY"
    cordoned: bool = False
    warm_datasets: frozenset[str] = frozenset()
    """The datasets whose node-local cache is warm here (``controller.core.warm``)."""

    @property
    def schedulable(self) -> bool:
        """HEALTHY and not cordoned: may receive new members."""
        return self.grade == "HEALTHY" and not self.cordoned

    @property
    def rack_key(self) -> tuple[str, ...]:
        """The rack's key, unique in the fleet."""
        return (self.region, self.zone, self.cluster, self.rack or self.handle)

    @property
    def leaf_key(self) -> tuple[str, ...]:
        """The leaf switch's key, unique in the fleet."""
        return (*self.rack_key, self.leaf)

    def group_key(self, level: Level) -> tuple[str, ...]:
        """The key of the group of ``level`` the node belongs to."""
        if level == "rack":
            return self.rack_key
        if level == "cluster":
            return (self.region, self.zone, self.cluster)
        if level == "zone":
            return (self.region, self.zone)
        return (self.region,)


@dataclass(frozen=True, slots=True)
class JobRequest:
    """What one job asks of the scheduler (per member = per node)."""

    job_id: str
    nodes: int = 1
    tenant: str = "default"
    gpus_per_node: int = 0
    gpu_type: str = ""
    cpu: int = 0
    memory_gb: int = 0
    bandwidth_tier: int = 0
    max_spread: Level = "region"
    allowed_regions: tuple[str, ...] = ()
    priority: int = 0
    preemptible: bool = False
    sensitive: bool = False
    submitted_ts: float = 0.0
    exclude: frozenset[str] = frozenset()
    """Node handles the job must avoid (the node it is being moved off)."""
    dataset: str = ""
    """The dataset the job reads: nodes where it is warm win ties (docs/scheduler.md)."""

    @property
    def exclusive(self) -> bool:
        """Names no resources: takes whole, idle nodes."""
        return self.gpus_per_node == 0 and self.cpu == 0 and self.memory_gb == 0


@dataclass(frozen=True, slots=True)
class RunningJob:
    """A job that holds nodes now (running, checkpointing or being moved)."""

    request: JobRequest
    placement: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a gang goes: one node per member, rank order."""

    job_id: str
    nodes: tuple[str, ...]
    level: Level
    group: tuple[str, ...]
    """Key of the rack / cluster / zone / region the gang fits in."""


@dataclass(frozen=True, slots=True)
class Preemption:
    """Stop (checkpoint, requeue) ``victims`` so that ``placement`` can start."""

    job_id: str
    victims: tuple[str, ...]
    placement: Placement


@dataclass(frozen=True, slots=True)
class Blocked:
    """A job that stays queued this pass, and why."""

    job_id: str
    reason: str
    reserved: tuple[str, ...] = ()
    """Nodes held back from backfill for it (where it would go once they free up)."""


@dataclass(frozen=True, slots=True)
class QueuePass:
    """The decisions of one pass over the queue, in priority order."""

    placements: tuple[Placement, ...] = ()
    preemptions: tuple[Preemption, ...] = ()
    blocked: tuple[Blocked, ...] = ()


def request_from_job(job: Job, exclude: Iterable[str] = ()) -> JobRequest:
    """The scheduler's view of a submitted job (``proto.jobs.Job``)."""
    return JobRequest(
        job_id=job.job_id,
        nodes=job.nodes,
        tenant=job.tenant,
        gpus_per_node=job.gpus_per_node,
        gpu_type=job.gpu_type,
        cpu=job.cpu,
        memory_gb=job.memory_gb,
        bandwidth_tier=job.bandwidth_tier,
        max_spread=job.max_spread,
        allowed_regions=tuple(job.allowed_regions),
        priority=job.priority,
        preemptible=job.preemptible,
        sensitive=job.sensitive,
        submitted_ts=job.submitted_ts,
        exclude=frozenset(exclude),
        dataset=job.dataset,
    )


# --- the index --------------------------------------------------------------------

Shape = tuple[str, int, int, int, int, bool]
"""(gpu_type, bandwidth_tier, free gpus, free cpu, free memory, idle)."""


@dataclass(slots=True)
class _Leaf:
    key: tuple[str, ...]
    node: FleetNode
    """A representative node (for the group keys)."""
    groups: tuple[tuple[str, ...], ...] = ()
    """The keys of its rack, cluster, zone and region (``LEVELS`` order)."""
    shapes: dict[Shape, list[str]] = field(default_factory=dict)
    tenants: Counter[str] = field(default_factory=Counter)
    sensitive: Counter[str] = field(default_factory=Counter)


def _count(counter: Counter[str], key: str, sign: int) -> None:
    """Add ``sign`` to ``counter[key]``; a key at zero is removed (so ``len`` counts the
    tenants present)."""
    counter[key] += sign
    if counter[key] <= 0:
        del counter[key]


def _fits(shape: Shape, req: JobRequest) -> bool:
    gpu_type, tier, gpus, cpu, mem, idle = shape
    if req.gpu_type and gpu_type != req.gpu_type:
        return False
    if tier < req.bandwidth_tier:
        return False
    if req.exclusive:
        return idle
    return gpus >= req.gpus_per_node and cpu >= req.cpu and mem >= req.memory_gb


def _leaf_allows(leaf: _Leaf, req: JobRequest) -> bool:
    # zero counts are removed, so "another tenant is here" = more keys than our own
    if req.sensitive and len(leaf.tenants) > (req.tenant in leaf.tenants):
        return False
    return len(leaf.sensitive) <= (req.tenant in leaf.sensitive)


class FleetIndex:
    """Free capacity of the schedulable nodes, grouped by leaf and shape.

    Built once per pass (O(nodes)); ``place`` reads it, ``commit`` applies a placement
    so that the next job of the pass sees the capacity it took.
    """

    def __init__(self, nodes: Iterable[FleetNode], running: Iterable[RunningJob] = ()) -> None:
        self.nodes: dict[str, FleetNode] = {n.handle: n for n in nodes}
        self._used: dict[str, list[int]] = {}
        """handle -> [gpus, cpu, memory, members, exclusive members]."""
        self._leaves: dict[tuple[str, ...], _Leaf] = {}
        self._leaf_of: dict[str, _Leaf] = {}
        keyed = sorted((n.leaf_key, n.handle, n) for n in self.nodes.values())
        for key, handle, node in keyed:
            leaf = self._leaves.get(key)
            if leaf is None:
                groups = tuple(node.group_key(level) for level in LEVELS)
                leaf = self._leaves[key] = _Leaf(key, node, groups)
            self._leaf_of[handle] = leaf
        self._leaf_list = list(self._leaves.values())
        self._warm: dict[str, set[str]] = {}
        """dataset -> the schedulable nodes where it is warm."""
        self._groups: list[dict[tuple[str, ...], list[_Leaf]]] = [{} for _ in LEVELS]
        for leaf in self._leaf_list:
            for depth, key in enumerate(leaf.groups):
                self._groups[depth].setdefault(key, []).append(leaf)
        for job in running:
            self._take(job.request, job.placement)
        for _, handle, node in keyed:  # sorted, so every pool is in handle order
            if node.schedulable:
                self._leaf_of[handle].shapes.setdefault(self._shape(node), []).append(handle)
                for name in node.warm_datasets:
                    self._warm.setdefault(name, set()).add(handle)
        self._sizes: list[dict[tuple[str, ...], int]] = [defaultdict(int) for _ in LEVELS]
        for leaf in self._leaf_list:
            size = sum(len(handles) for handles in leaf.shapes.values())
            for depth, key in enumerate(leaf.groups):
                self._sizes[depth][key] += size

    def _shape(self, node: FleetNode) -> Shape:
        used = self._used.get(node.handle)
        if used is None:
            return (
                node.gpu_type,
                node.bandwidth_tier,
                node.gpus,
                node.cpu_cores,
                node.memory_gb,
                True,
            )
        if used[4]:  # held whole: nothing else may join
            return (node.gpu_type, node.bandwidth_tier, -1, -1, -1, False)
        return (
            node.gpu_type,
            node.bandwidth_tier,
            node.gpus - used[0],
            node.cpu_cores - used[1],
            node.memory_gb - used[2],
            used[3] == 0,
        )

    def _take(self, req: JobRequest, placement: Sequence[str], sign: int = 1) -> None:
        for handle in placement:
            if handle not in self.nodes:
                continue
            used = self._used.setdefault(handle, [0, 0, 0, 0, 0])
            used[0] += sign * req.gpus_per_node
            used[1] += sign * req.cpu
            used[2] += sign * req.memory_gb
            used[3] += sign
            used[4] += sign * req.exclusive
            if used[3] <= 0:
                del self._used[handle]
            leaf = self._leaf_of[handle]
            _count(leaf.tenants, req.tenant, sign)
            if req.sensitive:
                _count(leaf.sensitive, req.tenant, sign)

    def _change(self, req: JobRequest, placement: Sequence[str], sign: int) -> None:
        """Apply (``sign`` 1) or undo (-1) a job's hold, moving nodes between pools."""
        for handle in placement:
            node = self.nodes.get(handle)
            if node is None or not node.schedulable:
                continue
            shapes = self._leaf_of[handle].shapes
            old = self._shape(node)
            shapes[old].remove(handle)
            if not shapes[old]:
                del shapes[old]
        self._take(req, placement, sign)
        for handle in placement:
            node = self.nodes.get(handle)
            if node is not None and node.schedulable:
                bisect.insort(
                    self._leaf_of[handle].shapes.setdefault(self._shape(node), []), handle
                )

    def commit(self, req: JobRequest, placement: Sequence[str]) -> None:
        """Record that ``req`` now holds ``placement`` (updates the pools)."""
        self._change(req, placement, 1)

    def release(self, req: JobRequest, placement: Sequence[str]) -> None:
        """Undo :meth:`commit` (or a running job given at build time): ``req`` is gone."""
        self._change(req, placement, -1)

    def free(self, handle: str) -> tuple[int, int, int]:
        """Free (gpus, cpu cores, memory GB) of a node, as the index sees it."""
        shape = self._shape(self.nodes[handle])
        return shape[2], shape[3], shape[4]

    def group_size(self, depth: int, key: tuple[str, ...]) -> int:
        """How many schedulable nodes the group of ``LEVELS[depth]`` has, busy or not."""
        return self._sizes[depth].get(key, 0)

    def group_of(self, handle: str, depth: int) -> tuple[str, ...] | None:
        """The key of the node's group at ``LEVELS[depth]`` (None: not in the fleet)."""
        leaf = self._leaf_of.get(handle)
        return None if leaf is None else leaf.groups[depth]

    def eligible(
        self, req: JobRequest, within: tuple[int, tuple[str, ...]] | None = None
    ) -> list[tuple[_Leaf, int, list[tuple[Shape, list[str]]]]]:
        """Per leaf (in order), how many nodes one member of ``req`` could go on, and
        their pools; ``within``: only the leaves of that (depth, group key)."""
        regions = set(req.allowed_regions)
        exclude = req.exclude
        fit_cache: dict[Shape, bool] = {}
        out: list[tuple[_Leaf, int, list[tuple[Shape, list[str]]]]] = []
        leaves = self._leaf_list if within is None else self._groups[within[0]].get(within[1], [])
        for leaf in leaves:
            if not leaf.shapes or (regions and leaf.node.region not in regions):
                continue
            if (leaf.tenants or leaf.sensitive) and not _leaf_allows(leaf, req):
                continue
            pools = []
            count = 0
            for shape, handles in leaf.shapes.items():
                ok = fit_cache.get(shape)
                if ok is None:
                    ok = fit_cache[shape] = _fits(shape, req)
                if ok:
                    if exclude:
                        handles = [h for h in handles if h not in exclude]
                    if handles:
                        pools.append((shape, handles))
                        count += len(handles)
            if count:
                out.append((leaf, count, pools))
        return out

    def place(
        self, req: JobRequest, within: tuple[int, tuple[str, ...]] | None = None
    ) -> Placement | None:
        """The tightest, best-fitting placement of the whole gang, or None; ``within``:
        only inside that (depth, group key)."""
        if req.nodes < 1:
            return None
        pools = self.eligible(req, within)
        widest = LEVELS.index(req.max_spread)
        if within is not None:
            widest = min(widest, within[0])
        for depth, level in enumerate(LEVELS[: widest + 1]):
            counts: dict[tuple[str, ...], int] = defaultdict(int)
            for leaf, count, _ in pools:
                counts[leaf.groups[depth]] += count
            fitting = [(n, g) for g, n in counts.items() if n >= req.nodes]
            if not fitting:
                continue
            fewest, group = min(fitting)
            warm: set[str] = set()
            if req.dataset and req.dataset in self._warm:
                group, warm = self._warmest(req, pools, depth, fitting, fewest)
            inside = [p for leaf, _, p in pools if leaf.groups[depth] == group]
            return Placement(req.job_id, _best_fit(req, inside, warm), level, group)
        return None

    def _warmest(
        self,
        req: JobRequest,
        pools: list[tuple[_Leaf, int, list[tuple[Shape, list[str]]]]],
        depth: int,
        fitting: list[tuple[int, tuple[str, ...]]],
        fewest: int,
    ) -> tuple[tuple[str, ...], set[str]]:
        """The dataset tie-breaker: among the best-fitting groups (``fewest`` eligible
        nodes) the one with the most eligible nodes where ``req.dataset`` is warm (ties:
        by name), and the nodes to prefer inside it (a superset of its warm eligible
        ones: :func:`_best_fit` walks only eligible nodes).  Only when groups tie does it
        count, walking the dataset's warm nodes (not the fleet)."""
        warm = self._warm[req.dataset]
        tied = {g for n, g in fitting if n == fewest}
        if len(tied) == 1:
            return next(iter(tied)), warm
        fits: dict[tuple[str, ...], set[Shape]] = {
            leaf.key: {shape for shape, _ in p}
            for leaf, _, p in pools
            if leaf.groups[depth] in tied
        }
        count: Counter[tuple[str, ...]] = Counter()
        for handle in warm:
            leaf = self._leaf_of[handle]
            shapes = fits.get(leaf.key)
            if shapes and handle not in req.exclude and self._shape(self.nodes[handle]) in shapes:
                count[leaf.groups[depth]] += 1
        _, group = min((-count[g], g) for g in tied)
        return group, warm


def _best_fit(
    req: JobRequest, leaves: list[list[tuple[Shape, list[str]]]], warm: set[str] | None = None
) -> tuple[str, ...]:
    """``req.nodes`` nodes of a group: those in ``warm`` first (the job's dataset is cached
    there), each part least capacity left over first, leaf by leaf."""
    ranked: list[tuple[tuple[int, int, int], int, list[str]]] = []
    for order, pools in enumerate(leaves):
        for shape, handles in pools:
            left = (shape[2] - req.gpus_per_node, shape[3] - req.cpu, shape[4] - req.memory_gb)
            ranked.append((left, order, handles))
    ranked.sort(key=lambda r: (r[0], r[1], r[2][0]))
    chosen: list[str] = []
    if warm:
        for _, _, handles in ranked:
            chosen.extend(h for h in handles if h in warm)
            if len(chosen) >= req.nodes:
                return tuple(chosen[: req.nodes])
    taken = set(chosen)
    for _, _, handles in ranked:
        for handle in handles:
            if handle in taken:
                continue
            chosen.append(handle)
            if len(chosen) == req.nodes:
                return tuple(chosen)
    raise AssertionError("group counted more eligible nodes than it holds")


# --- functions over plain inputs ---------------------------------------------------


def place(
    req: JobRequest, nodes: Iterable[FleetNode], running: Iterable[RunningJob] = ()
) -> Placement | None:
    """Place one gang on ``nodes`` given the ``running`` jobs; None when it cannot fit."""
    return FleetIndex(nodes, running).place(req)


def plan_preemption(
    req: JobRequest,
    nodes: Sequence[FleetNode],
    running: Sequence[RunningJob],
    budget: int = PREEMPTION_SEARCH_BUDGET,
) -> Preemption | None:
    """The fewest preemptible lower-priority jobs whose removal lets ``req`` fit.

    Exact (smallest count; ties: lowest priorities, then fewest nodes) while at most
    ``budget`` victim sets are tried (fewer on big fleets: ``PREEMPTION_SEARCH_WORK``);
    beyond that a greedy set.  None when the job fits without preemption or not even with
    every candidate removed.
    """
    index = FleetIndex(nodes, running)
    if index.place(req) is not None:
        return None
    return _plan_on(index, req, running, budget)


def _plan_on(
    index: FleetIndex, req: JobRequest, running: Iterable[RunningJob], budget: int
) -> Preemption | None:
    """``plan_preemption`` on an index that holds ``running`` (left as it was)."""
    candidates = sorted(
        (j for j in running if j.request.preemptible and j.request.priority < req.priority),
        key=lambda j: (j.request.priority, len(j.placement), j.request.job_id),
    )
    if not candidates or _place_without(index, req, candidates) is None:
        return None
    budget = min(budget, max(1, PREEMPTION_SEARCH_WORK // max(1, len(index.nodes))))
    tried = 0
    for k in range(1, len(candidates) + 1):
        best: tuple[tuple[int, int], tuple[RunningJob, ...], Placement] | None = None
        for combo in itertools.combinations(candidates, k):
            tried += 1
            if tried > budget:
                return _greedy_preemption(index, req, candidates)
            placed = _place_without(index, req, combo)
            if placed is None:
                continue
            cost = (sum(j.request.priority for j in combo), sum(len(j.placement) for j in combo))
            if best is None or cost < best[0]:
                best = (cost, combo, placed)
        if best is not None:
            return Preemption(req.job_id, tuple(j.request.job_id for j in best[1]), best[2])
    return None  # pragma: no cover - the full set fits (checked above)


def _place_without(
    index: FleetIndex,
    req: JobRequest,
    gone: Sequence[RunningJob],
    within: tuple[int, tuple[str, ...]] | None = None,
) -> Placement | None:
    """Where ``req`` would go if ``gone`` stopped (the index is left as it was)."""
    for job in gone:
        index.release(job.request, job.placement)
    try:
        return index.place(req, within)
    finally:
        for job in gone:
            index.commit(job.request, job.placement)


def _greedy_preemption(
    index: FleetIndex, req: JobRequest, candidates: Sequence[RunningJob]
) -> Preemption | None:
    """Large cases.  At each level up to ``max_spread``, in the ``GREEDY_GROUPS`` groups
    nearest to fitting (and big enough), the shortest prefix (lowest priority first, by
    bisection) of the candidates touching the group that lets the job fit in it; the
    fewest victims win (ties: the tighter level).  Then up to ``GREEDY_DROP_TRIES`` of
    them are spared again when the job still fits anywhere without them."""
    widest = LEVELS.index(req.max_spread)
    have: list[dict[tuple[str, ...], int]] = [defaultdict(int) for _ in LEVELS]
    for leaf, count, _ in index.eligible(req):
        for depth, key in enumerate(leaf.groups):
            have[depth][key] += count
    best: tuple[int, int, list[RunningJob]] | None = None
    for depth in range(widest + 1):
        touching: dict[tuple[str, ...], list[RunningJob]] = defaultdict(list)
        for job in candidates:
            keys = {k for h in job.placement if (k := index.group_of(h, depth)) is not None}
            for key in keys:
                touching[key].append(job)
        tried = 0
        for key in sorted(touching, key=lambda k: (req.nodes - have[depth][k], k)):
            if tried == GREEDY_GROUPS:
                break
            if index.group_size(depth, key) < req.nodes:
                continue
            jobs = touching[key]
            if _place_without(index, req, jobs, (depth, key)) is None:
                continue
            tried += 1
            chosen = _shortest_prefix(index, req, jobs, (depth, key))
            if best is None or (len(chosen), depth) < best[:2]:
                best = (len(chosen), depth, chosen)
    if best is None:  # pragma: no cover - the caller checked that all candidates do
        return None
    chosen = best[2]
    for job in list(reversed(chosen))[:GREEDY_DROP_TRIES]:  # the last one too (it may be
        # needed only for the group it was picked in, not for a fit elsewhere)
        trial = [j for j in chosen if j is not job]
        if _place_without(index, req, trial) is not None:
            chosen = trial
    placed = _place_without(index, req, chosen)
    assert placed is not None  # it fits inside the group, so somewhere
    return Preemption(req.job_id, tuple(j.request.job_id for j in chosen), placed)


def _shortest_prefix(
    index: FleetIndex,
    req: JobRequest,
    jobs: Sequence[RunningJob],
    within: tuple[int, tuple[str, ...]],
) -> list[RunningJob]:
    """The shortest prefix of ``jobs`` whose removal lets ``req`` fit ``within`` (all of
    them do)."""
    lo, hi = 1, len(jobs)
    while lo < hi:
        mid = (lo + hi) // 2
        if _place_without(index, req, jobs[:mid], within) is None:
            lo = mid + 1
        else:
            hi = mid
    return list(jobs[:lo])


def queue_order(queue: Iterable[JobRequest]) -> list[JobRequest]:
    """Priority order: highest priority first, then the oldest, then by id."""
    return sorted(queue, key=lambda r: (-r.priority, r.submitted_ts, r.job_id))


def schedule_queue(
    queue: Iterable[JobRequest],
    nodes: Sequence[FleetNode],
    running: Sequence[RunningJob] = (),
    *,
    preempt: bool = True,
    backfill: bool = True,
) -> QueuePass:
    """One pass over the queue: place, preempt, or block each job, in priority order.

    A job that cannot fit may preempt (``plan_preemption``); the victims' nodes are then
    reserved for it and the job stays queued until they are stopped.  A job that can
    neither fit nor preempt reserves the nodes it would get on the fleet emptied of
    running jobs; with ``backfill`` lower-priority jobs still start on other nodes, so a
    big job does not leave the fleet idle, and it is not starved by smaller ones.  A job
    that cannot fit even on the emptied fleet reserves nothing and blocks nobody.
    """
    index = FleetIndex(nodes, running)
    empty: FleetIndex | None = None
    reserved: set[str] = set()
    placements: list[Placement] = []
    preemptions: list[Preemption] = []
    blocked: list[Blocked] = []
    stopped: set[str] = set()
    ordered = queue_order(queue)
    for req in ordered:
        trial = replace(req, exclude=req.exclude | reserved) if reserved else req
        placed = index.place(trial)
        if placed is not None:
            index.commit(req, placed.nodes)
            placements.append(placed)
            continue
        if preempt:
            # jobs placed or promised earlier in this pass rank at least as high: only the
            # running jobs not already stopped can be victims
            live = [j for j in running if j.request.job_id not in stopped]
            plan = _plan_on(index, trial, live, PREEMPTION_SEARCH_BUDGET)
            if plan is not None:
                preemptions.append(plan)
                stopped.update(plan.victims)
                reserved.update(plan.placement.nodes)
                # the victims' nodes are promised to this job: nobody else takes them, and
                # later jobs see its tenant on those leaves
                index.commit(req, plan.placement.nodes)
                continue
        if empty is None:
            empty = FleetIndex(nodes)
        ideal = empty.place(req)
        if ideal is None:
            blocked.append(Blocked(req.job_id, "does not fit the fleet even when it is empty"))
            continue
        reserved.update(ideal.nodes)
        blocked.append(Blocked(req.job_id, "waiting for capacity", ideal.nodes))
        if not backfill:
            rest = ordered[ordered.index(req) + 1 :]
            blocked.extend(Blocked(r.job_id, f"behind {req.job_id} (no backfill)") for r in rest)
            break
    return QueuePass(tuple(placements), tuple(preemptions), tuple(blocked))
