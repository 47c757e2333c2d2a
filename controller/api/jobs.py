"""The jobs routes of the HTTP API (docs/api.md, docs/jobs.md).

``POST /v1/jobs`` (admin token; JSON or TOML body) queues a job: 201 with its status, or
422 with every reason it is invalid, 409 when its id is taken.  ``GET /v1/jobs``
(``?state=`` filter, comma-separated), ``GET /v1/jobs/{id}`` (status, placement,
restarts, history with reasons) and ``DELETE /v1/jobs/{id}`` (admin: cancel).  With
federation, a job may be forwarded to another region at submit, and ``GET
/v1/jobs/{id}`` answers for a job of any region; the answers say the job's ``region``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final, Protocol, TypeGuard, get_args

import msgspec
from aiohttp import web

from metalguard.controller.api.auth import check_admin, check_read
from metalguard.controller.api.errors import ApiError, reject_unknown_query
from metalguard.controller.api.shapes import JobSummary
from metalguard.controller.jobs.spec import JobRejectedError, NotLeaderError
from metalguard.controller.jobs.store import JobExistsError
from metalguard.proto.codec import to_builtins
from metalguard.proto.documents import DocumentError, parse_toml
from metalguard.proto.jobs import JobState, JobStatus


class JobsView(Protocol):
    """What the routes need of the job manager (controller/jobs/manager.py)."""

    @property
    def jobs(self) -> Mapping[str, JobStatus]: ...

    async def submit(self, raw: Any) -> JobStatus: ...

    async def cancel(self, job_id: str) -> JobStatus | None: ...


class FederatedJobsView(JobsView, Protocol):
    """The job manager with forwarding (controller/federation/jobs.py)."""

    @property
    def region(self) -> str: ...

    @property
    def forwarded(self) -> Mapping[str, str]: ...

    async def find(self, job_id: str) -> tuple[str, JobStatus] | None: ...


JOBS: Final = web.AppKey("jobs", JobsView)
STATES: Final = frozenset(get_args(JobState))


def add_jobs_routes(app: web.Application, jobs: JobsView) -> None:
    """Register the ``/v1/jobs`` routes over the job manager."""
    app[JOBS] = jobs
    app.router.add_post("/v1/jobs", submit)
    app.router.add_get("/v1/jobs", list_jobs)
    app.router.add_get("/v1/jobs/{job_id}", get_job)
    app.router.add_delete("/v1/jobs/{job_id}", cancel)


async def submit(request: web.Request) -> web.Response:
    """Queue a job (admin token)."""
    check_admin(request)
    raw = _body(request.content_type, await request.read())
    try:
        status = await request.app[JOBS].submit(raw)
    except JobRejectedError as exc:
        message = f"invalid job: {'; '.join(exc.reasons)}"
        raise ApiError(422, "invalid_job", message, exc.reasons) from None
    except JobExistsError as exc:
        raise ApiError(409, "conflict", f"job {exc} already exists") from None
    except NotLeaderError as exc:
        raise ApiError(503, "not_leader", str(exc)) from None
    return web.json_response(_located(request, status), status=201)


async def list_jobs(request: web.Request) -> web.Response:
    """Every job's summary, oldest first; ``?state=queued,running`` filters."""
    check_read(request)
    reject_unknown_query(request, ("state",), name_allowed=False)
    wanted = {s for s in request.query.get("state", "").split(",") if s}
    if wanted - STATES:
        bad = ", ".join(sorted(wanted - STATES))
        raise ApiError(400, "bad_request", f"unknown state(s) {bad}; known: {sorted(STATES)}")
    jobs = sorted(request.app[JOBS].jobs.values(), key=_order)
    rows = [summary(s) for s in jobs if not wanted or s.state in wanted]
    return web.json_response({"jobs": rows})


async def get_job(request: web.Request) -> web.Response:
    """One job: the submitted job, state, placement, restarts, history with reasons."""
    check_read(request)
    job_id = request.match_info["job_id"]
    status = request.app[JOBS].jobs.get(job_id)
    view = request.app[JOBS]
    if status is None and _federated(view):
        found = await view.find(job_id)
        if found is not None:
            return web.json_response(detail(found[1]) | {"region": found[0]})
    if status is None:
        raise ApiError(404, "not_found", f"no job {job_id!r}")
    return web.json_response(_located(request, status))


async def cancel(request: web.Request) -> web.Response:
    """Cancel a job (admin token): a running job is stopped first; 202 with its status."""
    check_admin(request)
    view = request.app[JOBS]
    job_id = request.match_info["job_id"]
    if job_id not in view.jobs and _federated(view):  # a job of another region
        try:
            remote = await view.cancel(job_id)
        except NotLeaderError as exc:
            raise ApiError(503, "not_leader", str(exc)) from None
        if remote is None:
            raise ApiError(404, "not_found", f"no job {job_id!r} in any region that answers")
        return web.json_response(_located(request, remote), status=202)
    status = _lookup(request)
    try:
        cancelled = await view.cancel(status.job_id)
    except NotLeaderError as exc:
        raise ApiError(503, "not_leader", str(exc)) from None
    return web.json_response(_located(request, cancelled or status), status=202)


def summary(s: JobStatus) -> dict[str, Any]:
    """A job's line in ``GET /v1/jobs`` (a :class:`~shapes.JobSummary`)."""
    job = s.job
    line = JobSummary(
        id=s.job_id,
        name=job.name if job else "",
        tenant=job.tenant if job else "",
        priority=job.priority if job else 0,
        nodes=job.nodes if job else 0,
        state=s.state,
        placement=list(s.placement),
        restarts=s.restarts,
        step=max((m.step for m in s.members), default=None),
        last_checkpoint_step=s.last_checkpoint.step if s.last_checkpoint else None,
        reason=s.reason,
        updated_ts=s.updated_ts,
    )
    return dict(msgspec.to_builtins(line))


def detail(s: JobStatus) -> dict[str, Any]:
    """A job's full answer: its summary plus the whole stored status."""
    body = summary(s)
    body["status"] = to_builtins(s)
    return body


def _federated(view: JobsView) -> TypeGuard[FederatedJobsView]:
    return hasattr(view, "find") and hasattr(view, "forwarded")


def _located(request: web.Request, status: JobStatus) -> dict[str, Any]:
    """``detail(status)`` with the region that holds the job, when federated."""
    view = request.app[JOBS]
    if not _federated(view):
        return detail(status)
    return detail(status) | {"region": view.forwarded.get(status.job_id, view.region)}


def _order(s: JobStatus) -> tuple[float, str]:
    return (s.job.submitted_ts if s.job else 0.0, s.job_id)


def _lookup(request: web.Request) -> JobStatus:
    job_id = request.match_info["job_id"]
    status = request.app[JOBS].jobs.get(job_id)
    if status is None:
        raise ApiError(404, "not_found", f"no job {job_id!r}")
    return status


def _body(content_type: str, data: bytes) -> Any:
    if not data.strip():
        raise ApiError(400, "bad_request", "the body is empty: send a job")
    kind = content_type.lower()
    try:
        if kind in ("application/toml", "text/toml", "application/x-toml"):
            return parse_toml(data.decode(), "body")
        if kind == "application/json":
            return json.loads(data)
    except (DocumentError, UnicodeDecodeError, ValueError) as exc:
        raise ApiError(400, "bad_request", f"cannot read the body: {exc}") from None
    except RecursionError:
        raise ApiError(400, "bad_request", "cannot read the body: nested too deeply") from None
    raise ApiError(
        415, "unsupported_media_type", "send the job as application/json or application/toml"
    )
