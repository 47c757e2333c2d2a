"""The HTTP API's OpenAPI document (controller/api/openapi.py): every route of the app
has an operation and every operation a route, the document is valid OpenAPI 3.1, and the
parsing fixes the fuzzer led to (no server: apps are built, never served)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import msgspec
import pytest
import schemathesis
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from metalguard.controller.api.app import make_app
from metalguard.controller.api.errors import ApiError
from metalguard.controller.api.fleet import FleetApi, add_fleet_routes
from metalguard.controller.api.jobs import JobsView
from metalguard.controller.api.jobs import summary as job_summary
from metalguard.controller.api.leader import LeaderView, add_leader_route
from metalguard.controller.api.nodes import ControllerView
from metalguard.controller.api.nodes import summary as node_summary
from metalguard.controller.api.openapi import (
    OPENAPI_PATH,
    OPERATIONS,
    document,
    operation_routes,
    routes_of,
)
from metalguard.controller.api.provision import ProvisionView
from metalguard.controller.api.qos import _name
from metalguard.controller.api.shapes import JobSummary, NodeSummary
from metalguard.controller.api.sse import EventSource, parse_last_event_id, parse_since
from metalguard.controller.api.tenants import TenantsView
from metalguard.controller.qos import QosStore
from metalguard.proto.base import NodeIdentity, Reason
from metalguard.proto.jobs import Job, JobStatus, MemberState
from metalguard.proto.nodes import NodeRecord


@dataclass
class Store:
    records: Mapping[str, NodeRecord] = field(default_factory=dict)


@dataclass
class View:
    store: Store = field(default_factory=Store)


def app_with(*, everything: bool) -> web.Application:
    """The app as ``controller run`` builds it: with every optional part, or none."""
    view = cast(ControllerView, View())
    source = cast(EventSource, object())
    if not everything:
        return make_app(view, source)
    app = make_app(
        view,
        source,
        qos=cast(QosStore, object()),
        jobs=cast(JobsView, object()),
        provision=cast(ProvisionView, object()),
        tenants=cast(TenantsView, object()),
    )
    add_leader_route(app, cast(LeaderView, object()))
    add_fleet_routes(app, cast(FleetApi, object()))
    return app


def test_every_route_has_an_operation_and_every_operation_a_route() -> None:
    routes = routes_of(app_with(everything=True))
    assert routes - operation_routes() == set(), "routes with no operation in openapi.py"
    assert operation_routes() - routes == set(), "operations of no route"
    assert ("GET", OPENAPI_PATH) in routes


def test_the_served_document_has_only_the_apps_routes() -> None:
    bare = document(routes_of(app_with(everything=False)))
    assert "/v1/nodes/{node}" in bare["paths"]
    assert OPENAPI_PATH in bare["paths"]
    for path in ("/v1/jobs", "/v1/qos/{cluster}", "/v1/leader", "/v1/fleet", "/v1/instances"):
        assert path not in bare["paths"], path
    full = document(routes_of(app_with(everything=True)))
    assert len([m for ops in full["paths"].values() for m in ops]) == len(OPERATIONS)


def test_the_document_is_valid_openapi_3_1() -> None:
    doc = document()
    assert doc["openapi"] == "3.1.0"
    schema = schemathesis.openapi.from_dict(doc)
    schema.validate()
    assert len(list(schema.get_all_operations())) == len(OPERATIONS)


def test_errors_security_and_bodies_are_declared() -> None:
    doc = document()
    for op in OPERATIONS:
        spec = doc["paths"][op.path][op.method.lower()]
        errors = [s for s in spec["responses"] if s.startswith(("4", "5"))]
        assert "500" in errors, op.path
        for status in errors:
            schema = spec["responses"][status]["content"]["application/json"]["schema"]
            assert schema == {"$ref": "#/components/schemas/ErrorBody"}, (op.path, status)
        if op.method != "GET":
            assert spec["security"] == [{"adminToken": []}], op.path
            assert {"401", "403"} <= set(errors), op.path
        elif op.path.startswith("/v1/") and op.path != OPENAPI_PATH:
            assert {"readToken": []} in spec["security"], op.path
            assert "401" in errors, op.path
        else:
            assert spec["security"] == [], op.path
        if op.method in ("POST", "PUT"):
            assert spec["requestBody"]["required"] is True
            assert "application/json" in spec["requestBody"]["content"]
    error = doc["components"]["schemas"]["ErrorDetail"]
    assert set(error["required"]) == {"code", "message"}


def test_the_hand_built_answers_are_their_shapes() -> None:
    record = NodeRecord(
        node=NodeIdentity(region="r1", cluster="c1", node="n1"),
        grade="FAILING",
        reasons=(Reason(signal="edac.ue", value=1, threshold=0, rule="ecc", message="ue"),),
    )
    line = node_summary("r1.c1.n1", record)
    assert msgspec.to_builtins(msgspec.convert(line, NodeSummary)) == line
    status = JobStatus(
        job_id="j1",
        state="running",
        job=Job(job_id="j1", name="x", command="python"),
        members=(MemberState(rank=0, node="r1.c1.n1", step=7),),
    )
    row = job_summary(status)
    assert msgspec.to_builtins(msgspec.convert(row, JobSummary)) == row
    assert row["step"] == 7


@pytest.mark.parametrize(
    "text",
    ["5065498381176134334152704", "9223372036854775808", "\u00b2", "\u0661", "-1", "1.5", ""],
)
def test_a_sequence_beyond_jetstreams_or_not_ascii_digits_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="not a stream sequence"):
        parse_last_event_id(text)
    assert parse_last_event_id("9223372036854775807").after_seq == 2**63 - 1


@pytest.mark.parametrize(
    "text", ["1e400", "inf", "nan", "-inf", "1e300", "\u0661\u0662", "9" * 400 + "d"]
)
def test_a_since_out_of_range_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="since"):
        parse_since(text, 1_800_000_000.0)


def test_a_since_before_the_epoch_starts_at_the_beginning() -> None:
    assert parse_since("99999999d", 1_800_000_000.0).time == 0.0
    assert parse_since("0001-01-01T00:00:00Z", 1_800_000_000.0).time == 0.0
    assert parse_since("10m", 1_800_000_000.0).time == 1_800_000_000.0 - 600


@pytest.mark.parametrize("name", ["c1", "rack-7_a", "x" * 128])
def test_a_qos_name_is_a_kv_key_part(name: str) -> None:
    request = make_mocked_request("GET", "/", match_info={"cluster": name})
    assert _name(request, "cluster") == name


@pytest.mark.parametrize("name", ["\u00bc\u00c2\x0f", "c.1", "c 1", "c*", "x" * 129, "é"])
def test_a_qos_name_that_cannot_be_a_kv_key_is_400(name: str) -> None:
    request = make_mocked_request("GET", "/", match_info={"cluster": name})
    with pytest.raises(ApiError) as bad:
        _name(request, "cluster")
    assert bad.value.status == 400
    assert repr(name) in bad.value.message


def test_the_answer_types_give_no_unknown_status() -> None:
    for op in OPERATIONS:
        assert all(100 <= s < 400 for s in op.answers), op
        assert set(op.errors) <= {400, 401, 403, 404, 409, 413, 415, 422, 502, 503, 504}, op
    schemas: Any = document()["components"]["schemas"]
    assert "JobRequest" in schemas
    assert "QosProfileRequest" in schemas
