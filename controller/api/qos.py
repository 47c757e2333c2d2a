"""The flow-control routes of the HTTP API (docs/api.md, docs/qos.md).

``PUT/GET /v1/qos/{cluster}`` and ``PUT/GET /v1/qos/{cluster}/nodes/{node}`` over a
:class:`~controller.qos.QosStore`.  A PUT needs an admin token; its body is the profile
as TOML (``application/toml``) or JSON.  An invalid profile is answered 422 with every
reason, a version not above the stored one 409; either way nothing is stored.

``GET /v1/qos`` is the fleet's view: per cluster its profile version, its congestion
(pause frames and RDMA transmit waits, from the controller's
:class:`~controller.core.congestion.CongestionTracker`) and its nodes in QoS status
``degraded``.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any, Final, Literal, Protocol, runtime_checkable

from aiohttp import web

from metalguard.controller.api.auth import check_admin, check_read
from metalguard.controller.api.errors import ApiError, reject_unknown_query
from metalguard.controller.api.nodes import VIEW
from metalguard.controller.api.shapes import (
    CongestedNode,
    DegradedQosNode,
    QosClusterView,
    QosFleetAnswer,
)
from metalguard.controller.core.congestion import ClusterRates, CongestionView
from metalguard.controller.qos import QosStore, StoredProfile, VersionConflictError
from metalguard.proto.codec import CodecError, to_builtins
from metalguard.proto.qos import ProfileError, QosProfile, decode_profile

QOS_STORE: Final = web.AppKey("qos_store", QosStore)
NAME: Final = re.compile(r"^[A-Za-z0-9_=-]{1,128}$", re.ASCII)
"""A cluster or node name as it can stand in a KV key of ``<P>_QOS``."""
FORMATS: Final[dict[str, Literal["toml", "json"]]] = {
    "application/toml": "toml",
    "text/toml": "toml",
    "application/x-toml": "toml",
    "application/json": "json",
}


@runtime_checkable
class CongestionSource(Protocol):
    """What ``GET /v1/qos`` needs of the controller view (``RegionController`` has it);
    a view without it serves the clusters of its records with no rates."""

    def congestion_view(self) -> CongestionView: ...


def add_qos_routes(app: web.Application, store: QosStore) -> None:
    """Register the ``/v1/qos`` routes over ``store``."""
    app[QOS_STORE] = store
    app.router.add_get("/v1/qos", get_fleet)
    app.router.add_get("/v1/qos/{cluster}", get_cluster)
    app.router.add_put("/v1/qos/{cluster}", put_profile)
    app.router.add_get("/v1/qos/{cluster}/nodes/{node}", get_node)
    app.router.add_put("/v1/qos/{cluster}/nodes/{node}", put_profile)


async def get_fleet(request: web.Request) -> web.Response:
    """Every cluster with nodes or congestion data: its profile version, nodes, rates,
    most congested nodes and degraded nodes (a :class:`~shapes.QosFleetAnswer`)."""
    check_read(request)
    reject_unknown_query(request, (), name_allowed=False)
    view = request.app[VIEW]
    store = request.app[QOS_STORE]
    records = view.store.records
    known = Counter((r.node.region, r.node.cluster) for r in records.values())
    congestion = view.congestion_view() if isinstance(view, CongestionSource) else None
    rates = {(c.region, c.cluster): c for c in (congestion.clusters if congestion else ())}
    versions: dict[str, int | None] = {}
    clusters = []
    for region, cluster in sorted(set(known) | set(rates)):
        if cluster not in versions:
            versions[cluster] = await _profile_version(store, cluster)
        clusters.append(
            _cluster_view(region, cluster, versions[cluster], known[(region, cluster)], rates)
        )
    answer = QosFleetAnswer(
        ts=congestion.ts if congestion else 0.0,
        stale_after_s=congestion.stale_after_s if congestion else 0.0,
        clusters=clusters,
    )
    return web.json_response(to_builtins(answer))


async def _profile_version(store: QosStore, cluster: str) -> int | None:
    """The version of the cluster's stored profile (None: none, or unreadable)."""
    try:
        stored = await store.get(cluster)
    except (CodecError, ValueError):  # ValueError: a name that cannot be a key
        return None
    return stored.profile.version if stored is not None else None


def _cluster_view(
    region: str,
    cluster: str,
    version: int | None,
    nodes: int,
    rates: dict[tuple[str, str], ClusterRates],
) -> QosClusterView:
    c = rates.get((region, cluster))
    return QosClusterView(
        region=region,
        cluster=cluster,
        profile_version=version,
        nodes=nodes,
        nodes_reporting=c.nodes_reporting if c else 0,
        pause_frames_per_s=c.pause_per_s if c else 0.0,
        rx_pause_per_s=c.rx_pause_per_s if c else 0.0,
        tx_pause_per_s=c.tx_pause_per_s if c else 0.0,
        xmit_wait_per_s=c.xmit_wait_per_s if c else 0.0,
        top=[
            CongestedNode(
                handle=n.handle,
                node=n.node,
                share=n.share,
                pause_frames_per_s=n.pause_per_s,
                rx_pause_per_s=n.rx_pause_per_s,
                tx_pause_per_s=n.tx_pause_per_s,
                xmit_wait_per_s=n.xmit_wait_per_s,
            )
            for n in (c.top if c else ())
        ],
        degraded=[
            DegradedQosNode(handle=d.handle, node=d.node, interfaces=list(d.interfaces))
            for d in (c.degraded if c else ())
        ],
    )


async def get_cluster(request: web.Request) -> web.Response:
    """The cluster's profile and its KV revision; ``?history=1`` adds the kept revisions."""
    check_read(request)
    store = request.app[QOS_STORE]
    cluster = _name(request, "cluster")
    stored = await store.get(cluster)
    if stored is None:
        raise ApiError(404, "not_found", f"no QoS profile for cluster {cluster!r}")
    body = shape(stored, cluster, None, "cluster")
    if _history_wanted(request):
        body["history"] = [_entry(s) for s in await store.history(cluster)]
    return web.json_response(body)


async def get_node(request: web.Request) -> web.Response:
    """What the node applies: its override (``source: node``), else the cluster's profile
    (``source: cluster``); 404 when neither exists."""
    check_read(request)
    store = request.app[QOS_STORE]
    cluster, node = _name(request, "cluster"), _name(request, "node")
    stored = await store.effective(cluster, node)
    if stored is None:
        raise ApiError(404, "not_found", f"no QoS profile for {cluster}.{node} or its cluster")
    source = "cluster" if stored.key == cluster else "node"
    body = shape(stored, cluster, node, source)
    if _history_wanted(request):
        served = node if source == "node" else None
        body["history"] = [_entry(s) for s in await store.history(cluster, served)]
    return web.json_response(body)


async def put_profile(request: web.Request) -> web.Response:
    """Store a new version of a cluster's profile or of a node's override (admin token)."""
    check_admin(request)
    cluster = _name(request, "cluster")
    node = _name(request, "node") if "node" in request.match_info else None
    try:
        profile = decode_body(request.content_type, await request.read())
    except ProfileError as exc:
        message = f"invalid QoS profile: {'; '.join(exc.reasons)}"
        raise ApiError(422, "invalid_profile", message, exc.reasons) from None
    try:
        stored, previous = await request.app[QOS_STORE].put(cluster, node, profile)
    except VersionConflictError as exc:
        raise ApiError(409, "version_conflict", exc.reason) from None
    body = shape(stored, cluster, node, "node" if node else "cluster")
    body["previous_version"] = previous.profile.version if previous else None
    return web.json_response(body)


def decode_body(content_type: str, data: bytes) -> QosProfile:
    """The QosProfile in a request body: ApiError 415 / 400, ProfileError with the reasons."""
    fmt = FORMATS.get(content_type.lower())
    if fmt is None:
        raise ApiError(
            415,
            "unsupported_media_type",
            f"send the profile as {', '.join(FORMATS)} (got {content_type or 'none'!r})",
        )
    if not data.strip():
        raise ApiError(400, "bad_request", "the body is empty: send a QoS profile")
    return decode_profile(data, fmt)


def shape(stored: StoredProfile, cluster: str, node: str | None, source: str) -> dict[str, Any]:
    """A profile's answer: where it is stored, its revision and the profile itself."""
    return {"cluster": cluster, "node": node, "source": source, **_entry(stored)}


def _entry(stored: StoredProfile) -> dict[str, Any]:
    return {
        "key": stored.key,
        "revision": stored.revision,
        "version": stored.profile.version,
        "profile": to_builtins(stored.profile),
    }


def _name(request: web.Request, part: str) -> str:
    """A cluster or node name that can be part of a KV key (letters, digits, ``-``, ``_``,
    ``=``; at most 128), else ApiError 400."""
    name = request.match_info[part]
    if not NAME.match(name):
        raise ApiError(
            400,
            "bad_request",
            f"{part} {name!r} is not a valid name (letters, digits, '-', '_', '='; at most 128)",
        )
    return name


def _history_wanted(request: web.Request) -> bool:
    reject_unknown_query(request, ("history",), name_allowed=False)
    return request.query.get("history", "") in ("1", "true", "yes")
