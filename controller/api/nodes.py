"""The node routes (docs/api.md): ``GET /v1/nodes`` (the list, filtered and paged),
``GET /v1/summary`` (grade counts per cluster or rack: the dashboard's heatmap of a large
region), ``GET /v1/nodes/{node}`` (one node's record, signals and readings) and ``POST
/v1/nodes/{node}/{cordon|uncordon|maintenance}`` (an operator's action, admin token).

``{node}`` is a handle ``region.cluster.node``, or a bare node name when only one node
has it.  :class:`ControllerView` is what these routes need of the controller.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final, Literal, Protocol, cast, get_args

import msgspec
from aiohttp import web
from msgspec import UNSET

from metalguard.controller.api.auth import check_admin, check_read
from metalguard.controller.api.errors import ApiError, query_params
from metalguard.controller.api.leader import leader_elsewhere
from metalguard.controller.api.node_index import (
    MAX_LIMIT,
    STATES,
    Field,
    NodeIndex,
    NodeQuery,
    decode_cursor,
    index_of,
)
from metalguard.controller.api.shapes import (
    MAX_REASON,
    MAX_WHO,
    FleetSummary,
    GroupSummary,
    NodeSummary,
)
from metalguard.controller.core.lifecycle import OperatorAction
from metalguard.controller.core.scoring.signals import NodeSignals
from metalguard.proto.codec import to_builtins
from metalguard.proto.events import ControllerEvent
from metalguard.proto.nodes import GRADES, Grade, NodeRecord

log = logging.getLogger(__name__)
ACTIONS: Final = get_args(OperatorAction)
LIST_FILTERS: Final = ("grade", "state", "region", "cluster", "rack")
LIST_PARAMS: Final = (*LIST_FILTERS, "limit", "cursor")
SUMMARY_PARAMS: Final = ("by", "region", "cluster")


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

    def warm_datasets(self, handle: str) -> frozenset[str]:
        """The datasets warm on the node as of its newest batch (docs/scheduler.md)."""
        ...


VIEW: Final = web.AppKey("view", ControllerView)


class NodeProvisionLines(Protocol):
    """Each node's provisioning line (a :class:`~shapes.NodeProvision`), by handle."""

    async def __call__(self) -> dict[str, dict[str, Any]]: ...


NODE_PROVISION: Final = web.AppKey("node_provision", NodeProvisionLines)
"""With provisioning (api/provision.py): each node's provisioning line, by handle."""


def add_node_routes(app: web.Application, view: ControllerView) -> None:
    """Register the ``/v1/nodes`` routes over the controller."""
    app[VIEW] = view
    app.router.add_get("/v1/nodes", list_nodes)
    app.router.add_get("/v1/summary", get_summary)
    app.on_startup.append(_build_index)
    app.router.add_get("/v1/nodes/{node}", get_node)
    app.router.add_post(f"/v1/nodes/{{node}}/{{action:{'|'.join(ACTIONS)}}}", act)


async def _build_index(app: web.Application) -> None:
    """Build the listing's index when the API starts, not on its first request (about a
    second of CPU at 100,000 nodes); a view that cannot give its records yet is indexed on
    the first request instead (and answers the error there)."""
    try:
        index_of(app[VIEW].store)
    except Exception:  # whatever the view raises, the request will see it
        log.warning("node index not built at start; the first GET /v1/nodes builds it")


async def list_nodes(request: web.Request) -> web.Response:
    """The nodes in handle order, filtered by grade and state (comma-separated), region,
    cluster, rack; paged by ``limit`` and ``cursor`` (the previous page's ``next``)."""
    check_read(request)
    query = parse_list_query(query_params(request, LIST_PARAMS))
    view = request.app[VIEW]
    records = view.store.records
    page = index_of(view.store).page(query)
    lines = request.app.get(NODE_PROVISION)
    provision = await lines() if lines is not None else {}
    nodes = [
        summary_line(h, records[h], view.warm_datasets(h), provision=provision.get(h))
        for h in page.handles
    ]
    body = {"nodes": nodes, "total": page.total, "next": page.next_cursor}
    return web.Response(body=msgspec.json.encode(body), content_type="application/json")


async def get_summary(request: web.Request) -> web.Response:
    """Grade counts of the region and per cluster or rack (``by``), optionally of one
    region or cluster: what the dashboard draws instead of one cell per node."""
    check_read(request)
    query = query_params(request, SUMMARY_PARAMS)
    by = query.get("by", "rack")
    if by not in ("rack", "cluster"):
        raise ApiError(400, "bad_request", f"by must be rack or cluster, not {by!r}")
    index = index_of(request.app[VIEW].store)
    region, cluster = query.get("region"), query.get("cluster")
    body = index.memo(
        ("summary", by, region, cluster), lambda: build_summary(index, by, region, cluster)
    )
    return web.Response(body=body, content_type="application/json")


def build_summary(index: NodeIndex, by: str, region: str | None, cluster: str | None) -> bytes:
    """The body of ``GET /v1/summary`` (a :class:`~shapes.FleetSummary`), encoded."""
    groups = [
        GroupSummary(
            region=r,
            cluster=c,
            nodes=counts.nodes,
            grades=cast(dict[Grade, int], {g: n for g, n in counts.grades.items() if n}),
            cordoned=counts.cordoned,
            rack=rack if by == "rack" else UNSET,
        )
        for (r, c, rack), counts in index.groups(cast(Literal["rack", "cluster"], by))
        if region in (None, r) and cluster in (None, c)
    ]
    summary = FleetSummary(
        by=cast(Literal["rack", "cluster"], by),
        total=len(index),
        grades=cast(dict[Grade, int], index.grade_counts()),
        groups=groups,
    )
    return msgspec.json.encode(summary)


def parse_list_query(params: Mapping[str, str]) -> NodeQuery:
    """The :class:`NodeQuery` of ``GET /v1/nodes``'s (non-empty) parameters; ApiError 400
    naming what is wrong and what is valid."""
    where: dict[Field, frozenset[str]] = {}
    if "grade" in params:
        where["grade"] = frozenset(parse_grades(params["grade"]))
    if "state" in params:
        where["state"] = frozenset(parse_states(params["state"]))
    for name in ("region", "cluster", "rack"):
        if name in params:
            where[name] = frozenset((params[name],))
    limit = None
    if "limit" in params:
        text = params["limit"]
        if not text.isascii() or not text.isdigit() or not 1 <= int(text) <= MAX_LIMIT:
            raise ApiError(
                400, "bad_request", f"limit must be an integer from 1 to {MAX_LIMIT}, not {text!r}"
            )
        limit = int(text)
    after = ""
    if "cursor" in params:
        try:
            after = decode_cursor(params["cursor"])
        except ValueError as exc:
            raise ApiError(400, "bad_request", f"{exc}: pass a page's next as is") from None
    return NodeQuery(where=where, limit=limit, after=after)


def parse_states(text: str) -> set[str]:
    """The states of a comma-separated ``state`` filter, lower-cased (ApiError 400 for an
    unknown one)."""
    return _parse_choices(text, "state", STATES, str.lower)


async def get_node(request: web.Request) -> web.Response:
    """One node's full record (score, grade, reasons, operator state, grade history), its
    recent signals (each counter's samples ``[ts, value]`` and resets), the QoS verdicts
    of its newest batch and its BMC's newest out-of-band word."""
    check_read(request)
    view = request.app[VIEW]
    handle, record = lookup(view.store.records, request.match_info["node"])
    history = view.recent_signals(handle)
    signals = {
        key: {"samples": [list(s) for s in h.samples], "resets": h.resets}
        for key, h in (history.counters.items() if history else ())
    }
    body = {"handle": handle, "record": to_builtins(record), "signals": signals}
    return web.json_response(body | view.recent_readings(handle))


async def act(request: web.Request) -> web.Response:
    """An operator's cordon, uncordon or maintenance (admin token)."""
    check_admin(request)
    where = leader_elsewhere(request)
    if where is not None:
        raise ApiError(
            503,
            "not_leader",
            f"this controller follows; operator actions go to the leader: {where}",
        )
    view = request.app[VIEW]
    handle, _ = lookup(view.store.records, request.match_info["node"])
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


def summary(
    handle: str,
    r: NodeRecord,
    warm: frozenset[str] = frozenset(),
    *,
    provision: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A node's line in ``GET /v1/nodes`` (a :class:`~shapes.NodeSummary`) as builtins;
    ``warm``: the datasets warm there; ``provision``: its provisioning line (a
    :class:`~shapes.NodeProvision`), when provisioning knows the node."""
    line = summary_line(handle, r, warm, provision=provision)
    return line if isinstance(line, dict) else dict(msgspec.to_builtins(line))


def summary_line(
    handle: str,
    r: NodeRecord,
    warm: frozenset[str] = frozenset(),
    *,
    provision: dict[str, Any] | None = None,
) -> NodeSummary | dict[str, Any]:
    """:func:`summary` as msgspec encodes it fastest: the struct, or builtins with the
    provisioning line added."""
    line = NodeSummary(
        handle=handle,
        region=r.node.region,
        cluster=r.node.cluster,
        node=r.node.node,
        rack=r.rack,
        grade=r.grade,
        score=r.score,
        cordoned=r.cordoned,
        maintenance=r.maintenance,
        held=r.held,
        last_seen_ts=r.last_seen_ts,
        reasons=list(r.reasons),
        warm_datasets=sorted(warm),
    )
    if provision is None:
        return line
    out = dict(msgspec.to_builtins(line))
    out["provision"] = provision
    return out


def lookup(records: Mapping[str, NodeRecord], name: str) -> tuple[str, NodeRecord]:
    """A node by handle, or by bare name when only one node has it (ApiError 404, or 409
    when the name is ambiguous)."""
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


def parse_grades(text: str) -> set[str]:
    """The grades of a comma-separated ``grade`` filter, upper-cased (ApiError 400 for an
    unknown one)."""
    return _parse_choices(text, "grade", GRADES, str.upper)


def _parse_choices(
    text: str, what: str, valid: Iterable[str], case: Callable[[str], str]
) -> set[str]:
    wanted = {case(v.strip()) for v in text.split(",") if v.strip()}
    choices = list(valid)
    bad = sorted(wanted - set(choices))
    if bad:
        raise ApiError(
            400, "bad_request", f"unknown {what} {', '.join(bad)}; valid: {', '.join(choices)}"
        )
    return wanted


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
