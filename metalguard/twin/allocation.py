"""How the twin's queue pass shares the fleet among tenants (issue 31; docs/twin.md
"Allocation: dedicated partitions vs one pool"), with the project's real scheduler code.

- :class:`Partitions` (``dedicated``): each tenant's contract is a fixed set of nodes with
  its own kept :class:`FleetIndex`; each pass runs the real ``schedule_on`` once per
  tenant, on its partition's nodes and its own jobs only (no borrowing, no preemption
  across tenants; inside a partition whatever the policy allows).
- :class:`Pool` (``pooled``): one kept index of the whole fleet; each pass is the real
  ``schedule_with_quotas`` with each tenant's guarantee its contract's GPUs (borrowing
  idle capacity, reclaim with checkpoints, priorities and preemption inside a tenant).

:class:`TenantMeter` integrates each tenant's GPUs in use, inside its guarantee,
borrowed and lent, as the real :func:`metalguard.controller.jobs.quota.usage` counts them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

from metalguard.controller.jobs import quota, scheduler
from metalguard.controller.jobs.scheduler import (
    Blocked,
    FleetIndex,
    FleetNode,
    JobRequest,
    Placement,
    Preemption,
    QueuePass,
    RunningJob,
)
from metalguard.proto.tenants import TenantQuota
from metalguard.twin.model import AllocationMode, Policy


class Pool:
    """One index of the whole fleet under tenant quotas (``pooled``), with each tenant's
    GPUs held kept beside it (a pass does not count them again)."""

    def __init__(self, nodes: Iterable[FleetNode], quotas: Mapping[str, TenantQuota]) -> None:
        nodes = tuple(nodes)
        self.quotas = dict(quotas)
        self.index = FleetIndex(nodes)
        self.empty = FleetIndex(nodes)
        self.holdings = quota.TenantHoldings(nodes)

    def update_node(self, node: FleetNode) -> None:
        self.index.update_node(node)
        self.empty.update_node(node)
        self.holdings.update_node(node)

    def commit(self, req: JobRequest, nodes: tuple[str, ...]) -> None:
        self.index.commit(req, nodes)
        self.holdings.commit(req, nodes)

    def release(self, req: JobRequest, nodes: tuple[str, ...]) -> None:
        self.index.release(req, nodes)
        self.holdings.release(req, nodes)

    def schedule(
        self, queue: list[JobRequest], running: list[RunningJob], policy: Policy
    ) -> QueuePass:
        """The real quota pass; its placements stay committed in the index."""
        return quota.schedule_with_quotas(
            queue,
            (),
            running,
            self.quotas,
            index=self.index,
            empty=self.empty,
            preempt=policy.preemption,
            backfill=policy.backfill,
            holdings=self.holdings,
        )


class Partitions:
    """A kept index per tenant's partition (``dedicated``)."""

    def __init__(self, nodes: Iterable[FleetNode], parts: Mapping[str, Sequence[str]]) -> None:
        by_handle = {n.handle: n for n in nodes}
        self.owner: dict[str, str] = {}
        self.indexes: dict[str, tuple[FleetIndex, FleetIndex]] = {}
        for tenant in sorted(parts):
            mine = [by_handle[h] for h in parts[tenant]]
            for h in parts[tenant]:
                self.owner[h] = tenant
            self.indexes[tenant] = (FleetIndex(mine), FleetIndex(mine))

    def update_node(self, node: FleetNode) -> None:
        tenant = self.owner.get(node.handle)
        if tenant is not None:
            index, empty = self.indexes[tenant]
            index.update_node(node)
            empty.update_node(node)

    def commit(self, req: JobRequest, nodes: tuple[str, ...]) -> None:
        self.indexes[req.tenant][0].commit(req, nodes)

    def release(self, req: JobRequest, nodes: tuple[str, ...]) -> None:
        self.indexes[req.tenant][0].release(req, nodes)

    def schedule(
        self, queue: list[JobRequest], running: list[RunningJob], policy: Policy
    ) -> QueuePass:
        """The real ``schedule_on`` per tenant with waiting jobs, on its partition only;
        the passes' decisions together (placements stay committed in each index). A job
        of a tenant without a partition is blocked."""
        queues: dict[str, list[JobRequest]] = defaultdict(list)
        for req in queue:
            queues[req.tenant].append(req)
        mine: dict[str, list[RunningJob]] = defaultdict(list)
        for job in running:
            mine[job.request.tenant].append(job)
        placements: list[Placement] = []
        preemptions: list[Preemption] = []
        blocked: list[Blocked] = []
        for tenant in sorted(queues):
            if tenant not in self.indexes:
                blocked.extend(
                    Blocked(r.job_id, f"tenant {tenant} has no partition") for r in queues[tenant]
                )
                continue
            index, empty = self.indexes[tenant]
            decided = scheduler.schedule_on(
                index,
                queues[tenant],
                mine[tenant],
                empty=empty,
                preempt=policy.preemption,
                backfill=policy.backfill,
            )
            placements.extend(decided.placements)
            preemptions.extend(decided.preemptions)
            blocked.extend(decided.blocked)
        return QueuePass(tuple(placements), tuple(preemptions), tuple(blocked))


Allocator = Pool | Partitions


def contracts(nodes: Iterable[FleetNode], parts: Mapping[str, Sequence[str]]) -> dict[str, int]:
    """Each tenant's contract in GPUs: its partition's."""
    gpus = {n.handle: n.gpus for n in nodes}
    return {name: sum(gpus[h] for h in handles) for name, handles in sorted(parts.items())}


def contract_quotas(contracts: Mapping[str, int]) -> dict[str, TenantQuota]:
    """Each tenant's quota: its contract's GPUs guaranteed, no typed shares, no limits."""
    return {name: TenantQuota(name=name, gpus=gpus) for name, gpus in sorted(contracts.items())}


def allocator(
    mode: AllocationMode,
    nodes: Sequence[FleetNode],
    parts: Mapping[str, Sequence[str]],
) -> Allocator:
    """The queue side of ``mode`` over ``nodes`` (the scheduler's view of them)."""
    if mode == "dedicated":
        return Partitions(nodes, parts)
    return Pool(nodes, contract_quotas(contracts(nodes, parts)))


class TenantMeter:
    """Per tenant, GPU-seconds in use, inside its guarantee, borrowed and lent, integrated
    exactly (piecewise constant between changes). The rates come from the real
    :func:`quota.usage_of` (what :func:`quota.usage` counts) on the fleet's GPUs, given
    each tenant's GPUs held in all (no typed shares: the GPU type does not matter)."""

    KEYS = ("used", "within", "borrowed", "lent")
    COUNTS = ("reclaims_made", "reclaims_suffered")

    def __init__(self, nodes: Sequence[FleetNode], quotas: Mapping[str, TenantQuota]) -> None:
        self.nodes = tuple(nodes)
        self.fleet_gpus = sum(n.gpus for n in self.nodes)
        self.quotas = dict(quotas)
        self.held: dict[str, int] = dict.fromkeys(self.quotas, 0)
        self.rates: dict[str, dict[str, int]] = {}
        self.totals: dict[str, dict[str, float]] = {}
        for tenant in self.quotas:
            self._total(tenant)
        self.t = 0.0
        self._dirty = True

    def at(self, now: float) -> None:
        """Bring the sums to ``now`` (before a change at ``now``)."""
        if now <= self.t:
            return
        if self._dirty:
            self.rates = self._rates()
            self._dirty = False
        dt = now - self.t
        for tenant, rates in self.rates.items():
            total = self._total(tenant)
            for key, gpus in rates.items():
                total[key] += gpus * dt
        self.t = now

    def hold(self, now: float, tenant: str, gpus: int) -> None:
        """A tenant's job takes (positive) or releases (negative) GPUs."""
        self.at(now)
        self.held[tenant] = self.held.get(tenant, 0) + gpus
        self._dirty = True

    def reclaim(self, by: str, victim: str) -> None:
        """``by`` reclaimed a job of ``victim``'s."""
        self._total(by)["reclaims_made"] += 1
        self._total(victim)["reclaims_suffered"] += 1

    def _total(self, tenant: str) -> dict[str, float]:
        if tenant not in self.totals:
            self.totals[tenant] = dict.fromkeys((*self.KEYS, *self.COUNTS), 0.0)
        return self.totals[tenant]

    def close(self, end_s: float) -> dict[str, dict[str, float]]:
        """The sums at ``end_s``, per tenant (sorted)."""
        self.at(end_s)
        return {t: dict(sorted(self.totals[t].items())) for t in sorted(self.totals)}

    def _rates(self) -> dict[str, dict[str, int]]:
        held = {t: {"": n} for t, n in sorted(self.held.items()) if n > 0}
        used = quota.usage_of(self.quotas, held, self.fleet_gpus)
        return {
            t: {
                "used": u.in_use,
                "within": u.in_use - u.borrowed,
                "borrowed": u.borrowed,
                "lent": u.lent,
            }
            for t, u in used.items()
        }
