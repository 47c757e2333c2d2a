"""Tenant quotas in the gang scheduler: pure (no NATS, no clock, no IO).

A tenant's quota (``proto.tenants.TenantQuota``) guarantees it GPUs: ``gpus`` in all, of
which ``gpus_by_type`` per GPU type, the rest of any type.  Rules (docs/scheduler.md
"Tenant quotas"):

- a job whose tenant stays inside its guarantee with it starts on idle capacity, and when
  there is none it **reclaims**: other tenants' work on borrowed capacity is preempted
  (lowest priority first, then the most recently started), only as much as needed, never
  a job that lies inside its own tenant's guarantee;
- beyond its guarantee a tenant **borrows** idle capacity only, up to its
  ``borrow_limit``, and only while the unguaranteed capacity and what the others lend
  (their unused guarantee, up to their ``lend_limit``) cover all that is borrowed;
- inside a tenant, priorities and preemption as without quotas (the planner among its
  own jobs); across tenants there is no priority preemption;
- a tenant without a quota has a guarantee of 0: it runs on idle capacity and never
  reclaims;
- jobs inside their tenant's guarantee are taken first in a pass, then the rest, each
  part in the usual priority order;
- no quotas at all: exactly ``schedule_on``.
"""

from __future__ import annotations

import bisect
import heapq
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import msgspec

from metalguard.controller.jobs.scheduler import (
    Blocked,
    FleetIndex,
    FleetNode,
    JobRequest,
    Placement,
    Preemption,
    QueuePass,
    RunningJob,
    plan_among,
    queue_order,
    schedule_on,
)
from metalguard.proto.base import Token
from metalguard.proto.tenants import TenantQuota, TenantUsage

QUOTA_KEYS = frozenset({"name", "gpus", "gpus_by_type", "borrow_limit", "lend_limit"})
"""The keys of a ``[[tenants]]`` table or a ``PUT /v1/tenants/{name}`` body."""

Gpus = Counter[str]
"""GPUs by GPU type ("" where the type is not known: a queued job asking any)."""


# --- parsing ------------------------------------------------------------------------


class QuotaError(ValueError):
    """A bad quota: which tenant (empty: the quotas together), which field, what is wrong."""

    def __init__(self, tenant: str, field: str, problem: str) -> None:
        self.tenant = tenant
        self.field = field
        self.problem = problem
        where = f"tenants.{tenant}.{field}" if tenant else f"tenants.{field}"
        super().__init__(f"{where}: {problem}")


def _count(tenant: str, name: str, value: object) -> int:
    """A whole number >= 0, else a :class:`QuotaError` naming the field."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise QuotaError(tenant, name, f"must be a whole number of GPUs, got {value!r}")
    if value < 0:
        raise QuotaError(tenant, name, f"must not be negative, got {value}")
    return value


def parse_quota(name: str, doc: Mapping[str, object]) -> TenantQuota:
    """One tenant's quota from a ``PUT`` body or a ``[[tenants]]`` table (its ``name``,
    when given, must be ``name``); ``gpus`` defaults to the sum of ``gpus_by_type``.

    Raises :class:`QuotaError` (``tenants.<name>.<field>: <problem>``) on an unknown key,
    a negative or non-integer number, ``gpus_by_type`` adding up to more than ``gpus`` or
    a ``lend_limit`` above ``gpus``."""
    try:
        msgspec.convert(name, Token)
    except msgspec.ValidationError:
        raise QuotaError(
            "", "name", f"{name!r} is not a tenant name (1-128 characters, no '.', '*', '>', space)"
        ) from None
    unknown = sorted(k for k in doc if k not in QUOTA_KEYS)
    if unknown:
        raise QuotaError(name, unknown[0], f"unknown key (known: {', '.join(sorted(QUOTA_KEYS))})")
    if "name" in doc and doc["name"] != name:
        raise QuotaError(name, "name", f"{doc['name']!r} differs from the tenant {name!r}")
    raw_types = doc.get("gpus_by_type", {})
    if not isinstance(raw_types, Mapping):
        raise QuotaError(
            name, "gpus_by_type", f"must be a table of GPU type -> GPUs, got {raw_types!r}"
        )
    by_type: dict[str, int] = {}
    for gpu_type, value in raw_types.items():
        if not isinstance(gpu_type, str) or not gpu_type:
            raise QuotaError(name, "gpus_by_type", f"{gpu_type!r} is not a GPU type")
        by_type[gpu_type] = _count(name, f"gpus_by_type.{gpu_type}", value)
    typed = sum(by_type.values())
    gpus = _count(name, "gpus", doc["gpus"]) if "gpus" in doc else typed
    if typed > gpus:
        raise QuotaError(name, "gpus_by_type", f"adds up to {typed} GPUs, more than gpus ({gpus})")
    limits: dict[str, int | None] = {}
    for key in ("borrow_limit", "lend_limit"):
        value = doc.get(key)
        limits[key] = None if value is None else _count(name, key, value)
    lend = limits["lend_limit"]
    if lend is not None and lend > gpus:
        raise QuotaError(name, "lend_limit", f"{lend} is more than the guarantee (gpus = {gpus})")
    return TenantQuota(
        name=name,
        gpus=gpus,
        gpus_by_type=by_type,
        borrow_limit=limits["borrow_limit"],
        lend_limit=lend,
    )


def parse_tenants(tables: Sequence[Mapping[str, object]]) -> dict[str, TenantQuota]:
    """The ``[[tenants]]`` tables of a config, by name; each needs a ``name``, and a name
    given twice is refused (:class:`QuotaError`)."""
    out: dict[str, TenantQuota] = {}
    for i, table in enumerate(tables):
        name = table.get("name")
        if not isinstance(name, str):
            raise QuotaError(
                "", f"[{i}].name", "missing" if name is None else f"{name!r} is not a name"
            )
        if name in out:
            raise QuotaError(
                name, "name", f"given twice (tables {_position(tables, name)} and {i})"
            )
        out[name] = parse_quota(name, table)
    return out


def _position(tables: Sequence[Mapping[str, object]], name: str) -> int:
    return next(i for i, t in enumerate(tables) if t.get("name") == name)


def check_against_fleet(
    quotas: Mapping[str, TenantQuota], fleet_gpus: int, fleet_gpus_by_type: Mapping[str, int]
) -> None:
    """Refuse (:class:`QuotaError`) guarantees beyond the fleet: one tenant's, then all of
    them together, in all and per GPU type."""
    for name in sorted(quotas):
        quota = quotas[name]
        if quota.gpus > fleet_gpus:
            raise QuotaError(name, "gpus", f"{quota.gpus} GPUs, the fleet has {fleet_gpus}")
        for gpu_type, n in sorted(quota.gpus_by_type.items()):
            have = fleet_gpus_by_type.get(gpu_type, 0)
            if n > have:
                raise QuotaError(
                    name, f"gpus_by_type.{gpu_type}", f"{n} GPUs, the fleet has {have} of that type"
                )
    total = sum(q.gpus for q in quotas.values())
    if total > fleet_gpus:
        raise QuotaError(
            "", "gpus", f"the guarantees add up to {total} GPUs, the fleet has {fleet_gpus}"
        )
    typed: Counter[str] = Counter()
    for quota in quotas.values():
        typed.update(quota.gpus_by_type)
    for gpu_type, n in sorted(typed.items()):
        have = fleet_gpus_by_type.get(gpu_type, 0)
        if n > have:
            raise QuotaError(
                "",
                f"gpus_by_type.{gpu_type}",
                f"the guarantees add up to {n} GPUs, the fleet has {have} of that type",
            )


def fleet_capacity(nodes: Iterable[FleetNode]) -> tuple[int, dict[str, int]]:
    """The fleet's GPUs, in all and per type (what :func:`check_against_fleet` takes)."""
    by_type: Counter[str] = Counter()
    for node in nodes:
        by_type[node.gpu_type] += node.gpus
    return sum(by_type.values()), dict(by_type)


# --- accounting -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Guarantee:
    """A tenant's quota as the scheduler uses it (no quota: all zero, no limits)."""

    gpus: int = 0
    by_type: Mapping[str, int] = field(default_factory=dict)
    borrow_limit: int | None = None
    lend_limit: int | None = None

    @classmethod
    def of(cls, quota: TenantQuota | None) -> Guarantee:
        if quota is None:
            return cls()
        return cls(quota.gpus, dict(quota.gpus_by_type), quota.borrow_limit, quota.lend_limit)

    def borrowed(self, use: Mapping[str, int]) -> int:
        """GPUs of ``use`` beyond the guarantee: what exceeds each type's share, less the
        part of any type (``gpus`` minus the typed shares)."""
        if not self.by_type:  # all of it of any type (the same sums, fewer steps)
            return max(0, sum(n for n in use.values() if n > 0) - self.gpus)
        excess = sum(max(0, n - self.by_type.get(t, 0)) for t, n in use.items())
        return max(0, excess - (self.gpus - sum(self.by_type.values())))

    def within(self, use: Mapping[str, int]) -> bool:
        return self.borrowed(use) == 0

    def unused(self, use: Mapping[str, int], borrowed: int | None = None) -> int:
        """Its guarantee that ``use`` leaves empty (use beyond a type's share that the
        part of any type cannot take fills none of it); ``borrowed``: :meth:`borrowed`
        of ``use`` when known."""
        if borrowed is None:
            borrowed = self.borrowed(use)
        return self.gpus - (sum(use.values()) - borrowed)

    def lendable(self, use: Mapping[str, int], borrowed: int | None = None) -> int:
        """Of its unused guarantee, what others may borrow (``borrowed`` as for
        :meth:`unused`)."""
        unused = self.unused(use, borrowed)
        return unused if self.lend_limit is None else min(unused, self.lend_limit)


def held_gpus(req: JobRequest, placement: Iterable[str], nodes: Mapping[str, FleetNode]) -> Gpus:
    """The GPUs a job holds on ``placement``, by type: ``gpus_per_node`` per node, or the
    node's whole GPU count for a job that asks no resources (it takes whole nodes)."""
    out: Gpus = Counter()
    for handle in placement:
        node = nodes.get(handle)
        if node is None:
            if not req.exclusive and req.gpus_per_node:
                out[req.gpu_type] += req.gpus_per_node
        elif req.exclusive:
            if node.gpus:
                out[node.gpu_type] += node.gpus
        elif req.gpus_per_node:
            out[node.gpu_type] += req.gpus_per_node
    return out


def held_by_tenant(
    running: Iterable[RunningJob], nodes: Mapping[str, FleetNode]
) -> defaultdict[str, Gpus]:
    """Per tenant, the GPUs its running jobs hold (:func:`held_gpus`)."""
    held: defaultdict[str, Gpus] = defaultdict(Counter)
    for job in running:
        held[job.request.tenant].update(held_gpus(job.request, job.placement, nodes))
    return held


class TenantHoldings:
    """What each tenant's running jobs hold (:func:`held_by_tenant`) and the fleet's GPUs,
    kept across queue passes beside a kept :class:`FleetIndex`: give it the same
    ``commit`` / ``release`` / ``update_node`` as the index (O(the nodes touched) each),
    and :func:`schedule_with_quotas` takes them from it instead of counting them over
    every running job and node each pass (the same decisions)."""

    def __init__(self, nodes: Iterable[FleetNode], running: Iterable[RunningJob] = ()) -> None:
        self.nodes: dict[str, FleetNode] = {n.handle: n for n in nodes}
        self.fleet_gpus = sum(n.gpus for n in self.nodes.values())
        self.held: dict[str, Gpus] = held_by_tenant(running, self.nodes)
        self.stale = False
        """A node's GPUs changed under jobs that may hold them: count again (``recount``)."""

    def commit(self, req: JobRequest, placement: Sequence[str]) -> None:
        """``req`` now holds ``placement``."""
        got = held_gpus(req, placement, self.nodes)
        if got:
            self.held.setdefault(req.tenant, Counter()).update(got)

    def release(self, req: JobRequest, placement: Sequence[str]) -> None:
        """Undo :meth:`commit`: ``req`` is gone."""
        got = held_gpus(req, placement, self.nodes)
        mine = self.held.get(req.tenant)
        if not got or mine is None:
            return
        mine.subtract(got)
        for gpu_type in got:
            if mine[gpu_type] <= 0:
                del mine[gpu_type]
        if not mine:
            del self.held[req.tenant]

    def update_node(self, node: FleetNode) -> None:
        """Replace one node's record; a change of its GPUs or their type makes the
        holdings ``stale`` (its jobs' are not known here)."""
        old = self.nodes.get(node.handle)
        if old is None:
            raise ValueError(f"update_node: {node.handle!r} is not in the holdings")
        self.nodes[node.handle] = node
        if old.gpus != node.gpus or old.gpu_type != node.gpu_type:
            self.fleet_gpus += node.gpus - old.gpus
            self.stale = True

    def recount(self, running: Iterable[RunningJob]) -> None:
        """Count the holdings again from ``running`` (all that holds nodes now)."""
        self.held = held_by_tenant(running, self.nodes)
        self.stale = False


def may_hold(
    quotas: Mapping[str, TenantQuota] | None,
    running: Iterable[RunningJob],
    nodes: Mapping[str, FleetNode],
    req: JobRequest,
    placement: Sequence[str],
) -> bool:
    """Whether ``req``'s tenant may hold ``placement`` for it (an elastic job's larger
    size) beside what its other running jobs hold: inside its guarantee, or borrowing
    within its ``borrow_limit`` (no quotas: always).  ``running`` may hold ``req``'s own
    current placement; it is left out."""
    if not quotas:
        return True
    held: Gpus = Counter()
    for job in running:
        if job.request.tenant == req.tenant and job.request.job_id != req.job_id:
            held.update(held_gpus(job.request, job.placement, nodes))
    held.update(held_gpus(req, placement, nodes))
    guarantee = Guarantee.of(quotas.get(req.tenant))
    borrowed = guarantee.borrowed(held)
    if borrowed == 0:
        return True
    return guarantee.borrow_limit is None or borrowed <= guarantee.borrow_limit


def asked_gpus(req: JobRequest, nodes: Iterable[FleetNode]) -> Gpus:
    """The GPUs a queued job asks for, by its ``gpu_type`` ("" when any): a whole-node
    job counts the biggest node of its type."""
    per_node = req.gpus_per_node
    if req.exclusive:
        per_node = max(
            (n.gpus for n in nodes if not req.gpu_type or n.gpu_type == req.gpu_type), default=0
        )
    return Counter({req.gpu_type: req.nodes * per_node}) if per_node else Counter()


def _free_pool(quotas: Mapping[str, TenantQuota], fleet_gpus: int) -> int:
    """The fleet's GPUs that are nobody's guarantee."""
    return max(0, fleet_gpus - sum(q.gpus for q in quotas.values()))


def _share(amount: int, weights: Mapping[str, int]) -> dict[str, int]:
    """``amount`` (at most the weights' sum) split in proportion to ``weights``, largest
    remainders first (ties: by name)."""
    total = sum(weights.values())
    if amount <= 0 or total <= 0:
        return {}
    amount = min(amount, total)
    out = {k: amount * w // total for k, w in weights.items()}
    left = amount - sum(out.values())
    for k in sorted(weights, key=lambda k: (-(amount * weights[k] % total), k))[:left]:
        out[k] += 1
    return out


def usage(
    quotas: Mapping[str, TenantQuota],
    nodes: Iterable[FleetNode],
    running: Iterable[RunningJob],
    queued: Iterable[JobRequest] = (),
) -> dict[str, TenantUsage]:
    """Per tenant (with a quota, or with jobs), its guarantee and what it holds now.

    ``borrowed``: its use beyond its guarantee; ``lent``: of what all tenants borrow, the
    part the unguaranteed capacity does not cover, attributed to the tenants with unused
    guarantee in proportion to what they lend (``lend_limit``), then (past that) to their
    unused guarantee; ``waiting``: what its queued jobs ask for (:func:`asked_gpus`)."""
    fleet = {n.handle: n for n in nodes}
    held = held_by_tenant(running, fleet)
    waiting: dict[str, int] = defaultdict(int)
    waiting_jobs: Counter[str] = Counter()
    for req in queued:
        waiting[req.tenant] += sum(asked_gpus(req, fleet.values()).values())
        waiting_jobs[req.tenant] += 1
    return usage_of(quotas, held, sum(n.gpus for n in fleet.values()), waiting, waiting_jobs)


def usage_of(
    quotas: Mapping[str, TenantQuota],
    held: Mapping[str, Mapping[str, int]],
    fleet_gpus: int,
    waiting: Mapping[str, int] | None = None,
    waiting_jobs: Mapping[str, int] | None = None,
) -> dict[str, TenantUsage]:
    """:func:`usage` from what each tenant holds (GPUs by type), the fleet's GPUs and
    what its queued jobs ask (GPUs, jobs), without a walk over the fleet."""
    waiting = waiting or {}
    waiting_jobs = waiting_jobs or {}
    nothing: Mapping[str, int] = {}
    names = sorted(set(quotas) | set(held) | set(waiting))
    use = {name: held.get(name, nothing) for name in names}
    guarantees = {name: Guarantee.of(quotas.get(name)) for name in names}
    borrowed = {name: guarantees[name].borrowed(use[name]) for name in names}
    over = sum(borrowed.values()) - _free_pool(quotas, fleet_gpus)
    lendable = {n: guarantees[n].lendable(use[n], borrowed[n]) for n in quotas}
    lent = _share(over, lendable)
    unused = {n: guarantees[n].unused(use[n], borrowed[n]) - lent.get(n, 0) for n in quotas}
    for n, extra in _share(over - sum(lent.values()), unused).items():
        lent[n] = lent.get(n, 0) + extra
    return {
        name: TenantUsage(
            name=name,
            guarantee=guarantees[name].gpus,
            in_use=sum(use[name].values()),
            in_use_by_type={t: n for t, n in sorted(use[name].items()) if n},
            borrowed=borrowed[name],
            lent=lent.get(name, 0),
            waiting=waiting.get(name, 0),
            waiting_jobs=waiting_jobs.get(name, 0),
            quota=quotas.get(name),
        )
        for name in names
    }


# --- the queue pass ---------------------------------------------------------------------


def schedule_with_quotas(
    queue: Iterable[JobRequest],
    nodes: Sequence[FleetNode],
    running: Sequence[RunningJob] = (),
    quotas: Mapping[str, TenantQuota] | None = None,
    *,
    index: FleetIndex | None = None,
    empty: FleetIndex | None = None,
    preempt: bool = True,
    backfill: bool = True,
    holdings: TenantHoldings | None = None,
) -> QueuePass:
    """One queue pass with tenant quotas (the module's rules); without quotas exactly
    ``schedule_queue``.  ``index`` (with ``empty``): a kept index holding ``running``, as
    for ``schedule_on`` (``nodes`` is then not read); the pass's placements stay committed
    in it.  ``holdings`` (with ``index``): kept beside it, holding ``running`` too (counted
    again when ``stale``); the placements are committed in it as well.  Reclaim
    preemptions have ``cause="reclaim"``."""
    if index is None:
        index = FleetIndex(nodes, running)
    if holdings is not None and holdings.stale:
        holdings.recount(running)
    if not quotas:
        queue = list(queue)
        decided = schedule_on(
            index, queue, running, empty=empty, preempt=preempt, backfill=backfill
        )
        if holdings is not None and decided.placements:
            by_id = {r.job_id: r for r in queue}
            for placed in decided.placements:
                holdings.commit(by_id[placed.job_id], placed.nodes)
        return decided
    return _QuotaPass(index, running, quotas, empty, preempt, backfill, holdings).run(queue)


class _QuotaPass:
    """One pass: the index, what each tenant holds as decisions are taken, the decisions."""

    def __init__(
        self,
        index: FleetIndex,
        running: Sequence[RunningJob],
        quotas: Mapping[str, TenantQuota],
        empty: FleetIndex | None,
        preempt: bool,
        backfill: bool,
        holdings: TenantHoldings | None = None,
    ) -> None:
        self.index, self.running, self.quotas = index, running, quotas
        self.empty, self.preempt, self.backfill = empty, preempt, backfill
        self.holdings = holdings
        self.fleet = index.nodes
        self.held: dict[str, Gpus]
        if holdings is None:
            self.free_pool = _free_pool(quotas, sum(n.gpus for n in self.fleet.values()))
            self.held = held_by_tenant(running, self.fleet)
        else:  # kept: no walk over the running jobs and the fleet
            self.free_pool = _free_pool(quotas, holdings.fleet_gpus)
            self.held = defaultdict(Counter, {t: Counter(g) for t, g in holdings.held.items()})
        self.preemptible: dict[str, tuple[list[int], list[tuple[int, RunningJob]]]] | None = None
        """Per tenant, its preemptible running jobs' priorities, and the jobs (with their
        position in ``running``) in that order: grouped when first needed."""
        self.guarantees: dict[str, Guarantee] = {}
        self.job_gpus: dict[int, tuple[RunningJob, Gpus]] = {}
        """:meth:`gpus` of the running jobs asked so far, by ``id``."""
        self.by_reclaim: dict[str, list[tuple[int, float, str, int, RunningJob]]] | None = None
        """:meth:`reclaim_order`, once it is asked."""
        self.biggest: dict[str, int] = {}
        """The GPUs of the biggest node of each GPU type ("": any), found once a pass."""
        self.stopped: set[str] = set()
        self.reserved: set[str] = set()
        self.held_back: frozenset[str] = frozenset()
        """``reserved`` as of its last change (each trial's ``exclude``)."""
        self.promised: list[tuple[JobRequest, tuple[str, ...]]] = []
        self.placements: list[Placement] = []
        self.preemptions: list[Preemption] = []
        self.blocked: list[Blocked] = []

    def guarantee(self, tenant: str) -> Guarantee:
        mine = self.guarantees.get(tenant)
        if mine is None:
            mine = self.guarantees[tenant] = Guarantee.of(self.quotas.get(tenant))
        return mine

    def own(self, tenant: str, below: int) -> list[RunningJob]:
        """The tenant's preemptible running jobs of a priority below ``below``, not
        stopped, in the order of ``running``."""
        if self.preemptible is None:
            self.preemptible = {}
            for pos, job in enumerate(self.running):
                if job.request.preemptible:
                    self.preemptible.setdefault(job.request.tenant, ([], []))[1].append((pos, job))
            for priorities, jobs in self.preemptible.values():
                jobs.sort(key=lambda p: (p[1].request.priority, p[0]))
                priorities.extend(j.request.priority for _, j in jobs)
        mine = self.preemptible.get(tenant)
        if mine is None or not mine[0] or mine[0][0] >= below:
            return []
        priorities, jobs = mine
        end = bisect.bisect_left(priorities, below)
        found = [p for p in jobs[:end] if p[1].request.job_id not in self.stopped]
        found.sort(key=lambda p: p[0])
        return [j for _, j in found]

    def reclaim_order(self) -> dict[str, list[tuple[int, float, str, int, RunningJob]]]:
        """Per tenant, its running jobs in reclaim order (lowest priority first, then the
        most recently started, then by id; ties: their order in ``running``), once a
        pass."""
        if self.by_reclaim is None:
            self.by_reclaim = {}
            for pos, j in enumerate(self.running):
                key = (j.request.priority, -j.started_ts, j.request.job_id, pos, j)
                self.by_reclaim.setdefault(j.request.tenant, []).append(key)
            for jobs in self.by_reclaim.values():
                jobs.sort(key=lambda k: k[:4])
        return self.by_reclaim

    def commit(self, req: JobRequest, nodes: tuple[str, ...]) -> None:
        """``req`` holds ``nodes`` from now on: in the index (and the kept holdings)."""
        self.index.commit(req, nodes)
        if self.holdings is not None:
            self.holdings.commit(req, nodes)

    def asked(self, req: JobRequest) -> Gpus:
        """:func:`asked_gpus` of ``req``, a whole-node job's biggest node found once per
        GPU type and pass (not by a walk over the fleet for each queued job)."""
        if not req.exclusive:
            return asked_gpus(req, ())
        per_node = self.biggest.get(req.gpu_type)
        if per_node is None:
            per_node = max(
                (
                    n.gpus
                    for n in self.fleet.values()
                    if not req.gpu_type or n.gpu_type == req.gpu_type
                ),
                default=0,
            )
            self.biggest[req.gpu_type] = per_node
        return Counter({req.gpu_type: req.nodes * per_node}) if per_node else Counter()

    def gpus(self, job: RunningJob) -> Gpus:
        """:func:`held_gpus` of a running job, counted once a pass (not to be changed)."""
        known = self.job_gpus.get(id(job))
        if known is not None and known[0] is job:
            return known[1]
        gpus = held_gpus(job.request, job.placement, self.fleet)
        self.job_gpus[id(job)] = (job, gpus)
        return gpus

    def order(self, queue: Iterable[JobRequest]) -> list[JobRequest]:
        """Priority order, but the jobs inside their tenant's guarantee first: per tenant,
        the longest prefix of its queued jobs (in priority order) that fits in what its
        guarantee leaves (:func:`asked_gpus`)."""
        inside: list[JobRequest] = []
        rest: list[JobRequest] = []
        use: dict[str, Gpus] = {}
        past: set[str] = set()
        for req in queue_order(queue):
            tenant = req.tenant
            if tenant in past or tenant not in self.quotas:  # its prefix ended: no count
                rest.append(req)
                continue
            mine = use.get(tenant)
            if mine is None:
                mine = use[tenant] = Counter(self.held.get(tenant, ()))
            mine.update(self.asked(req))
            if self.guarantee(tenant).within(mine):
                inside.append(req)
            else:
                past.add(tenant)
                rest.append(req)
        return inside + rest

    def run(self, queue: Iterable[JobRequest]) -> QueuePass:
        ordered = self.order(queue)
        try:
            for pos, req in enumerate(ordered):
                if not self.decide(req):
                    self.blocked.extend(
                        Blocked(r.job_id, f"behind {req.job_id} (no backfill)")
                        for r in ordered[pos + 1 :]
                    )
                    break
        finally:
            for req, nodes in self.promised:
                self.index.release(req, nodes)
        return QueuePass(tuple(self.placements), tuple(self.preemptions), tuple(self.blocked))

    def decide(self, req: JobRequest) -> bool:
        """Place, preempt or block one job; False when the pass stops (no backfill)."""
        trial = req
        if self.reserved:
            if len(self.held_back) != len(self.reserved):  # it only grows in a pass
                self.held_back = frozenset(self.reserved)
            exclude = req.exclude | self.held_back if req.exclude else self.held_back
            trial = replace(req, exclude=exclude)
        placed = self.index.place(trial)
        refused = None
        if placed is not None:
            refused = self.refusal(req.tenant, self.after(req, placed))
            if refused is None:
                self.commit(req, placed.nodes)
                self.held[req.tenant] = self.after(req, placed)
                self.placements.append(placed)
                return True
        if self.preempt:
            plan = None if placed is not None else self.reclaim(req, trial)
            plan = plan or self.within_tenant(req, trial, placed is not None)
            if plan is not None:
                self.take(req, plan)
                return True
        if refused is not None:  # it fits, but not in its quota: it waits for no node
            self.blocked.append(Blocked(req.job_id, f"tenant {req.tenant}: {refused}"))
            return True
        if self.empty is None:
            self.empty = FleetIndex(self.fleet.values())
        ideal = self.empty.place(req)
        if ideal is None:
            self.blocked.append(Blocked(req.job_id, "does not fit the fleet even when it is empty"))
            return True
        self.reserved.update(ideal.nodes)
        self.blocked.append(Blocked(req.job_id, "waiting for capacity", ideal.nodes))
        return self.backfill

    def after(self, req: JobRequest, placed: Placement, gone: Iterable[RunningJob] = ()) -> Gpus:
        """What ``req``'s tenant would hold with it on ``placed`` and ``gone`` stopped."""
        use = Counter(self.held[req.tenant])
        use.update(held_gpus(req, placed.nodes, self.fleet))
        for job in gone:
            if job.request.tenant == req.tenant:
                use.subtract(self.gpus(job))
        return +use

    def refusal(self, tenant: str, use: Gpus) -> str | None:
        """Why ``tenant`` may not hold ``use`` (None: it may): inside its guarantee always;
        beyond it within its ``borrow_limit`` and while the unguaranteed capacity and what
        the others lend cover all that is borrowed."""
        mine = self.guarantee(tenant)
        borrowed = mine.borrowed(use)
        if borrowed == 0:
            return None
        if mine.borrow_limit is not None and borrowed > mine.borrow_limit:
            return f"would borrow {borrowed} GPUs, its borrow_limit is {mine.borrow_limit}"
        others = [t for t in self.held if t != tenant]
        total = borrowed + sum(self.guarantee(t).borrowed(self.held[t]) for t in others)
        room = self.free_pool + sum(
            self.guarantee(t).lendable(self.held.get(t, Counter()))
            for t in self.quotas
            if t != tenant
        )
        if total > room:
            return f"would borrow {borrowed} GPUs, the others lend {room} GPUs for {total} borrowed"
        return None

    def reclaim(self, req: JobRequest, trial: JobRequest) -> Preemption | None:
        """Other tenants' work on borrowed capacity, stopped so that ``req`` (inside its
        tenant's guarantee) fits: lowest priority first, then the most recently started;
        a job only while its removal lowers what its tenant borrows."""
        tenant, mine = req.tenant, self.guarantee(req.tenant)
        least = 0 if req.exclusive else req.nodes * req.gpus_per_node
        if tenant not in self.quotas or sum(self.held[tenant].values()) + least > mine.gpus:
            return None  # no quota, or past its guarantee with the job whatever its nodes
        # only the jobs of tenants that borrow now: one that borrows nothing never does in
        # the walk (it takes jobs of borrowing tenants only, which lowers what they hold)
        lists = [
            jobs
            for t, jobs in self.reclaim_order().items()
            if t != tenant and self.guarantee(t).borrowed(self.held.get(t, {})) > 0
        ]
        candidates = [
            job
            for *_, job in (lists[0] if len(lists) == 1 else heapq.merge(*lists))
            if job.request.job_id not in self.stopped and self.could_help(job, req)
        ]
        freed = len({h for job in candidates for h in job.placement})
        if freed < trial.nodes and self.index.fit_count(trial) + freed < trial.nodes:
            return None  # it would not fit with every candidate gone (no walk needed)

        def borrowing(job: RunningJob, held: Mapping[str, Gpus]) -> bool:
            use, theirs = held[job.request.tenant], self.guarantee(job.request.tenant)
            now = theirs.borrowed(use)
            return now > 0 and now > theirs.borrowed(+(use - self.gpus(job)))

        def inside(placed: Placement, _: Mapping[str, Gpus]) -> bool:
            wanted = held_gpus(req, placed.nodes, self.fleet)
            return bool(wanted) and mine.within(self.held[tenant] + wanted)

        return self.walk(req, trial, candidates, borrowing, inside, "reclaim")

    def within_tenant(self, req: JobRequest, trial: JobRequest, fits: bool) -> Preemption | None:
        """The tenant's own preemptible, lower-priority jobs, stopped so that ``req`` fits
        and its tenant may hold it: the planner as without quotas when it does not fit,
        else (its quota refused it) the fewest of them in victim order."""
        own = self.own(req.tenant, req.priority)
        if not own:
            return None

        def allowed(placed: Placement, held: Mapping[str, Gpus]) -> bool:
            use = Counter(held[req.tenant])
            use.update(held_gpus(req, placed.nodes, self.fleet))
            return self.refusal(req.tenant, use) is None

        if not fits:
            plan = plan_among(self.index, trial, own)
            if plan is not None:
                gone = [j for j in own if j.request.job_id in plan.victims]
                if self.refusal(req.tenant, self.after(req, plan.placement, gone)) is None:
                    return replace(plan, job_id=req.job_id)
        own.sort(key=lambda j: (j.request.priority, len(j.placement), j.request.job_id))
        return self.walk(req, trial, own, lambda _j, _h: True, allowed, "priority")

    def could_help(self, job: RunningJob, req: JobRequest) -> bool:
        """Whether stopping ``job`` frees a node that could take a member of ``req``."""
        for handle in job.placement:
            node = self.fleet.get(handle)
            if (
                node is not None
                and node.schedulable
                and handle not in req.exclude
                and (not req.gpu_type or node.gpu_type == req.gpu_type)
                and node.bandwidth_tier >= req.bandwidth_tier
                and (not req.allowed_regions or node.region in req.allowed_regions)
            ):
                return True
        return False

    def walk(
        self,
        req: JobRequest,
        trial: JobRequest,
        candidates: Sequence[RunningJob],
        may_take: Callable[[RunningJob, Mapping[str, Gpus]], bool],
        accept: Callable[[Placement, Mapping[str, Gpus]], bool],
        cause: Literal["priority", "reclaim"],
    ) -> Preemption | None:
        """Stop candidates in order (those ``may_take`` allows given the ones stopped
        before) until ``trial`` fits and ``accept`` takes its placement; then spare each
        victim, last first, without which that still holds.  The index is left as it was."""
        index = self.index
        held: dict[str, Gpus] = defaultdict(Counter, {t: Counter(g) for t, g in self.held.items()})
        taken: list[RunningJob] = []
        placed = None
        try:
            for job in candidates:
                if not may_take(job, held):
                    continue
                index.release(job.request, job.placement)
                taken.append(job)
                held[job.request.tenant] = +(held[job.request.tenant] - self.gpus(job))
                placed = index.place(trial)
                if placed is not None and accept(placed, held):
                    break
            else:
                return None
            for job in reversed(taken[:-1]):
                index.commit(job.request, job.placement)
                held[job.request.tenant].update(self.gpus(job))
                again = index.place(trial)
                if again is not None and accept(again, held):
                    taken.remove(job)
                    placed = again
                else:
                    index.release(job.request, job.placement)
                    held[job.request.tenant] = +(held[job.request.tenant] - self.gpus(job))
        finally:
            for job in taken:
                index.commit(job.request, job.placement)
        assert placed is not None
        victims = tuple(j.request.job_id for j in taken)
        return Preemption(req.job_id, victims, replace(placed, job_id=req.job_id), cause)

    def take(self, req: JobRequest, plan: Preemption) -> None:
        """Carry a plan into the pass: its victims are stopped, its nodes promised."""
        gone = set(plan.victims)
        for job in self.running:
            if job.request.job_id in gone:
                held = self.held[job.request.tenant]
                self.held[job.request.tenant] = +(held - self.gpus(job))
        self.held[req.tenant].update(held_gpus(req, plan.placement.nodes, self.fleet))
        self.stopped.update(gone)
        self.reserved.update(plan.placement.nodes)
        self.index.commit(req, plan.placement.nodes)
        self.promised.append((req, plan.placement.nodes))
        self.preemptions.append(plan)
