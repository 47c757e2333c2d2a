"""The HTTP API's OpenAPI 3.1 document (docs/api.md), served at ``GET /v1/openapi.json``.

:data:`OPERATIONS` lists every route the controller can serve, with its parameters,
request body, answers and who may call it; the schemas come from the msgspec types the
handlers answer with (controller/api/shapes.py and the wire messages in proto/), through
``msgspec.json.schema_components``.  :func:`document` builds the document, restricted to
the routes an app actually has (``/v1/qos`` only with a QoS store, ``/v1/leader`` with
HA, ...): :func:`routes_of` walks the app's route table, and a test fails when a route
has no operation here.  The document is open (no token), like ``/healthz``: it holds no
data of the fleet.
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Final, Literal, get_args

import msgspec
from aiohttp import web

from metalguard import __version__
from metalguard.controller.api import shapes
from metalguard.controller.api.node_index import MAX_LIMIT, STATES
from metalguard.controller.api.sse import MAX_SEQ
from metalguard.controller.jobs.spec import DATASET_PATTERN
from metalguard.controller.provision.spec import SwitchRequest
from metalguard.proto.events import ControllerEvent
from metalguard.proto.jobs import Job
from metalguard.proto.nodes import GRADES
from metalguard.proto.provision import Image, InstanceRequest, InstanceState
from metalguard.proto.qos import QosProfile

OPENAPI_PATH: Final = "/v1/openapi.json"
REF: Final = "#/components/schemas/{name}"
Auth = Literal["open", "read", "admin"]
Route = tuple[str, str]
"""(method, path template), e.g. ``("GET", "/v1/nodes/{node}")``."""

JSON: Final = "application/json"
TOML_TYPES: Final = ("application/toml", "text/toml")
JOB_ID_PATTERN: Final = r"^[A-Za-z0-9_-]{1,64}$"
HISTORY_LIMIT_MAX: Final = 10_000


@dataclass(frozen=True)
class Param:
    """A path, query or header parameter."""

    name: str
    where: Literal["path", "query", "header"]
    description: str
    schema: dict[str, Any] = field(default_factory=lambda: {"type": "string"})
    example: str | None = None


@dataclass(frozen=True)
class Operation:
    """One route: its method, path, who may call it, parameters, body and answers.

    ``answers`` maps a status to the type of its JSON body (a msgspec type), a media type
    name (a non-JSON body), or None (no body); errors are added from ``errors``.
    """

    method: str
    path: str
    summary: str
    auth: Auth
    answers: Mapping[int, Any]
    errors: tuple[int, ...] = ()
    params: tuple[Param, ...] = ()
    body: Mapping[str, dict[str, Any]] | None = None
    """Media type -> its OpenAPI media type object (``schema``, ``example``) of the
    request body (required when given)."""
    tag: str = "api"


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": REF.format(name=name)}


NODE = Param("node", "path", "a handle `region.cluster.node`, or a bare node name", example="n3")
JOB_ID = Param("job_id", "path", "the job's id", example="j-000000000000")
KV_NAME = {"type": "string", "pattern": "^[A-Za-z0-9_=-]{1,128}$"}
CLUSTER = Param("cluster", "path", "a cluster name (letters, digits, -, _, =)", KV_NAME, "c1")
QOS_NODE = Param("node", "path", "a node name (letters, digits, -, _, =)", KV_NAME, "n1")
KIND = Param("kind", "query", "an exact kind (`node.isolated`) or a prefix ending in `.`")
EVENT_NODE = Param("node", "query", "a handle or a bare node name")
SINCE = Param(
    "since",
    "query",
    "`all`, a duration back from now (`90s`, `10m`, `2h`, `1d`), an RFC 3339 time with a"
    " zone, or Unix seconds",
)
HISTORY = Param("history", "query", "`1`, `true` or `yes`: add the kept revisions")
OPERATOR_BODY: Final[dict[str, dict[str, Any]]] = {
    JSON: {"schema": _ref("OperatorRequest"), "example": {"reason": "DIMM swap"}}
}
JOB_EXAMPLE = {"name": "llm-small", "nodes": 2, "command": "python", "args": ["train.py"]}
JOB_BODY: Final[dict[str, dict[str, Any]]] = {
    JSON: {"schema": _ref("JobRequest"), "example": JOB_EXAMPLE},
    **{
        t: {"schema": {"type": "string"}, "example": 'name = "llm-small"\ncommand = "python"\n'}
        for t in TOML_TYPES
    },
}
PROFILE_EXAMPLE = {
    "version": 1,
    "pfc_priorities": [3],
    "traffic_class": [
        {"name": "default", "priorities": [0, 1, 2, 4, 5, 6, 7], "bandwidth_percent": 60},
        {"name": "training", "priorities": [3], "bandwidth_percent": 40},
    ],
}
TENANT = Param("tenant", "path", "a tenant's name", {"type": "string", "maxLength": 128}, "team-a")
QUOTA_BODY: Final[dict[str, dict[str, Any]]] = {
    JSON: {
        "schema": _ref("QuotaBody"),
        "example": {"gpus": 64, "borrow_limit": 128, "gpus_by_type": {"nvidia-h100": 64}},
    }
}
PROFILE_BODY: Final[dict[str, dict[str, Any]]] = {
    JSON: {"schema": _ref("QosProfileRequest"), "example": PROFILE_EXAMPLE},
    **{t: {"schema": {"type": "string"}, "example": "version = 2\n"} for t in TOML_TYPES},
}

IMAGE_NAME_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
IMAGE = Param(
    "name",
    "path",
    "an image's name",
    {"type": "string", "pattern": IMAGE_NAME_PATTERN},
    "base-2026",
)
INSTANCE = Param(
    "instance_id",
    "path",
    "an instance's id",
    {"type": "string", "pattern": r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$"},
    "i-000000000000",
)
VOLUME = Param(
    "name",
    "path",
    "a volume's name",
    {"type": "string", "pattern": r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"},
    "acme-i-000000000000",
)
BOOL = {"type": "string", "enum": ["true", "false", "1", "0", "yes", "no"]}
WAIT = Param(
    "wait",
    "query",
    "`true`: answer once the instance is active, released or failed (at most 600 s)",
    BOOL,
)
IMAGE_BODY: Final[dict[str, dict[str, Any]]] = {
    JSON: {
        "schema": _ref("ImageBuild"),
        "example": {"name": "base", "directory": "/srv/images/base", "size_bytes": 268435456},
    },
    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
}
INSTANCE_BODY: Final[dict[str, dict[str, Any]]] = {
    JSON: {
        "schema": _ref("InstanceRequestBody"),
        "example": {"tenant": "acme", "image": "base", "node": "r1.c1.n1"},
    }
}
SWITCH_BODY: Final[dict[str, dict[str, Any]]] = {
    JSON: {"schema": _ref("SwitchBody"), "example": {"tenant": "globex", "image": "base"}}
}
REPLACE_BODY: Final[dict[str, dict[str, Any]]] = {
    JSON: {"schema": {"type": "object", "additionalProperties": False}, "example": {}}
}
"""The body of a POST that takes none: an empty object (or no body at all)."""
PROVISION_ERRORS: Final = (400, 401, 403, 404, 409, 413, 415, 502, 503, 504)

OPERATIONS: Final[tuple[Operation, ...]] = (
    Operation("GET", "/healthz", "Liveness; with HA, who leads", "open", {200: shapes.Health}),
    Operation(
        "GET", "/metrics", "Prometheus text exposition", "open", {200: "text/plain"}, tag="metrics"
    ),
    Operation(
        "GET",
        OPENAPI_PATH,
        "This document (OpenAPI 3.1)",
        "open",
        {200: dict[str, Any]},
        tag="meta",
    ),
    Operation(
        "GET",
        "/v1/leader",
        "Who leads the region (HA)",
        "read",
        {200: shapes.LeaderAnswer},
        (401,),
        tag="leader",
    ),
    Operation(
        "GET",
        "/v1/nodes",
        "The nodes, sorted by handle, filtered and paged",
        "read",
        {200: shapes.NodeList},
        (400, 401),
        (
            Param(
                "grade",
                "query",
                f"grades, comma-separated, case-insensitive: {', '.join(GRADES)}",
                example="FAILING,UNREACHABLE",
            ),
            Param(
                "state",
                "query",
                f"operator states, comma-separated: {', '.join(STATES)}",
                example="cordoned",
            ),
            Param("region", "query", "exact match"),
            Param("cluster", "query", "exact match"),
            Param("rack", "query", "exact match"),
            Param(
                "limit",
                "query",
                f"at most this many nodes (1-{MAX_LIMIT}); without it, every match",
                {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT},
                "500",
            ),
            Param("cursor", "query", "the previous page's `next`, as is"),
        ),
        tag="nodes",
    ),
    Operation(
        "GET",
        "/v1/summary",
        "Grade counts of the region and per cluster or rack (the dashboard's large heatmap)",
        "read",
        {200: shapes.FleetSummary},
        (400, 401),
        (
            Param(
                "by",
                "query",
                "`rack` (default) or `cluster`",
                {"type": "string", "enum": ["rack", "cluster"]},
                "rack",
            ),
            Param("region", "query", "exact match"),
            Param("cluster", "query", "exact match"),
        ),
        tag="nodes",
    ),
    Operation(
        "GET",
        "/v1/nodes/{node}",
        "One node: record, signals, QoS verdicts, scores, BMC word",
        "read",
        {200: shapes.NodeDetail},
        (401, 404, 409),
        (NODE,),
        tag="nodes",
    ),
    Operation(
        "POST",
        "/v1/nodes/{node}/{action}",
        "An operator's cordon, uncordon or maintenance",
        "admin",
        {200: shapes.ActionAnswer},
        (400, 401, 403, 404, 409, 413, 503),
        (
            NODE,
            Param(
                "action",
                "path",
                "the action",
                {"type": "string", "enum": ["cordon", "uncordon", "maintenance"]},
            ),
        ),
        OPERATOR_BODY,
        tag="nodes",
    ),
    Operation(
        "GET",
        "/v1/nodes/by-uuid/{uuid}",
        "A node of any region, by its UUID (federation)",
        "read",
        {200: shapes.NodeByUuid},
        (400, 401, 404),
        (Param("uuid", "path", "the node's UUID", {"type": "string", "maxLength": 128}),),
        tag="fleet",
    ),
    Operation(
        "GET",
        "/v1/fleet",
        "Every region's summary (federation)",
        "read",
        {200: shapes.FleetAnswer},
        (401,),
        tag="fleet",
    ),
    Operation(
        "GET",
        "/v1/events",
        "Server-Sent Events: the region's ControllerEvents, live (after the past asked for)",
        "read",
        {200: "text/event-stream"},
        (400, 401),
        (
            KIND,
            EVENT_NODE,
            SINCE,
            Param(
                "Last-Event-ID",
                "header",
                "resume just after this stream sequence (wins over `since`)",
                {"type": "string", "pattern": "^[0-9]+$"},
            ),
        ),
        tag="events",
    ),
    Operation(
        "GET",
        "/v1/events/history",
        "The kept ControllerEvents as JSON, oldest first",
        "read",
        {200: shapes.EventPage},
        (400, 401),
        (
            Param("since", "query", SINCE.description + "; default `1h`"),
            Param(
                "after",
                "query",
                "a stream sequence: the events after it (the next page)",
                {"type": "integer", "minimum": 0, "maximum": MAX_SEQ},
            ),
            Param(
                "limit",
                "query",
                f"at most this many events read, 1-{HISTORY_LIMIT_MAX} (default 1000)",
                {"type": "integer", "minimum": 1, "maximum": HISTORY_LIMIT_MAX},
            ),
            KIND,
            EVENT_NODE,
        ),
        tag="events",
    ),
    Operation(
        "POST",
        "/v1/jobs",
        "Queue a training job (JSON or TOML; docs/jobs.md)",
        "admin",
        {201: shapes.JobDetail},
        (400, 401, 403, 409, 413, 415, 422, 503),
        body=JOB_BODY,
        tag="jobs",
    ),
    Operation(
        "GET",
        "/v1/jobs",
        "Every job's summary, oldest first",
        "read",
        {200: shapes.JobList},
        (400, 401),
        (Param("state", "query", "job states, comma-separated", example="queued,running"),),
        tag="jobs",
    ),
    Operation(
        "GET",
        "/v1/jobs/{job_id}",
        "One job: its summary and stored status",
        "read",
        {200: shapes.JobDetail},
        (401, 404),
        (JOB_ID,),
        tag="jobs",
    ),
    Operation(
        "DELETE",
        "/v1/jobs/{job_id}",
        "Cancel a job (a running one is stopped first)",
        "admin",
        {202: shapes.JobDetail},
        (401, 403, 404, 503),
        (JOB_ID,),
        tag="jobs",
    ),
    Operation(
        "GET",
        "/v1/qos",
        "Every cluster's QoS view: profile version, congestion, degraded nodes",
        "read",
        {200: shapes.QosFleetAnswer},
        (400, 401),
        tag="qos",
    ),
    Operation(
        "GET",
        "/v1/qos/{cluster}",
        "A cluster's QoS profile and its KV revision",
        "read",
        {200: shapes.ProfileAnswer},
        (400, 401, 404),
        (CLUSTER, HISTORY),
        tag="qos",
    ),
    Operation(
        "PUT",
        "/v1/qos/{cluster}",
        "Store a new version of a cluster's QoS profile",
        "admin",
        {200: shapes.ProfileAnswer},
        (400, 401, 403, 409, 413, 415, 422),
        (CLUSTER,),
        PROFILE_BODY,
        tag="qos",
    ),
    Operation(
        "GET",
        "/v1/qos/{cluster}/nodes/{node}",
        "What a node applies: its override, else its cluster's profile",
        "read",
        {200: shapes.ProfileAnswer},
        (400, 401, 404),
        (CLUSTER, QOS_NODE, HISTORY),
        tag="qos",
    ),
    Operation(
        "PUT",
        "/v1/qos/{cluster}/nodes/{node}",
        "Store a new version of one node's QoS override",
        "admin",
        {200: shapes.ProfileAnswer},
        (400, 401, 403, 409, 413, 415, 422),
        (CLUSTER, QOS_NODE),
        PROFILE_BODY,
        tag="qos",
    ),
    Operation(
        "GET",
        "/v1/tenants",
        "Every tenant with a quota or a job: guarantee, in use, borrowed, lent, waiting",
        "read",
        {200: shapes.TenantList},
        (400, 401),
        tag="tenants",
    ),
    Operation(
        "GET",
        "/v1/tenants/{tenant}",
        "One tenant's usage and quota",
        "read",
        {200: shapes.TenantAnswer},
        (400, 401, 404),
        (TENANT,),
        tag="tenants",
    ),
    Operation(
        "PUT",
        "/v1/tenants/{tenant}",
        "Set a tenant's quota (guarantee, per-type guarantees, borrow and lend limits)",
        "admin",
        {200: shapes.TenantAnswer},
        (400, 401, 403, 409, 413, 415, 503),
        (TENANT,),
        QUOTA_BODY,
        tag="tenants",
    ),
    Operation(
        "GET",
        "/v1/images",
        "The region's base images, by name",
        "read",
        {200: shapes.ImageList},
        (400, 401),
        tag="provisioning",
    ),
    Operation(
        "POST",
        "/v1/images",
        "Add a base image: build one from a directory of the storage host (JSON), or"
        " upload a qcow2 or raw file (`application/octet-stream`, `?name=`)",
        "admin",
        {201: Image},
        (400, 401, 403, 409, 413, 415, 502, 503),
        (
            Param(
                "name",
                "query",
                "with an uploaded file: the image's name",
                {"type": "string", "pattern": IMAGE_NAME_PATTERN},
            ),
        ),
        IMAGE_BODY,
        tag="provisioning",
    ),
    Operation(
        "GET",
        "/v1/images/{name}",
        "One base image: format, sizes, checksum, source",
        "read",
        {200: Image},
        (401, 404),
        (IMAGE,),
        tag="provisioning",
    ),
    Operation(
        "DELETE",
        "/v1/images/{name}",
        "Remove a base image no volume is made from",
        "admin",
        {200: Image},
        (401, 403, 404, 409, 502, 503),
        (IMAGE,),
        tag="provisioning",
    ),
    Operation(
        "GET",
        "/v1/instances",
        "Every instance (a tenant's node), oldest first, filtered",
        "read",
        {200: shapes.InstanceList},
        (400, 401),
        (
            Param(
                "state",
                "query",
                f"states, comma-separated: {', '.join(get_args(InstanceState))}",
                example="active,deploying",
            ),
            Param("tenant", "query", "exact match"),
            Param("node", "query", "a node handle, exact match"),
            Param("image", "query", "exact match"),
        ),
        tag="provisioning",
    ),
    Operation(
        "POST",
        "/v1/instances",
        "Deploy an instance: boot a node from the network on a tenant volume (202 while it"
        " deploys; 201 with `wait` once it is active or failed)",
        "admin",
        {201: shapes.InstanceAnswer, 202: shapes.InstanceAnswer},
        PROVISION_ERRORS,
        (WAIT,),
        INSTANCE_BODY,
        tag="provisioning",
    ),
    Operation(
        "GET",
        "/v1/instances/{instance_id}",
        "One instance: state, node, tenant, image, volume, history with reasons",
        "read",
        {200: shapes.InstanceAnswer},
        (400, 401, 404),
        (INSTANCE,),
        tag="provisioning",
    ),
    Operation(
        "DELETE",
        "/v1/instances/{instance_id}",
        "Release an instance: power the node off, remove its export, free the node",
        "admin",
        {200: shapes.InstanceAnswer, 202: shapes.InstanceAnswer},
        (400, 401, 403, 404, 409, 502, 503, 504),
        (
            INSTANCE,
            Param("keep_volume", "query", "`false`: also delete the volume (default true)", BOOL),
            WAIT,
        ),
        tag="provisioning",
    ),
    Operation(
        "POST",
        "/v1/instances/{instance_id}/switch",
        "Give the instance's node to another tenant: detach, attach, network boot",
        "admin",
        {200: shapes.InstanceAnswer, 202: shapes.InstanceAnswer},
        PROVISION_ERRORS,
        (INSTANCE, WAIT),
        SWITCH_BODY,
        tag="provisioning",
    ),
    Operation(
        "POST",
        "/v1/instances/{instance_id}/replace",
        "Boot a replacement node on the instance's volume (its node failed)",
        "admin",
        {200: shapes.InstanceAnswer, 202: shapes.InstanceAnswer},
        PROVISION_ERRORS,
        (INSTANCE, WAIT),
        REPLACE_BODY,
        tag="provisioning",
    ),
    Operation(
        "GET",
        "/v1/volumes",
        "The tenants' copy-on-write volumes, by name",
        "read",
        {200: shapes.VolumeList},
        (400, 401),
        (Param("tenant", "query", "exact match"),),
        tag="provisioning",
    ),
    Operation(
        "DELETE",
        "/v1/volumes/{name}",
        "Delete a volume no live instance boots (its data is gone)",
        "admin",
        {200: shapes.VolumeLine},
        (400, 401, 403, 404, 409, 502, 503),
        (VOLUME,),
        tag="provisioning",
    ),
    Operation(
        "GET",
        "/v1/provision/nodes",
        "The nodes provisioning may deploy: MAC, state, instance, tenant, failures, flag",
        "read",
        {200: shapes.ProvisionNodeList},
        (400, 401),
        tag="provisioning",
    ),
    Operation(
        "POST",
        "/v1/provision/nodes/{node}/clear",
        "Clear a node flagged after failed deploys (it is deployed again)",
        "admin",
        {200: shapes.ProvisionNodeLine},
        (400, 401, 403, 404, 409, 413, 503),
        (Param("node", "path", "a node handle `region.cluster.node`", example="r1.c1.n1"),),
        REPLACE_BODY,
        tag="provisioning",
    ),
    Operation("GET", "/", "Redirect to the dashboard", "open", {302: None}, tag="dashboard"),
    Operation("GET", "/ui", "Redirect to the dashboard", "open", {302: None}, tag="dashboard"),
    Operation("GET", "/ui/", "The dashboard's page", "open", {200: "text/html"}, tag="dashboard"),
    Operation(
        "GET",
        "/ui/static/{filename}",
        "The dashboard's script and stylesheet",
        "open",
        {200: "*/*"},
        (403, 404),
        (Param("filename", "path", "a file of controller/api/static/", example="app.js"),),
        tag="dashboard",
    ),
)

ERRORS: Final = {
    400: "a bad request: unknown query parameter, bad filter, malformed or invalid body",
    401: "no bearer token, or not a known one (`WWW-Authenticate: Bearer`)",
    403: "a read token on an action, or no admin token configured",
    404: "unknown resource",
    409: (
        "a conflict: an ambiguous node name, a taken job id, a QoS version not above the"
        " stored, a node or name already taken, a volume or image in use, an instance in"
        " another state"
    ),
    413: "a body over its limit: 16 KiB (instance requests 80 KiB, image files 64 GiB)",
    415: "a body of another content type than those listed",
    422: "an invalid document: `reasons` lists every problem",
    500: "a bug, logged by the controller with its traceback",
    502: "the node's BMC or the storage did not do what was asked (the message says which)",
    503: "this controller follows: actions go to the leader (`not_leader`)",
    504: "the node's BMC did not answer in time",
}

SECURITY: Final[dict[str, list[dict[str, list[str]]]]] = {
    "open": [],
    "read": [{"readToken": []}, {"adminToken": []}],
    "admin": [{"adminToken": []}],
}


def routes_of(app: web.Application) -> frozenset[Route]:
    """Every (method, path template) the app's router serves; HEAD (aiohttp answers it
    for every GET) and handlers marked ``openapi_hidden`` (what a part that is not
    configured answers, e.g. provisioning's "not enabled") left out, a static folder as
    ``<prefix>/{filename}``."""
    out = set()
    for route in app.router.routes():
        if route.method == "HEAD" or getattr(route.handler, "openapi_hidden", False):
            continue
        info = route.resource.get_info() if route.resource is not None else {}
        path = info.get("path") or info.get("formatter")
        if path is None and "prefix" in info:
            path = f"{info['prefix']}/{{filename}}"
        if path is not None:
            out.add((route.method, str(path)))
    return frozenset(out)


def operation_routes() -> frozenset[Route]:
    """Every (method, path) that has an operation in :data:`OPERATIONS`."""
    return frozenset((op.method, op.path) for op in OPERATIONS)


@lru_cache(maxsize=8)
def document(routes: frozenset[Route] | None = None) -> dict[str, Any]:
    """The OpenAPI 3.1 document: every operation, or those of ``routes`` only.

    Cached per set of routes: treat the answer as read-only (:func:`document_copy`)."""
    ops = [op for op in OPERATIONS if routes is None or (op.method, op.path) in routes]
    paths: dict[str, dict[str, Any]] = {}
    for op in ops:
        paths.setdefault(op.path, {})[op.method.lower()] = _operation(op)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "metalguard region controller",
            "version": __version__,
            "description": (
                "The region controller's HTTP API (docs/api.md). Every error is a JSON body"
                ' `{"error": {"code", "message"}}`. Reads take a read or an admin token'
                " (open when no token is configured at all), actions an admin token."
            ),
        },
        "paths": paths,
        "components": {
            "schemas": _schemas(),
            "securitySchemes": {
                "readToken": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "a read-only token (http.read_tokens_file)",
                },
                "adminToken": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "an admin token (http.admin_tokens_file): read and act",
                },
            },
        },
    }


def document_copy(routes: Collection[Route] | None = None) -> dict[str, Any]:
    """A private copy of :func:`document` (for callers that change it)."""
    return copy.deepcopy(document(None if routes is None else frozenset(routes)))


def add_openapi_route(app: web.Application) -> None:
    """Register ``GET /v1/openapi.json`` (open)."""
    app.router.add_get(OPENAPI_PATH, serve_openapi)


async def serve_openapi(request: web.Request) -> web.Response:
    """The document for the routes this app serves."""
    body = _encoded(routes_of(request.app))
    return web.Response(body=body, content_type=JSON)


@lru_cache(maxsize=8)
def _encoded(routes: frozenset[Route]) -> bytes:
    return msgspec.json.encode(document(routes))


def _operation(op: Operation) -> dict[str, Any]:
    out: dict[str, Any] = {
        "operationId": _operation_id(op),
        "summary": op.summary,
        "tags": [op.tag],
        "security": SECURITY[op.auth],
    }
    if op.params:
        out["parameters"] = [_param(p) for p in op.params]
    if op.body is not None:
        out["requestBody"] = {
            "required": True,
            "content": dict(op.body),
        }
    responses: dict[str, Any] = {}
    for status, kind in op.answers.items():
        responses[str(status)] = _answer(status, kind)
    errors = set(op.errors) | {500}
    if op.auth == "admin":
        errors |= {401, 403}
    for status in sorted(errors):
        responses[str(status)] = {
            "description": ERRORS[status],
            "content": {JSON: {"schema": _ref("ErrorBody")}},
        }
    out["responses"] = responses
    return out


def _operation_id(op: Operation) -> str:
    words = [w.strip("{}") for w in op.path.strip("/").replace(".", "_").split("/") if w]
    return "_".join([op.method.lower(), *words]) or op.method.lower()


def _param(p: Param) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": p.name,
        "in": p.where,
        "required": p.where == "path",
        "description": p.description,
        "schema": p.schema,
    }
    if p.example is not None:
        out["example"] = p.example
    return out


def _answer(status: int, kind: Any) -> dict[str, Any]:
    description = "redirect" if 300 <= status < 400 else "done"
    if kind is None:
        return {"description": description}
    if isinstance(kind, str):
        return {"description": description, "content": {kind: {"schema": {"type": "string"}}}}
    return {"description": description, "content": {JSON: {"schema": _schema_ref(kind)}}}


def _schema_ref(kind: Any) -> dict[str, Any]:
    (schema,), _ = msgspec.json.schema_components([kind], ref_template=REF)
    return schema


ANSWER_TYPES: Final = (
    shapes.ErrorBody,
    shapes.Health,
    shapes.LeaderAnswer,
    shapes.NodeList,
    shapes.NodeDetail,
    shapes.OperatorRequest,
    shapes.ActionAnswer,
    shapes.NodeByUuid,
    shapes.FleetAnswer,
    shapes.EventPage,
    shapes.JobList,
    shapes.JobDetail,
    shapes.ProfileAnswer,
    shapes.QosFleetAnswer,
    shapes.TenantList,
    shapes.TenantAnswer,
    shapes.QuotaBody,
    shapes.ImageList,
    shapes.ImageBuild,
    shapes.InstanceList,
    shapes.InstanceAnswer,
    shapes.VolumeList,
    shapes.VolumeLine,
    shapes.ProvisionNodeList,
    shapes.ProvisionNodeLine,
    ControllerEvent,
    Job,
    QosProfile,
    Image,
    InstanceRequest,
    SwitchRequest,
)


@lru_cache(maxsize=1)
def _schemas() -> dict[str, Any]:
    _, components = msgspec.json.schema_components(ANSWER_TYPES, ref_template=REF)
    # history answers: each event with its stream sequence
    page = components["EventPage"]["properties"]["events"]
    page["items"] = {
        "allOf": [
            _ref("ControllerEvent"),
            {"type": "object", "properties": {"seq": {"type": "integer"}}, "required": ["seq"]},
        ]
    }
    components["JobRequest"] = _job_request(components["Job"])
    components["QosProfileRequest"] = _profile_request(components["QosProfile"])
    components["InstanceRequestBody"] = _body_of(
        components.pop("InstanceRequest"),
        "InstanceRequestBody",
        "An instance request (docs/provisioning.md): `node` and `volume` optional.",
    )
    components["SwitchBody"] = _body_of(
        components.pop("SwitchRequest"),
        "SwitchBody",
        "A tenant switch: the tenant and image the node boots next (docs/provisioning.md).",
    )
    return components


def _body_of(schema: dict[str, Any], title: str, description: str) -> dict[str, Any]:
    """A request body's schema from its msgspec type's: no ``type`` tag nor ``v``, no
    unknown keys (the handlers refuse them)."""
    out = copy.deepcopy(schema)
    out["title"] = title
    out["description"] = description
    for key in ("type", "v"):
        out["properties"].pop(key, None)
    out["required"] = [k for k in out.get("required", []) if k not in ("type", "v")]
    out["additionalProperties"] = False
    return out


def _job_request(job: dict[str, Any]) -> dict[str, Any]:
    """A submitted job: Job's keys but those the controller sets; ``name`` and ``command``
    needed."""
    out = copy.deepcopy(job)
    out["title"] = "JobRequest"
    out["description"] = "A job as submitted (docs/jobs.md): `job_id` is made when absent."
    for key in ("type", "v", "submitted_ts"):
        out["properties"].pop(key, None)
    out["properties"]["job_id"] = {"type": "string", "pattern": JOB_ID_PATTERN}
    out["properties"]["name"] = {"type": "string", "minLength": 1}
    out["properties"]["command"] = {"type": "string", "minLength": 1}
    out["properties"]["dataset"] = {
        "type": "string",
        "pattern": DATASET_PATTERN,
        "description": "A dataset cached on the nodes ([[cache.datasets]] name), or empty",
    }
    out["required"] = ["name", "command"]
    out["additionalProperties"] = False
    return out


def _profile_request(profile: dict[str, Any]) -> dict[str, Any]:
    """A QoS profile as put: the profile, its ``type`` tag optional."""
    out = copy.deepcopy(profile)
    out["title"] = "QosProfileRequest"
    out["required"] = [k for k in out.get("required", []) if k != "type"]
    return out
