"""The tenants routes of the HTTP API (docs/api.md, docs/scheduler.md "Tenant quotas").

``GET /v1/tenants``: every tenant with a quota or a job — its guarantee, the GPUs its jobs
hold, borrowed beyond the guarantee, lent to others, and what waits.  ``GET
/v1/tenants/{tenant}``: one of them with its stored quota.  ``PUT /v1/tenants/{tenant}``
(admin token; JSON body ``{"gpus": N, "gpus_by_type": {...}, "borrow_limit": N,
"lend_limit": N}``) sets its quota: 400 naming the field and the problem (a negative or
unknown field, per-type guarantees above ``gpus``, a ``lend_limit`` above it, guarantees
beyond the fleet), 409 when another writer changed it first.
"""

from __future__ import annotations

import time
from typing import Final, Protocol

import msgspec
from aiohttp import web

from metalguard.controller.api.auth import check_admin, check_read
from metalguard.controller.api.errors import ApiError, reject_unknown_query
from metalguard.controller.api.shapes import TenantAnswer, TenantList
from metalguard.controller.jobs.quota import QuotaError, parse_quota
from metalguard.controller.jobs.spec import NotLeaderError
from metalguard.controller.jobs.tenant_store import TenantConflictError
from metalguard.proto.codec import to_builtins
from metalguard.proto.subjects import SubjectError, check_token
from metalguard.proto.tenants import TenantQuota, TenantUsage


class TenantsView(Protocol):
    """What the routes need of the job manager (controller/jobs/manager.py)."""

    def tenant_usage(self) -> tuple[int, dict[str, TenantUsage]]: ...

    async def set_quota(self, quota: TenantQuota) -> TenantQuota: ...


TENANTS: Final = web.AppKey("tenants", TenantsView)


def add_tenant_routes(app: web.Application, tenants: TenantsView) -> None:
    """Register the ``/v1/tenants`` routes over the job manager."""
    app[TENANTS] = tenants
    app.router.add_get("/v1/tenants", list_tenants)
    app.router.add_get("/v1/tenants/{tenant}", get_tenant)
    app.router.add_put("/v1/tenants/{tenant}", put_tenant)


async def list_tenants(request: web.Request) -> web.Response:
    """Every tenant with a quota or a job, by name."""
    check_read(request)
    reject_unknown_query(request, (), name_allowed=False)
    fleet_gpus, usage = request.app[TENANTS].tenant_usage()
    answer = TenantList(fleet_gpus=fleet_gpus, tenants=[usage[k] for k in sorted(usage)])
    return web.json_response(to_builtins(answer))


async def get_tenant(request: web.Request) -> web.Response:
    """One tenant's usage and quota; 404 for a tenant with neither a quota nor a job."""
    check_read(request)
    reject_unknown_query(request, (), name_allowed=False)
    name = tenant_name(request)
    _, usage = request.app[TENANTS].tenant_usage()
    found = usage.get(name)
    if found is None:
        raise ApiError(404, "not_found", f"no tenant {name!r} (no quota and no job)")
    return web.json_response(to_builtins(TenantAnswer(usage=found, quota=found.quota)))


async def put_tenant(request: web.Request) -> web.Response:
    """Set a tenant's quota (admin token)."""
    check_admin(request)
    reject_unknown_query(request, (), name_allowed=False)
    name = tenant_name(request)
    quota = stamped(decode_quota(name, request.content_type, await request.read()), by="api")
    try:
        stored = await request.app[TENANTS].set_quota(quota)
    except QuotaError as exc:
        raise ApiError(400, "invalid_quota", str(exc), [str(exc)]) from None
    except TenantConflictError as exc:
        raise ApiError(409, "conflict", str(exc)) from None
    except NotLeaderError as exc:
        raise ApiError(503, "not_leader", str(exc)) from None
    _, usage = request.app[TENANTS].tenant_usage()
    found = usage.get(name) or TenantUsage(name=name, guarantee=stored.gpus, quota=stored)
    return web.json_response(to_builtins(TenantAnswer(usage=found, quota=stored)))


def tenant_name(request: web.Request) -> str:
    """The ``{tenant}`` of the path, a valid KV key and subject token, else 400."""
    name = request.match_info["tenant"]
    try:
        check_token(name, "tenant")
    except SubjectError as exc:
        raise ApiError(400, "bad_request", str(exc)) from None
    if len(name) > 128:
        raise ApiError(400, "bad_request", "tenant: at most 128 characters")
    return name


def decode_quota(name: str, content_type: str, data: bytes) -> TenantQuota:
    """The quota in a JSON body (:func:`quota.parse_quota`'s rules); ApiError 415 / 400
    naming the field and its problem."""
    if content_type.lower() != "application/json":
        raise ApiError(
            415,
            "unsupported_media_type",
            f"send the quota as application/json (got {content_type or 'none'!r})",
        )
    try:
        doc = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise ApiError(400, "bad_request", f"the body is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ApiError(400, "invalid_quota", "invalid quota: the body must be a JSON object")
    try:
        return parse_quota(name, doc)
    except QuotaError as exc:
        raise ApiError(400, "invalid_quota", f"invalid quota: {exc}", [str(exc)]) from None


def stamped(quota: TenantQuota, *, by: str, now: float | None = None) -> TenantQuota:
    """``quota`` with who set it and when."""
    when = time.time() if now is None else now
    return msgspec.structs.replace(quota, updated_ts=when, updated_by=by)
