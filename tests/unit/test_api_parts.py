"""The HTTP API's pure parts: node lookup and grade filters, tokens, JSON errors, query
checks (no server: requests are aiohttp's mocked ones)."""

from __future__ import annotations

import json

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from metalguard.controller.api.auth import TOKENS, Tokens, bearer_token, check_admin, check_read
from metalguard.controller.api.errors import ApiError, error_response, query_params
from metalguard.controller.api.nodes import lookup, parse_grades
from metalguard.proto.base import NodeIdentity
from metalguard.proto.nodes import NodeRecord


def record(region: str, name: str) -> NodeRecord:
    return NodeRecord(node=NodeIdentity(region=region, cluster="c1", node=name))


def request(path: str = "/v1/nodes", token: str = "", tokens: Tokens | None = None) -> web.Request:
    app = web.Application()
    app[TOKENS] = tokens or Tokens((), ())
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return make_mocked_request("GET", path, headers=headers, app=app)


def test_a_node_is_found_by_handle_or_by_a_name_only_one_node_has() -> None:
    records = {"r1.c1.n1": record("r1", "n1"), "r1.c1.n2": record("r1", "n2")}
    records["r2.c1.n2"] = record("r2", "n2")
    assert lookup(records, "r1.c1.n2")[0] == "r1.c1.n2"
    assert lookup(records, "n1")[0] == "r1.c1.n1"
    with pytest.raises(ApiError) as missing:
        lookup(records, "n9")
    assert (missing.value.status, missing.value.code) == (404, "not_found")
    with pytest.raises(ApiError) as ambiguous:
        lookup(records, "n2")
    assert ambiguous.value.status == 409
    assert "r1.c1.n2, r2.c1.n2" in ambiguous.value.message


def test_grade_filters_are_case_insensitive_and_unknown_ones_refused() -> None:
    assert parse_grades(" healthy,Failing ,") == {"HEALTHY", "FAILING"}
    assert parse_grades("") == set()
    with pytest.raises(ApiError, match="unknown grade GREAT"):
        parse_grades("healthy,great")


def test_unknown_query_parameters_are_named_with_the_allowed_ones() -> None:
    assert query_params(request("/v1/nodes?rack=k1&grade="), ("grade", "rack")) == {"rack": "k1"}
    with pytest.raises(ApiError, match=r"unknown query parameter\(s\) x; allowed: grade, rack"):
        query_params(request("/v1/nodes?x=1"), ("grade", "rack"))


def test_error_bodies_carry_reasons_only_when_given() -> None:
    plain = json.loads(error_response(404, "not_found", "no such").text or "")
    assert plain == {"error": {"code": "not_found", "message": "no such"}}
    listed = json.loads(error_response(422, "invalid_job", "bad", reasons=["a", "b"]).text or "")
    assert listed["error"]["reasons"] == ["a", "b"]


def test_tokens_open_reads_when_none_is_configured_and_refuse_actions() -> None:
    check_read(request())
    with pytest.raises(ApiError) as refused:
        check_admin(request())
    assert refused.value.status == 403


def test_a_read_token_reads_but_does_not_act() -> None:
    tokens = Tokens(read=("r",), admin=("a",))
    check_read(request(token="r", tokens=tokens))
    check_admin(request(token="a", tokens=tokens))
    for token, status in (("r", 403), ("", 401), ("wrong", 401)):
        with pytest.raises(ApiError) as refused:
            check_admin(request(token=token, tokens=tokens))
        assert refused.value.status == status, token
    with pytest.raises(ApiError):
        check_read(request(tokens=tokens))


def test_open_reads_keep_reads_open_and_actions_closed() -> None:
    """The demo's API: its dashboard reads without a token, its actions need the admin
    token it prints."""
    tokens = Tokens(read=(), admin=("a",), open_reads=True)
    check_read(request(tokens=tokens))
    check_read(request(token="wrong", tokens=tokens))
    check_admin(request(token="a", tokens=tokens))
    for token, status in (("", 401), ("wrong", 401)):
        with pytest.raises(ApiError) as refused:
            check_admin(request(token=token, tokens=tokens))
        assert refused.value.status == status, token


def test_bearer_token_needs_the_bearer_scheme() -> None:
    assert bearer_token(request(token=" t1 ")) == b"t1"
    basic = make_mocked_request("GET", "/", headers={"Authorization": "Basic dTpw"})
    assert bearer_token(basic) is None
