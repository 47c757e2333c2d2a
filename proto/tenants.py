"""Tenant quotas (what an operator sets) and a tenant's usage (what the scheduler sees).

A tenant's guarantee is a number of GPUs (and, where a fleet mixes GPU types, per type)
that its jobs may always have: when it waits inside its guarantee, work other tenants run
on borrowed capacity is reclaimed (checkpointed and stopped). Beyond its guarantee a
tenant borrows idle capacity, up to ``borrow_limit``; ``lend_limit`` caps how much of its
own unused guarantee others may borrow. docs/scheduler.md, "Tenant quotas".
"""

from __future__ import annotations

from metalguard.proto.base import Message, NonNegInt


class TenantQuota(Message, frozen=True, tag="tenant_quota"):
    """One tenant's quota."""

    name: str
    gpus: NonNegInt = 0
    """GPUs guaranteed (all types together)."""
    gpus_by_type: dict[str, NonNegInt] = {}
    """Per GPU type (``nvidia-h100`` -> 64) where a fleet mixes types; each counts towards
    ``gpus`` too."""
    borrow_limit: NonNegInt | None = None
    """GPUs it may use beyond its guarantee (None: any idle capacity)."""
    lend_limit: NonNegInt | None = None
    """GPUs of its unused guarantee others may borrow (None: all of it)."""
    updated_ts: float = 0.0
    updated_by: str = ""


class TenantUsage(Message, frozen=True, tag="tenant_usage"):
    """A tenant's quota and what its jobs hold now (``GET /v1/tenants``)."""

    name: str
    guarantee: NonNegInt = 0
    in_use: NonNegInt = 0
    """GPUs its running jobs hold."""
    in_use_by_type: dict[str, NonNegInt] = {}
    """The same per GPU type ("" for nodes that report none)."""
    borrowed: NonNegInt = 0
    """In use beyond its guarantee."""
    lent: NonNegInt = 0
    """Of its unused guarantee, held by other tenants' borrowed work."""
    waiting: NonNegInt = 0
    """GPUs its queued jobs ask for."""
    waiting_jobs: NonNegInt = 0
    quota: TenantQuota | None = None
    """None: a tenant with no quota (its jobs run only on idle capacity)."""
