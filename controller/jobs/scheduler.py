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
  joins a leaf where another tenant's sensitive job runs; a sensitive job goes only on
  nodes whose DMA isolation posture is ``isolated`` (docs/security.md);
- a job naming a ``dataset``: among the groups of the chosen level that are equally
  good (as many eligible nodes), the one with the most nodes where the dataset is warm;
  inside the group, warm nodes before the others.  Only a tie-breaker: it never changes
  the level, nor which nodes are eligible;
- preemption: the fewest running jobs of lower priority that are preemptible whose
  removal lets the job fit (ties: lowest priorities, then fewest nodes disturbed).

For speed (a 1,024-node gang on 100,000 nodes) ``FleetIndex`` groups the schedulable
nodes by leaf and, inside a leaf, by their free-capacity shape; a placement walks
leaves and shapes, not nodes, and only the chosen group's nodes are listed.

Kept indexes (the fleet twin, docs/scheduler.md): instead of building an index per pass,
a caller may keep one and change it as the fleet changes: ``commit`` / ``release`` when
a job starts or stops, ``update_node`` when a node's grade, cordon or warm datasets
change; ``schedule_on(index, queue, running, empty=...)`` is ``schedule_queue`` on it
(``schedule_queue`` is that on a fresh index): the pass's placements stay committed, its
preemptions' promised nodes are released again.  The index answers exactly as one built
from scratch; it only skips work it can prove useless: a request for more nodes than
fit a member anywhere (per-region counts of node shapes), one that failed before with
nothing released since (commits only take capacity away), leaves without a fitting
shape (a shape -> leaves map), and the preemption planner's trials move from one victim
set to the next by the difference, skip victim sets that could not free enough nodes and
search prefixes by doubling from that bound.
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, TypeVar

from metalguard.controller.core.grades import takes_new_work
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
    """Cordoned by an operator or held as a repeat offender."""
    rail_flagged: bool = False
    """Kept in service by the safety rail instead of isolated: runs its jobs, takes none."""
    warm_datasets: frozenset[str] = frozenset()
    """The datasets whose node-local cache is warm here (``controller.core.warm``)."""
    dma_posture: str = ""
    """Its DMA isolation posture (``proto.iommu``; "" not reported): a sensitive job
    goes only where it is ``isolated`` (docs/security.md "DMA isolation")."""

    @property
    def dma_isolated(self) -> bool:
        """Whether a sensitive tenant's devices may be passed through here."""
        return self.dma_posture == "isolated"

    @property
    def schedulable(self) -> bool:
        """May receive new members (``controller.core.grades``: HEALTHY, not cordoned,
        held or rail-flagged)."""
        return takes_new_work(
            self.grade, cordoned=self.cordoned, held=False, rail_flagged=self.rail_flagged
        )

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
    started_ts: float = 0.0
    """When it started (its current run): tenant reclaim takes the most recently started
    first among equal priorities (``controller.jobs.quota``); the rest ignores it."""


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
    cause: Literal["priority", "reclaim"] = "priority"
    """``priority``: the victims rank lower (this module); ``reclaim``: other tenants'
    work on borrowed capacity, taken back for a tenant inside its guarantee
    (``controller.jobs.quota``, docs/scheduler.md "Tenant quotas")."""


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

Shape = tuple[str, int, int, int, int, bool, bool]
"""(gpu_type, bandwidth_tier, free gpus, free cpu, free memory, idle, DMA-isolated)."""
_K = TypeVar("_K")

Kind = tuple[str, int, int, int, int, str, bool, frozenset[str], bool]
"""What a request's fit depends on besides its size, spread and exclusions: (gpu_type,
bandwidth tier, gpus, cpu, memory, tenant, sensitive where tenants count, allowed
regions, sensitive: only DMA-isolated nodes)."""
_ALL_REGIONS: frozenset[str] = frozenset()


def _kind(req: JobRequest, tenants: bool = True) -> Kind:
    """The request's :data:`Kind`; without ``tenants`` (an index that holds no job: no
    leaf has a tenant to mind) the tenant and the sensitive flag play no part."""
    regions = frozenset(req.allowed_regions) if req.allowed_regions else _ALL_REGIONS
    return (
        req.gpu_type,
        req.bandwidth_tier,
        req.gpus_per_node,
        req.cpu,
        req.memory_gb,
        req.tenant if tenants else "",
        req.sensitive and tenants,
        regions,
        req.sensitive,
    )


Pools = list[tuple["_Leaf", int, list[tuple[Shape, list[str]]]]]
"""What ``FleetIndex.eligible`` returns: per leaf, its eligible count and pools."""


@dataclass(slots=True)
class _Found:
    """One walk's eligible pools, and (lazily) their counts per group of a level and the
    pools inside a group: every size and spread of the same kind placed from them while
    the index does not change."""

    pools: Pools
    counts: dict[int, dict[tuple[str, ...], int]] = field(default_factory=dict)
    inside: dict[tuple[int, tuple[str, ...]], list[list[tuple[Shape, list[str]]]]] = field(
        default_factory=dict
    )

    def fitting(self, depth: int, nodes: int) -> list[tuple[int, tuple[str, ...]]]:
        """The groups of ``LEVELS[depth]`` with at least ``nodes`` eligible nodes, as
        (count, key)."""
        counts = self.counts.get(depth)
        if counts is None:
            counts = self.counts[depth] = defaultdict(int)
            for leaf, count, _ in self.pools:
                counts[leaf.groups[depth]] += count
        return [(n, g) for g, n in counts.items() if n >= nodes]

    def pools_in(self, depth: int, group: tuple[str, ...]) -> list[list[tuple[Shape, list[str]]]]:
        """The pools of the eligible leaves of one group, in leaf order."""
        key = (depth, group)
        inside = self.inside.get(key)
        if inside is None:
            inside = self.inside[key] = [
                p for leaf, _, p in self.pools if leaf.groups[depth] == group
            ]
        return inside


@dataclass(slots=True)
class _Memo:
    """What an index remembers between changes (docs/scheduler.md "Kept indexes").

    ``failed``: per request kind, the (exclude, nodes, widest level) of placements that
    found nothing; still true after commits (they only take capacity away, and more
    tenants on a leaf only forbid more), forgotten when anything is released or a node
    comes back.  ``placed`` (exact answers) and ``found`` (the eligible pools of a kind:
    an unchanged index, such as the empty one of a pass, places every size and spread of
    it from one walk) are forgotten at any change.  ``epoch`` names the state ``failed``
    holds for (a pass's own memo compares it)."""

    epoch: int = 0
    failed: dict[Kind, list[tuple[frozenset[str], int, int]]] = field(default_factory=dict)
    placed: dict[tuple[object, ...], Placement | None] = field(default_factory=dict)
    found: dict[tuple[Kind, frozenset[str]], _Found] = field(default_factory=dict)
    """Per (kind, exclude), the eligible pools and what was counted from them."""

    def failed_before(self, kind: Kind, exclude: frozenset[str], nodes: int, widest: int) -> bool:
        """A request of ``kind`` that needed no more nodes, no wider level and excluded
        no more nodes found nothing (so this one finds nothing either)."""
        for seen, size, wide in self.failed.get(kind, ()):
            if size <= nodes and wide >= widest and (seen is exclude or seen <= exclude):
                return True
        return False


@dataclass(slots=True)
class _Leaf:
    key: tuple[str, ...]
    node: FleetNode
    """A representative node (for the group keys)."""
    groups: tuple[tuple[str, ...], ...] = ()
    """The keys of its rack, cluster, zone and region (``LEVELS`` order)."""
    pos: int = 0
    """Its place in the index's leaf order."""
    shapes: dict[Shape, list[str]] = field(default_factory=dict)
    tenants: Counter[str] = field(default_factory=Counter)
    sensitive: Counter[str] = field(default_factory=Counter)


def _count(counter: Counter[_K], key: _K, sign: int) -> None:
    """Add ``sign`` to ``counter[key]``; a key at zero is removed (so ``len`` counts the
    tenants present)."""
    counter[key] += sign
    if counter[key] <= 0:
        del counter[key]


def _fits(shape: Shape, req: JobRequest) -> bool:
    gpu_type, tier, gpus, cpu, mem, idle, isolated = shape
    if req.gpu_type and gpu_type != req.gpu_type:
        return False
    if req.sensitive and not isolated:
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

    Built once per pass (O(nodes)), or kept across passes and changed in place
    (``commit`` / ``release`` / ``update_node``, each O(the nodes touched)); ``place``
    reads it, ``commit`` applies a placement so that the next job of the pass sees the
    capacity it took.  What it remembers between changes (``_Memo``) never changes an
    answer.
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
        for pos, leaf in enumerate(self._leaf_list):
            leaf.pos = pos
        self._warm: dict[str, set[str]] = {}
        """dataset -> the schedulable nodes where it is warm."""
        self._groups: list[dict[tuple[str, ...], list[_Leaf]]] = [{} for _ in LEVELS]
        for leaf in self._leaf_list:
            for depth, key in enumerate(leaf.groups):
                self._groups[depth].setdefault(key, []).append(leaf)
        for job in running:
            self._take(job.request, job.placement)
        self._free: dict[str, dict[Shape, int]] = {}
        """region -> how many schedulable nodes have each shape (the early exit)."""
        self._where: dict[Shape, set[int]] = {}
        """shape -> the leaves (``pos``) with a schedulable node of that shape."""
        for _, handle, node in keyed:  # sorted, so every pool is in handle order
            if node.schedulable:
                self._leaf_of[handle].shapes.setdefault(self._shape(node), []).append(handle)
                for name in node.warm_datasets:
                    self._warm.setdefault(name, set()).add(handle)
        self._sizes: list[dict[tuple[str, ...], int]] = [defaultdict(int) for _ in LEVELS]
        for leaf in self._leaf_list:
            size = 0
            if leaf.shapes:
                free = self._free.setdefault(leaf.node.region, {})
                for shape, handles in leaf.shapes.items():
                    size += len(handles)
                    self._where.setdefault(shape, set()).add(leaf.pos)
                    free[shape] = free.get(shape, 0) + len(handles)
            for depth, key in enumerate(leaf.groups):
                self._sizes[depth][key] += size
        self._memo = _Memo()
        self._epochs = itertools.count(1)

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
                node.dma_isolated,
            )
        if used[4]:  # held whole: nothing else may join
            return (node.gpu_type, node.bandwidth_tier, -1, -1, -1, False, node.dma_isolated)
        return (
            node.gpu_type,
            node.bandwidth_tier,
            node.gpus - used[0],
            node.cpu_cores - used[1],
            node.memory_gb - used[2],
            used[3] == 0,
            node.dma_isolated,
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
        nodes, used_of, leaf_of = self.nodes, self._used, self._leaf_of
        gpus, cpu, memory = sign * req.gpus_per_node, sign * req.cpu, sign * req.memory_gb
        whole, tenant, sensitive = sign * req.exclusive, req.tenant, req.sensitive
        for handle in placement:
            node = nodes.get(handle)
            if node is None:
                continue
            leaf = leaf_of[handle]
            pooled = node.schedulable
            old = self._shape(node) if pooled else None
            used = used_of.get(handle)
            if used is None:
                used = used_of[handle] = [0, 0, 0, 0, 0]
            used[0] += gpus
            used[1] += cpu
            used[2] += memory
            used[3] += sign
            used[4] += whole
            if used[3] <= 0:
                del used_of[handle]
            tenants = leaf.tenants  # _count, inlined: this is the hot path
            tenants[tenant] += sign
            if tenants[tenant] <= 0:
                del tenants[tenant]
            if sensitive:
                _count(leaf.sensitive, tenant, sign)
            if old is not None:
                new = self._shape(node)
                if new != old:
                    self._move(leaf, node.region, old, new, handle)
        self._changed(grown=sign < 0)

    def _move(self, leaf: _Leaf, region: str, old: Shape, new: Shape, handle: str) -> None:
        """:meth:`_leave` ``old`` then :meth:`_enter` ``new``, in one call."""
        shapes, where = leaf.shapes, self._where
        gone = shapes[old]
        gone.remove(handle)
        if not gone:
            del shapes[old]
            emptied = where[old]
            emptied.discard(leaf.pos)
            if not emptied:
                del where[old]
        pool = shapes.get(new)
        if pool is None:
            shapes[new] = [handle]
            leaves = where.get(new)
            if leaves is None:
                leaves = where[new] = set()
            leaves.add(leaf.pos)
        else:
            bisect.insort(pool, handle)
        free = self._free[region]
        left = free[old] - 1
        if left:
            free[old] = left
        else:
            del free[old]
        free[new] = free.get(new, 0) + 1

    def _enter(self, leaf: _Leaf, region: str, shape: Shape, handle: str) -> None:
        """Put a schedulable node into the pool of ``shape`` (kept in handle order) and the
        counters."""
        pool = leaf.shapes.get(shape)
        if pool is None:
            leaf.shapes[shape] = [handle]
            where = self._where.get(shape)
            if where is None:
                where = self._where[shape] = set()
            where.add(leaf.pos)
        else:
            bisect.insort(pool, handle)
        counts = self._free.get(region)
        if counts is None:
            counts = self._free[region] = {}
        counts[shape] = counts.get(shape, 0) + 1

    def _leave(self, leaf: _Leaf, region: str, shape: Shape, handle: str) -> None:
        """Undo :meth:`_enter`."""
        pool = leaf.shapes[shape]
        pool.remove(handle)
        if not pool:
            del leaf.shapes[shape]
            where = self._where[shape]
            where.discard(leaf.pos)
            if not where:
                del self._where[shape]
        free = self._free[region]
        left = free[shape] - 1
        if left:
            free[shape] = left
        else:
            del free[shape]

    def _changed(self, grown: bool) -> None:
        """Forget the memoised placements; with ``grown`` (capacity may have come free)
        the remembered failures too, and start a new epoch."""
        if grown:
            self._memo = _Memo(epoch=next(self._epochs))
            return
        if self._memo.placed:
            self._memo.placed = {}
        if self._memo.found:
            self._memo.found = {}

    def update_node(self, node: FleetNode) -> None:
        """Replace one node's record (grade, cordon, warm datasets; its handle and leaf stay
        the same) in place: into or out of its leaf's pools, the group sizes and the warm
        sets follow.  O(the node's leaf).  The jobs committed on it stay counted."""
        old = self.nodes.get(node.handle)
        if old is None:
            raise ValueError(f"update_node: {node.handle!r} is not in the index")
        if old.leaf_key != node.leaf_key:
            raise ValueError(
                f"update_node: {node.handle!r} moves from leaf {old.leaf_key} to {node.leaf_key}"
            )
        leaf = self._leaf_of[node.handle]
        if old.schedulable:
            self._unpool(leaf, old)
        self.nodes[node.handle] = node
        if leaf.node.handle == node.handle:
            leaf.node = node
        if node.schedulable:
            self._pool(leaf, node)
        # a node that goes out, or stays with its capacity, frees nothing for anyone
        same = old.schedulable and self._shape(old) == self._shape(node)
        self._changed(grown=node.schedulable and not same)

    def _unpool(self, leaf: _Leaf, node: FleetNode) -> None:
        """Take a schedulable node out of its pool, its groups' sizes and the warm sets."""
        self._leave(leaf, node.region, self._shape(node), node.handle)
        for name in node.warm_datasets:
            warm = self._warm[name]
            warm.discard(node.handle)
            if not warm:
                del self._warm[name]
        for depth, key in enumerate(leaf.groups):
            self._sizes[depth][key] -= 1

    def _pool(self, leaf: _Leaf, node: FleetNode) -> None:
        """Undo :meth:`_unpool` (with the node's new record)."""
        self._enter(leaf, node.region, self._shape(node), node.handle)
        for name in node.warm_datasets:
            self._warm.setdefault(name, set()).add(node.handle)
        for depth, key in enumerate(leaf.groups):
            self._sizes[depth][key] += 1

    def commit(self, req: JobRequest, placement: Sequence[str]) -> None:
        """Record that ``req`` now holds ``placement`` (updates the pools)."""
        self._change(req, placement, 1)

    def release(self, req: JobRequest, placement: Sequence[str]) -> None:
        """Undo :meth:`commit` (or a running job given at build time): ``req`` is gone."""
        self._change(req, placement, -1)

    def forget(self) -> None:
        """Drop what the index remembers (failed and answered requests): the next
        ``place`` walks the leaves again.  Results never depend on it (for benchmarks)."""
        self._memo = _Memo(epoch=next(self._epochs))

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
        their pools; ``within``: only the leaves of that (depth, group key).

        When few leaves hold a node of a fitting shape (a full fleet), only those are
        visited, in the same order."""
        regions = set(req.allowed_regions)
        exclude = req.exclude
        fit_cache: dict[Shape, bool] = {}
        out: list[tuple[_Leaf, int, list[tuple[Shape, list[str]]]]] = []
        leaves = self._leaf_list if within is None else self._groups[within[0]].get(within[1], [])
        if within is None:
            fit_cache = {shape: _fits(shape, req) for shape in self._where}
            hits = [self._where[shape] for shape, ok in fit_cache.items() if ok]
            if sum(map(len, hits)) * 2 < len(leaves):
                leaves = [self._leaf_list[pos] for pos in sorted(set().union(*hits))]
        for leaf in leaves:
            if not leaf.shapes or (regions and leaf.node.region not in regions):
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
            # the tenant rule last: on a full fleet most leaves have no fitting node
            if count and (not (leaf.tenants or leaf.sensitive) or _leaf_allows(leaf, req)):
                out.append((leaf, count, pools))
        return out

    def could_fit(self, req: JobRequest, extra: int = 0) -> bool:
        """An upper bound, O(regions x shapes): False when no allowed region has
        ``req.nodes`` schedulable nodes whose free capacity takes one member, counting
        ``extra`` more (the nodes of jobs about to be released).  True says nothing."""
        need = req.nodes - extra
        if need <= 0:
            return True
        for region, shapes in self._free.items():
            if req.allowed_regions and region not in req.allowed_regions:
                continue
            have = 0
            for shape, count in shapes.items():
                if _fits(shape, req):
                    have += count
                    if have >= need:
                        return True
        return False

    def fit_count(self, req: JobRequest) -> int:
        """The most schedulable nodes one allowed region has whose free capacity takes one
        member of ``req`` (tenants and exclusions aside): an upper bound on where it can
        go, O(regions x shapes)."""
        best = 0
        for region, shapes in self._free.items():
            if req.allowed_regions and region not in req.allowed_regions:
                continue
            best = max(best, sum(count for shape, count in shapes.items() if _fits(shape, req)))
        return best

    def fit_by_group(self, req: JobRequest) -> list[dict[tuple[str, ...], int]]:
        """Per ``LEVELS`` depth, how many schedulable nodes of each group (in the allowed
        regions) have a free capacity that takes one member of ``req``, tenants and
        exclusions aside: an upper bound on its eligible nodes there."""
        out: list[dict[tuple[str, ...], int]] = [defaultdict(int) for _ in LEVELS]
        fits = {shape for shape in self._where if _fits(shape, req)}
        for pos in sorted(set().union(*(self._where[shape] for shape in fits))):
            leaf = self._leaf_list[pos]
            if req.allowed_regions and leaf.node.region not in req.allowed_regions:
                continue
            count = sum(len(handles) for shape, handles in leaf.shapes.items() if shape in fits)
            for depth, key in enumerate(leaf.groups):
                out[depth][key] += count
        return out

    def place(
        self, req: JobRequest, within: tuple[int, tuple[str, ...]] | None = None
    ) -> Placement | None:
        """The tightest, best-fitting placement of the whole gang, or None; ``within``:
        only inside that (depth, group key).

        Exact early exits (they never change a result): too few fitting nodes in any
        region (:meth:`could_fit`) or in the ``within`` group; a request that already
        failed with no more nodes, no wider spread and no fewer excluded nodes while
        nothing was released since (commits only take capacity away); and, until the next
        change of the index, the same request asked again.
        """
        if req.nodes < 1:
            return None
        if within is not None:
            if self._sizes[within[0]].get(within[1], 0) < req.nodes:
                return None
            return self._place(req, within)
        memo = self._memo
        kind = _kind(req)
        exact = (_kind(req, bool(self._used)), req.nodes, req.max_spread, req.exclude, req.dataset)
        if exact in memo.placed:
            hit = memo.placed[exact]
            return None if hit is None else replace(hit, job_id=req.job_id)
        widest = LEVELS.index(req.max_spread)
        if memo.failed_before(kind, req.exclude, req.nodes, widest) or not self.could_fit(req):
            placed = None
        else:
            placed = self._place(req, None)
            if placed is None:
                memo.failed.setdefault(kind, []).append((req.exclude, req.nodes, widest))
        memo.placed[exact] = placed
        return placed

    def _place(
        self, req: JobRequest, within: tuple[int, tuple[str, ...]] | None
    ) -> Placement | None:
        """:meth:`place` without its early exits: the walk over the leaves."""
        if within is None:
            key = (_kind(req, tenants=bool(self._used)), req.exclude)
            found = self._memo.found.get(key)
            if found is None:
                found = self._memo.found[key] = _Found(self.eligible(req))
        else:
            found = _Found(self.eligible(req, within))
        widest = LEVELS.index(req.max_spread)
        if within is not None:
            widest = min(widest, within[0])
        for depth, level in enumerate(LEVELS[: widest + 1]):
            fitting = found.fitting(depth, req.nodes)
            if not fitting:
                continue
            fewest, group = min(fitting)
            warm: set[str] = set()
            if req.dataset and req.dataset in self._warm:
                group, warm = self._warmest(req, found.pools, depth, fitting, fewest)
            inside = found.pools_in(depth, group)
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


def plan_among(
    index: FleetIndex,
    req: JobRequest,
    candidates: Iterable[RunningJob],
    budget: int = PREEMPTION_SEARCH_BUDGET,
) -> Preemption | None:
    """:func:`plan_preemption` on an index that holds the running jobs (left as it was),
    choosing only among ``candidates`` (some of them; the preemptible, lower-priority ones
    are kept), for a ``req`` that does not fit as it is.  For callers that narrow the
    candidates (tenant quotas: a tenant's own jobs)."""
    return _plan_on(index, req, candidates, budget)


def _plan_on(
    index: FleetIndex, req: JobRequest, running: Iterable[RunningJob], budget: int
) -> Preemption | None:
    """``plan_preemption`` on an index that holds ``running`` (left as it was)."""
    candidates = sorted(
        (j for j in running if j.request.preemptible and j.request.priority < req.priority),
        key=_victim_order,
    )
    return _plan_among(index, req, candidates, budget)


def _victim_order(job: RunningJob) -> tuple[int, int, str]:
    """Candidates are tried lowest priority first, then the smallest, then by id."""
    return (job.request.priority, len(job.placement), job.request.job_id)


def _plan_among(
    index: FleetIndex,
    req: JobRequest,
    candidates: Sequence[RunningJob],
    budget: int,
    groups: dict[int, JobGroups] | None = None,
) -> Preemption | None:
    """:func:`_plan_on` given its candidates (in :func:`_victim_order`); ``groups``: a
    cache of :func:`_groups_of` kept across the plans of a pass."""
    if not candidates:
        return None
    trials = _Without(index)
    try:
        # does it fit with every candidate gone?  No when even all their nodes could not
        # make room; else yes as soon as a prefix does (it fits only more with more gone):
        # the shortest that might, four times as many, ... all (less to release than all
        # at once when a few suffice, a few more walks when most are needed)
        length = _least_prefix(
            req.nodes - index.fit_count(req), (len(j.placement) for j in candidates)
        )
        while length is not None:
            if trials.place(req, candidates[:length]) is not None:
                break
            length = None if length == len(candidates) else min(4 * length, len(candidates))
        if length is None:
            return None
        budget = min(budget, max(1, PREEMPTION_SEARCH_WORK // max(1, len(index.nodes))))
        tried = 0
        for k in range(1, len(candidates) + 1):
            best: tuple[tuple[int, int], tuple[RunningJob, ...], Placement] | None = None
            for combo in itertools.combinations(candidates, k):
                tried += 1
                if tried > budget:
                    return _greedy_preemption(trials, req, candidates, groups)
                placed = trials.place(req, combo)
                if placed is None:
                    continue
                cost = (
                    sum(j.request.priority for j in combo),
                    sum(len(j.placement) for j in combo),
                )
                if best is None or cost < best[0]:
                    best = (cost, combo, placed)
            if best is not None:
                return Preemption(req.job_id, tuple(j.request.job_id for j in best[1]), best[2])
        return None  # pragma: no cover - the full set fits (checked above)
    finally:
        trials.restore()


class _Without:
    """The preemption planner's trials on one index: where a job would go if some running
    jobs stopped.  The jobs are released from the index and committed back again; from
    one trial to the next only those that differ move (the index's state depends only on
    what it holds, not on the order), and :meth:`restore` leaves the index as it was,
    with what it remembered."""

    def __init__(self, index: FleetIndex) -> None:
        self.index = index
        self._memo = index._memo
        self._gone: dict[int, RunningJob] = {}
        self._moved = False
        """Whether any job was released since the last restore."""
        self._base: tuple[JobRequest, int] | None = None
        """A request and its :meth:`FleetIndex.fit_count` with every job in place."""

    def place(
        self,
        req: JobRequest,
        gone: Iterable[RunningJob],
        within: tuple[int, tuple[str, ...]] | None = None,
    ) -> Placement | None:
        """Where ``req`` would go if ``gone`` stopped.  Not tried when even all of the
        nodes that would come free could not make room (:meth:`FleetIndex.could_fit`)."""
        index = self.index
        if req.nodes < 1 or (within is not None and index.group_size(*within) < req.nodes):
            return None
        want = {id(job): job for job in gone}
        coming = [job for key, job in want.items() if key not in self._gone]
        # two upper bounds on the nodes that could take a member once ``gone`` stopped:
        # what fits now plus the nodes still to come free, and what fits with every job
        # in place plus all of ``gone``'s nodes
        if not index.could_fit(req, sum(len(job.placement) for job in coming)):
            return None
        if self._base is None or self._base[0] is not req:
            self._base = None if self._gone else (req, index.fit_count(req))
        if self._base is not None:
            extra = sum(len(job.placement) for job in want.values())
            if self._base[1] + extra < req.nodes:
                return None
        for key in [key for key in self._gone if key not in want]:
            job = self._gone.pop(key)
            index.commit(job.request, job.placement)
        for job in coming:
            index.release(job.request, job.placement)
            self._gone[id(job)] = job
            self._moved = True
        return index.place(req, within)

    def eligible(self, req: JobRequest) -> list[tuple[_Leaf, int, list[tuple[Shape, list[str]]]]]:
        """:meth:`FleetIndex.eligible` with every job back in place."""
        self.restore()
        return self.index.eligible(req)

    def restore(self) -> None:
        """Commit every released job back: the index is as it was, and so is its memo but
        for the eligible pools it kept (they name pool lists that may have been replaced)."""
        if not self._moved:
            return
        for job in self._gone.values():
            self.index.commit(job.request, job.placement)
        self._gone.clear()
        self._memo.found = {}
        self.index._memo = self._memo
        self._moved = False


JobGroups = tuple[dict[tuple[str, ...], int], ...]
"""Per ``LEVELS`` depth, the groups a job's nodes are in and how many of them each."""


def _groups_of(index: FleetIndex, job: RunningJob, cache: dict[int, JobGroups] | None) -> JobGroups:
    """The racks, clusters, zones and regions a job's nodes are in, with how many of its
    nodes each (the topology never changes, so a pass computes it once a job)."""
    got = None if cache is None else cache.get(id(job))
    if got is None:
        counts: list[Counter[tuple[str, ...]]] = [Counter() for _ in LEVELS]
        for handle in job.placement:
            leaf = index._leaf_of.get(handle)
            if leaf is not None:
                for depth, key in enumerate(leaf.groups):
                    counts[depth][key] += 1
        got = tuple(dict(c) for c in counts)
        if cache is not None:
            cache[id(job)] = got
    return got


def _greedy_preemption(
    trials: _Without,
    req: JobRequest,
    candidates: Sequence[RunningJob],
    groups: dict[int, JobGroups] | None = None,
) -> Preemption | None:
    """Large cases.  At each level up to ``max_spread``, in the ``GREEDY_GROUPS`` groups
    nearest to fitting (and big enough), the shortest prefix (lowest priority first,
    :func:`_first_prefix`) of the candidates touching the group that lets the job fit in
    it; the fewest victims win (ties: the tighter level).  Then up to
    ``GREEDY_DROP_TRIES`` of them are spared again when the job still fits anywhere
    without them.  ``groups``: a cache of :func:`_groups_of`."""
    index = trials.index
    if groups is None:
        groups = {}
    widest = LEVELS.index(req.max_spread)
    have: list[dict[tuple[str, ...], int]] = [defaultdict(int) for _ in LEVELS]
    for leaf, count, _ in trials.eligible(req):
        for depth, key in enumerate(leaf.groups):
            have[depth][key] += count
    fit = index.fit_by_group(req)
    best: tuple[int, int, list[RunningJob]] | None = None
    for depth in range(widest + 1):
        touching: dict[tuple[str, ...], list[RunningJob]] = defaultdict(list)
        for job in candidates:
            for key in _groups_of(index, job, groups)[depth]:
                touching[key].append(job)
        tried = 0
        for key in sorted(touching, key=lambda k: (req.nodes - have[depth][k], k)):
            if tried == GREEDY_GROUPS:
                break
            if index.group_size(depth, key) < req.nodes:
                continue
            jobs = touching[key]
            # the nodes that fit a member now, plus those a prefix would free: a bound
            least = _least_prefix(
                req.nodes - fit[depth].get(key, 0),
                (_groups_of(index, j, groups)[depth][key] for j in jobs),
            )
            length = _first_prefix(trials, req, jobs, (depth, key), least)
            if length is None:  # not even all of them make room here
                continue
            tried += 1
            chosen = list(jobs[:length])
            if best is None or (len(chosen), depth) < best[:2]:
                best = (len(chosen), depth, chosen)
    if best is None:  # pragma: no cover - the caller checked that all candidates do
        return None
    chosen = best[2]
    for job in list(reversed(chosen))[:GREEDY_DROP_TRIES]:  # the last one too (it may be
        # needed only for the group it was picked in, not for a fit elsewhere)
        trial = [j for j in chosen if j is not job]
        if trials.place(req, trial) is not None:
            chosen = trial
    placed = trials.place(req, chosen)
    assert placed is not None  # it fits inside the group, so somewhere
    return Preemption(req.job_id, tuple(j.request.job_id for j in chosen), placed)


def _least_prefix(need: int, freed: Iterable[int]) -> int | None:
    """The shortest prefix whose ``freed`` nodes add up to ``need`` (1 when none are
    needed; None when all of them do not)."""
    if need <= 0:
        return 1
    total = 0
    for length, count in enumerate(freed, 1):
        total += count
        if total >= need:
            return length
    return None


def _first_prefix(
    trials: _Without,
    req: JobRequest,
    jobs: Sequence[RunningJob],
    within: tuple[int, tuple[str, ...]] | None = None,
    least: int | None = 1,
) -> int | None:
    """The length of the shortest prefix of ``jobs`` whose removal lets ``req`` fit
    (``within`` that group), None when not even all of them do; no prefix shorter than
    ``least`` does (a bound; None: not even all of them).

    Removing more jobs only frees capacity (and tenants from leaves), so whether it fits
    only turns from no to yes along the prefixes: the answer is found by steps doubling
    from ``least``, then bisecting, and the trials release jobs about in proportion to
    it, not to ``jobs``."""
    if not jobs or least is None or least > len(jobs):
        return None
    known_no, length, step = least - 1, least, 1
    while length < len(jobs) and trials.place(req, jobs[:length], within) is None:
        known_no, length, step = length, length + step, 2 * step
    if length >= len(jobs):
        length = len(jobs)
        if trials.place(req, jobs, within) is None:
            return None
    lo, hi = known_no + 1, length  # fits at hi, not at known_no
    while lo < hi:
        mid = (lo + hi) // 2
        if trials.place(req, jobs[:mid], within) is None:
            lo = mid + 1
        else:
            hi = mid
    return lo


class _Victims:
    """The preemption side of one queue pass: the running jobs that may be preempted, in
    :func:`_victim_order` once, and the requests known to find no plan this pass."""

    def __init__(self, running: Sequence[RunningJob]) -> None:
        self._running = running
        self._pool: list[RunningJob] | None = None
        self._priorities: list[int] = []
        self._groups: dict[int, JobGroups] = {}
        """:func:`_groups_of` each candidate (by ``id``: ``running`` outlives the pass)."""
        self._hopeless: dict[Kind, list[tuple[int, frozenset[str], int, int, int]]] = {}
        """kind -> (epoch, exclude, nodes, widest, priority) of requests that would not
        fit even with every candidate gone."""

    def plan(self, index: FleetIndex, req: JobRequest, stopped: set[str]) -> Preemption | None:
        """``_plan_on(index, req, running minus stopped)``, with an exact shortcut: after
        a request of the same kind found no plan, one that needs no fewer nodes, spreads no
        wider, excludes no fewer nodes and ranks no higher finds none either while nothing
        was released (fewer candidates: ``stopped`` only grows in a pass; no more room)."""
        kind = _kind(req)
        widest = LEVELS.index(req.max_spread)
        epoch = index._memo.epoch
        for seen_epoch, seen, size, wide, priority in self._hopeless.get(kind, ()):
            if (
                seen_epoch == epoch
                and size <= req.nodes
                and wide >= widest
                and priority >= req.priority
                and (seen is req.exclude or seen <= req.exclude)
            ):
                return None
        if self._pool is None:
            self._pool = sorted(
                (j for j in self._running if j.request.preemptible), key=_victim_order
            )
            self._priorities = [j.request.priority for j in self._pool]
        end = bisect.bisect_left(self._priorities, req.priority)
        candidates = [j for j in self._pool[:end] if j.request.job_id not in stopped]
        plan = _plan_among(index, req, candidates, PREEMPTION_SEARCH_BUDGET, self._groups)
        if plan is None:
            entry = (index._memo.epoch, req.exclude, req.nodes, widest, req.priority)
            self._hopeless.setdefault(kind, []).append(entry)
        return plan


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
    return schedule_on(index, queue, running, preempt=preempt, backfill=backfill)


def schedule_on(
    index: FleetIndex,
    queue: Iterable[JobRequest],
    running: Sequence[RunningJob] = (),
    *,
    empty: FleetIndex | None = None,
    preempt: bool = True,
    backfill: bool = True,
) -> QueuePass:
    """:func:`schedule_queue` on a kept index that holds ``running`` (and nothing else):
    the same decisions as ``schedule_queue(queue, index.nodes.values(), running)``.

    The pass's placements stay committed in ``index`` (the caller starts them); each
    preemption's promised placement is released again before returning, so the index
    shows the victims on their nodes until the caller stops (``release``) them.
    ``empty``: a kept index of the same nodes holding no jobs (where a blocked job would go
    on the emptied fleet), built from ``index.nodes`` when needed if None; it is only read.
    Keep both up to date with ``commit`` / ``release`` (job start and stop, the empty one
    never) and ``update_node`` (every change of a node's record, on both).
    """
    reserved: set[str] = set()
    held_back: frozenset[str] = frozenset()
    """``reserved`` as of its last change (each trial's ``exclude``)."""
    placements: list[Placement] = []
    preemptions: list[Preemption] = []
    blocked: list[Blocked] = []
    stopped: set[str] = set()
    promised: list[tuple[JobRequest, tuple[str, ...]]] = []
    victims = _Victims(running) if preempt else None
    ordered = queue_order(queue)
    try:
        for req in ordered:
            if len(held_back) != len(reserved):
                held_back = frozenset(reserved)
            if not reserved:
                trial = req
            elif req.exclude:
                trial = replace(req, exclude=req.exclude | held_back)
            else:
                trial = replace(req, exclude=held_back)
            placed = index.place(trial)
            if placed is not None:
                index.commit(req, placed.nodes)
                placements.append(placed)
                continue
            if victims is not None:
                # jobs placed or promised earlier in this pass rank at least as high: only
                # the running jobs not already stopped can be victims
                plan = victims.plan(index, trial, stopped)
                if plan is not None:
                    preemptions.append(plan)
                    stopped.update(plan.victims)
                    reserved.update(plan.placement.nodes)
                    # the victims' nodes are promised to this job: nobody else takes them,
                    # and later jobs see its tenant on those leaves
                    index.commit(req, plan.placement.nodes)
                    promised.append((req, plan.placement.nodes))
                    continue
            if empty is None:
                empty = FleetIndex(index.nodes.values())
            ideal = empty.place(req)
            if ideal is None:
                blocked.append(Blocked(req.job_id, "does not fit the fleet even when it is empty"))
                continue
            reserved.update(ideal.nodes)
            blocked.append(Blocked(req.job_id, "waiting for capacity", ideal.nodes))
            if not backfill:
                rest = ordered[ordered.index(req) + 1 :]
                blocked.extend(
                    Blocked(r.job_id, f"behind {req.job_id} (no backfill)") for r in rest
                )
                break
    finally:
        for req, nodes in promised:
            index.release(req, nodes)
    return QueuePass(tuple(placements), tuple(preemptions), tuple(blocked))
