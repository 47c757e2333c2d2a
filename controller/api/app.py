"""The region controller's HTTP API (aiohttp; docs/api.md).

:func:`make_app` builds the app over a :class:`ControllerView` (the RegionController
satisfies it) and an :class:`~controller.api_sse.EventSource`.  Every error is JSON,
``{"error": {"code": ..., "message": ...}}``; an unexpected exception is logged here and
answered with a bare 500, never a traceback.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Final, Protocol, cast, get_args

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from metalguard.controller.api.dashboard import add_dashboard_routes
from metalguard.controller.api.sse import (
    NEW_ONLY,
    EventFilter,
    EventSource,
    SseHub,
    parse_last_event_id,
    parse_since,
)
from metalguard.controller.core.lifecycle import OperatorAction
from metalguard.controller.core.scoring.signals import NodeSignals
from metalguard.proto.codec import to_builtins
from metalguard.proto.events import ControllerEvent
from metalguard.proto.nodes import GRADES, NodeRecord

if TYPE_CHECKING:
    from metalguard.controller.api.jobs import JobsView
    from metalguard.controller.qos import QosStore

log = logging.getLogger(__name__)

ACTIONS: Final = get_args(OperatorAction)
MAX_REASON: Final = 500
MAX_WHO: Final = 64
MAX_BODY: Final = 16 * 1024
LIST_FILTERS: Final = ("grade", "region", "cluster", "rack")
EVENT_FILTERS: Final = ("kind", "node")
EVENT_QUERY: Final = (*EVENT_FILTERS, "since")
HISTORY_QUERY: Final = (*EVENT_QUERY, "after", "limit")
HISTORY_LIMIT_MAX: Final = 10_000


class RecordSource(Protocol):
    """The node records, by handle (``NodeStore``)."""

    @property
    def records(self) -> Mapping[str, NodeRecord]: ...


class ControllerView(Protocol):
    """What the API needs of the controller (``RegionController`` satisfies it)."""

    @property
    def store(self) -> RecordSource: ...

    async def operator_action(
        self, handle: str, action: OperatorAction, reason: str, who: str
    ) -> tuple[ControllerEvent, ...]: ...

    def recent_signals(self, handle: str) -> NodeSignals | None:
        """The node's scoring history (counter samples), if any."""
        ...

    def recent_readings(self, handle: str) -> dict[str, Any]:
        """Latest readings beside the record: ``qos`` verdicts, the ``bmc`` word."""
        ...


class ApiError(Exception):
    """A client error answered as ``{"error": {"code", "message"}}`` with ``status``."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


class Tokens:
    """Bearer tokens: read-only and admin.

    No token at all: reads are open.  No admin token: every action is refused (403).
    """

    def __init__(self, read: Collection[str], admin: Collection[str]) -> None:
        self._read = tuple(t.encode() for t in read)
        self._admin = tuple(t.encode() for t in admin)

    def check(self, request: web.Request, admin: bool) -> None:
        """Raise ApiError 401/403 unless the request may proceed; a refused write is
        logged (method, path, peer, why)."""
        try:
            self._check(request, admin)
        except ApiError as exc:
            if admin:
                log.warning(
                    "refused %s %s from %s: %d %s",
                    request.method,
                    request.path,
                    request.remote or "?",
                    exc.status,
                    exc.message,
                )
            raise

    def _check(self, request: web.Request, admin: bool) -> None:
        if not admin and not self._read and not self._admin:
            return
        if admin and not self._admin:
            raise ApiError(403, "forbidden", "actions are disabled: no admin token is configured")
        given = _bearer(request)
        if given is None:
            raise ApiError(401, "unauthorized", "a bearer token is required")
        if _member(given, self._admin):
            return
        if _member(given, self._read):
            if admin:
                raise ApiError(403, "forbidden", "this action needs an admin token")
            return
        raise ApiError(401, "unauthorized", "the bearer token is not valid")


VIEW: Final = web.AppKey("view", ControllerView)
TOKENS: Final = web.AppKey("tokens", Tokens)
REGISTRIES: Final = web.AppKey("registries", tuple[CollectorRegistry, ...])
HUB: Final = web.AppKey("hub", SseHub)
CLOCK: Final = web.AppKey[Callable[[], float]]("clock")


class LeaderView(Protocol):
    """Who leads the region (controller/leader.py's Leadership)."""

    def status(self) -> dict[str, Any]: ...


LEADER: Final = web.AppKey("leader", LeaderView)


def add_leader_route(app: web.Application, leader: LeaderView) -> None:
    """``GET /v1/leader`` (and the leader fields of ``/healthz``) over ``leader``."""
    app[LEADER] = leader
    app.router.add_get("/v1/leader", leader_status)


async def leader_status(request: web.Request) -> web.Response:
    """Who leads the region: region, leader, self, term, revision, expires_in_s."""
    request.app[TOKENS].check(request, admin=False)
    return web.json_response(request.app[LEADER].status())


def make_app(
    view: ControllerView,
    events_source: EventSource,
    *,
    read_tokens: Collection[str] = (),
    admin_tokens: Collection[str] = (),
    registry: CollectorRegistry | None = None,
    keepalive_s: float = 15.0,
    event_queue_size: int = 1000,
    qos: QosStore | None = None,
    clock: Callable[[], float] = time.time,
    jobs: JobsView | None = None,
) -> web.Application:
    """The API app; ``registry`` (ingest's metrics) is exposed with the grade counts;
    ``qos`` (the MG_QOS profiles) adds the ``/v1/qos`` routes (controller/api_qos.py)."""
    app = web.Application(middlewares=[_errors], client_max_size=MAX_BODY)
    app[VIEW] = view
    app[TOKENS] = Tokens(read_tokens, admin_tokens)
    grades = CollectorRegistry()
    grades.register(GradeCollector(view))
    app[REGISTRIES] = (grades,) if registry is None else (registry, grades)
    app[HUB] = SseHub(events_source, keepalive_s, event_queue_size)
    app[CLOCK] = clock
    app.on_shutdown.append(_close_streams)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/nodes", list_nodes)
    app.router.add_get("/v1/nodes/{node}", get_node)
    app.router.add_post(f"/v1/nodes/{{node}}/{{action:{'|'.join(ACTIONS)}}}", act)
    app.router.add_get("/v1/events", events)
    app.router.add_get("/v1/events/history", event_history)
    add_dashboard_routes(app)  # the fleet dashboard: /, /ui/ (controller/api_dashboard.py)
    if qos is not None:
        from metalguard.controller.api.qos import add_qos_routes  # it imports this module

        add_qos_routes(app, qos)
    if jobs is not None:  # the job manager: /v1/jobs (controller/api_jobs.py)
        from metalguard.controller.api.jobs import add_jobs_routes  # it imports this module

        add_jobs_routes(app, jobs)
    return app


async def _close_streams(app: web.Application) -> None:
    await app[HUB].close()


# --- handlers -------------------------------------------------------------------------


async def healthz(request: web.Request) -> web.Response:
    """Liveness: the process serves HTTP; with HA, who leads."""
    body: dict[str, Any] = {"status": "ok"}
    leader = request.app.get(LEADER)
    if leader is not None:
        status = leader.status()
        body |= {k: status[k] for k in ("leading", "leader", "region", "self") if k in status}
    return web.json_response(body)


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text exposition of every registry."""
    body = b"".join(generate_latest(r) for r in request.app[REGISTRIES])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def list_nodes(request: web.Request) -> web.Response:
    """The nodes, filtered by grade (comma-separated), region, cluster, rack."""
    request.app[TOKENS].check(request, admin=False)
    query = _query(request, LIST_FILTERS)
    grades = _grades(query.get("grade", ""))
    where = {k: v for k, v in query.items() if k != "grade"}
    records = request.app[VIEW].store.records
    nodes = [
        summary(handle, r)
        for handle, r in sorted(records.items())
        if (not grades or r.grade in grades) and all(_field(r, k) == v for k, v in where.items())
    ]
    return web.json_response({"nodes": nodes})


async def get_node(request: web.Request) -> web.Response:
    """One node's full record (score, grade, reasons, operator state, grade history), its
    recent signals (each counter's samples ``[ts, value]`` and resets), the QoS verdicts
    of its newest batch and its BMC's newest out-of-band word."""
    request.app[TOKENS].check(request, admin=False)
    view = request.app[VIEW]
    handle, record = _lookup(view.store.records, request.match_info["node"])
    history = view.recent_signals(handle)
    signals = {
        key: {"samples": [list(s) for s in h.samples], "resets": h.resets}
        for key, h in (history.counters.items() if history else ())
    }
    body = {"handle": handle, "record": to_builtins(record), "signals": signals}
    return web.json_response(body | view.recent_readings(handle))


async def act(request: web.Request) -> web.Response:
    """An operator's cordon, uncordon or maintenance (admin token)."""
    request.app[TOKENS].check(request, admin=True)
    leader = request.app.get(LEADER)
    if leader is not None and not (status := leader.status()).get("leading", True):
        where = status.get("leader") or "unknown (no leader right now)"
        raise ApiError(
            503,
            "not_leader",
            f"this controller follows; operator actions go to the leader: {where}",
        )
    view = request.app[VIEW]
    handle, _ = _lookup(view.store.records, request.match_info["node"])
    reason, who = await _action_body(request)
    action = cast(OperatorAction, request.match_info["action"])  # the route allows ACTIONS
    try:
        announced = await view.operator_action(handle, action, reason, who)
    except KeyError:
        raise ApiError(404, "not_found", f"unknown node {handle!r}") from None
    record = view.store.records[handle]
    return web.json_response(
        {
            "handle": handle,
            "action": action,
            "events": [to_builtins(e) for e in announced],
            "record": to_builtins(record),
        }
    )


async def events(request: web.Request) -> web.StreamResponse:
    """SSE stream of ControllerEvents, filtered by ``kind`` and ``node``; from ``since``
    (or just after the ``Last-Event-ID`` header's stream sequence), else new ones only."""
    request.app[TOKENS].check(request, admin=False)
    query = _query(request, EVENT_QUERY)
    since = query.pop("since", "")
    last_id = request.headers.get("Last-Event-ID", "")
    try:
        if last_id:
            start = parse_last_event_id(last_id)
        elif since:
            start = parse_since(since, request.app[CLOCK]())
        else:
            start = NEW_ONLY
    except ValueError as exc:
        raise ApiError(400, "bad_request", str(exc)) from None
    return await request.app[HUB].stream(request, EventFilter(**query), start)


async def event_history(request: web.Request) -> web.Response:
    """Kept ControllerEvents as JSON, oldest first: from ``since`` (default ``1h``) or
    after the stream sequence ``after``; at most ``limit`` (default 1000)."""
    request.app[TOKENS].check(request, admin=False)
    query = _query(request, HISTORY_QUERY)
    limit_text = query.pop("limit", "1000")
    after, since = query.pop("after", ""), query.pop("since", "1h")
    if not limit_text.isdigit() or not 1 <= int(limit_text) <= HISTORY_LIMIT_MAX:
        raise ApiError(400, "bad_request", f"limit: {limit_text!r} is not 1-{HISTORY_LIMIT_MAX}")
    try:
        start = parse_last_event_id(after) if after else parse_since(since, request.app[CLOCK]())
    except ValueError as exc:
        raise ApiError(400, "bad_request", str(exc).replace("Last-Event-ID", "after")) from None
    keep = EventFilter(**query)
    found, more = await request.app[HUB].source.history(start, int(limit_text))
    kept = [(e, seq) for e, seq in found if keep(e)]
    return web.json_response(
        {
            "events": [to_builtins(e) | {"seq": seq} for e, seq in kept],
            "last_seq": found[-1][1] if found else None,
            "more": more,
        }
    )


def summary(handle: str, r: NodeRecord) -> dict[str, Any]:
    """A node's line in ``GET /v1/nodes``."""
    return {
        "handle": handle,
        "region": r.node.region,
        "cluster": r.node.cluster,
        "node": r.node.node,
        "rack": r.rack,
        "grade": r.grade,
        "score": r.score,
        "cordoned": r.cordoned,
        "maintenance": r.maintenance,
        "held": r.held,
        "last_seen_ts": r.last_seen_ts,
        "reasons": [to_builtins(x) for x in r.reasons],
    }


class GradeCollector(Collector):
    """``metalguard_nodes{grade}`` and ``metalguard_nodes_cordoned``, read at scrape."""

    def __init__(self, view: ControllerView) -> None:
        self._view = view

    def collect(self) -> Iterator[GaugeMetricFamily]:
        records = self._view.store.records.values()
        by_grade = GaugeMetricFamily("metalguard_nodes", "Nodes by grade", labels=["grade"])
        for grade in GRADES:
            by_grade.add_metric([grade], sum(1 for r in records if r.grade == grade))
        yield by_grade
        yield GaugeMetricFamily(
            "metalguard_nodes_cordoned",
            "Nodes cordoned or in maintenance by an operator",
            value=sum(1 for r in records if r.cordoned),
        )


# --- helpers --------------------------------------------------------------------------

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """ApiError and HTTP errors as JSON; anything else a logged, bare 500."""
    try:
        return await handler(request)
    except ApiError as exc:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return _error(exc.status, exc.code, exc.message, headers)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = exc.reason.lower().replace(" ", "_")
        return _error(exc.status, code, exc.reason)
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        return _error(500, "internal", "internal error (logged by the controller)")


def _error(
    status: int, code: str, message: str, headers: Mapping[str, str] | None = None
) -> web.Response:
    body = {"error": {"code": code, "message": message}}
    return web.json_response(body, status=status, headers=headers)


def _bearer(request: web.Request) -> bytes | None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip().encode()


def _member(token: bytes, tokens: tuple[bytes, ...]) -> bool:
    found = False
    for t in tokens:  # no early exit: the time taken does not tell which one matched
        found |= hmac.compare_digest(token, t)
    return found


def _query(request: web.Request, allowed: tuple[str, ...]) -> dict[str, str]:
    unknown = sorted(set(request.query) - set(allowed))
    if unknown:
        raise ApiError(
            400,
            "bad_request",
            f"unknown query parameter(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}",
        )
    return {k: request.query[k] for k in allowed if request.query.get(k)}


def _grades(text: str) -> set[str]:
    wanted = {g.strip().upper() for g in text.split(",") if g.strip()}
    bad = sorted(wanted - set(GRADES))
    if bad:
        raise ApiError(
            400, "bad_request", f"unknown grade {', '.join(bad)}; valid: {', '.join(GRADES)}"
        )
    return wanted


def _field(r: NodeRecord, name: str) -> str:
    return r.rack if name == "rack" else str(getattr(r.node, name))


def _lookup(records: Mapping[str, NodeRecord], name: str) -> tuple[str, NodeRecord]:
    """A node by handle, or by bare name when only one node has it."""
    record = records.get(name)
    if record is not None:
        return name, record
    matches = [(h, r) for h, r in records.items() if r.node.node == name]
    if not matches:
        raise ApiError(404, "not_found", f"unknown node {name!r}")
    if len(matches) > 1:
        handles = ", ".join(sorted(h for h, _ in matches))
        raise ApiError(409, "ambiguous", f"node name {name!r} matches {handles}; use the handle")
    return matches[0]


async def _action_body(request: web.Request) -> tuple[str, str]:
    """``reason`` (required) and ``who`` (default ``api``) from a JSON body."""
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ApiError(400, "bad_request", "the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise ApiError(400, "bad_request", 'the body must be a JSON object {"reason": ...}')
    reason = body.get("reason")
    who = body.get("who", "api")
    if not isinstance(reason, str) or not reason.strip():
        raise ApiError(400, "bad_request", "reason is required (a non-empty string)")
    if len(reason) > MAX_REASON:
        raise ApiError(400, "bad_request", f"reason is longer than {MAX_REASON} characters")
    if not isinstance(who, str) or not who.strip() or len(who) > MAX_WHO:
        raise ApiError(400, "bad_request", f"who must be a string of 1 to {MAX_WHO} characters")
    return reason.strip(), who.strip()
