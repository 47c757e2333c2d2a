"""The HTTP API (controller/api.py) over a real RegionController and nats-server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient, TestServer
from nats.aio.client import Client

from metalguard.controller.api.app import make_app
from metalguard.controller.api.events import HUB
from metalguard.proto.subjects import Subjects
from metalguard.proto.telemetry import BmcReading, DatasetCache, QosInterfaceStatus
from tests.support.harness.api_env import (
    ADMIN_TOKEN,
    FATAL,
    FLEET,
    READ_TOKEN,
    ApiEnv,
    api_env,
    batch,
)
from tests.support.waiting import wait_until

DEADLINE_S = 10.0
READ = {"Authorization": f"Bearer {READ_TOKEN}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture
async def env(nc: Client, subjects: Subjects) -> AsyncIterator[ApiEnv]:
    async with api_env(nc, subjects) as e:
        await e.feed(*FLEET)
        yield e


@pytest.fixture
async def client(env: ApiEnv) -> AsyncIterator[TestClient[Any, Any]]:
    app = make_app(
        env.controller,
        env.source,
        read_tokens={READ_TOKEN},
        admin_tokens={ADMIN_TOKEN},
        registry=env.metrics.registry,
        keepalive_s=0.05,
    )
    async with TestClient(TestServer(app)) as c:
        yield c


async def error_of(response: ClientResponse, status: int) -> dict[str, str]:
    """The JSON error body of a response that must have ``status``."""
    assert response.status == status, await response.text()
    body = await response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"code", "message"}
    return dict(body["error"])


# --- nodes ----------------------------------------------------------------------------


async def test_list_and_filters(client: TestClient[Any, Any], env: ApiEnv) -> None:
    await env.feed(FATAL)
    await env.set_rack("r1.c2.n1", "rk7")

    body = await (await client.get("/v1/nodes", headers=READ)).json()
    assert [n["handle"] for n in body["nodes"]] == ["r1.c1.n1", "r1.c1.n2", "r1.c1.n3", "r1.c2.n1"]
    n3 = body["nodes"][2]
    assert n3["grade"] == "FAILING"
    assert n3["reasons"][0]["rule"] == "ecc_uncorrectable"

    async def handles(query: str) -> list[str]:
        response = await client.get(f"/v1/nodes?{query}", headers=READ)
        assert response.status == 200, await response.text()
        return [n["handle"] for n in (await response.json())["nodes"]]

    assert await handles("grade=FAILING") == ["r1.c1.n3"]
    assert await handles("grade=failing,healthy&cluster=c1") == ["r1.c1.n1", "r1.c1.n2", "r1.c1.n3"]
    assert await handles("cluster=c2") == ["r1.c2.n1"]
    assert await handles("rack=rk7") == ["r1.c2.n1"]
    assert await handles("region=r2") == []


async def test_list_shows_the_datasets_warm_on_each_node(
    client: TestClient[Any, Any], env: ApiEnv
) -> None:
    """A node's batch with its dataset caches: the warm ones (controller/core/warm.py) on
    its line of GET /v1/nodes; the next batch without them clears them."""
    n2 = batch("c1", "n2", 2)
    warm = DatasetCache(dataset="imagenet", ts=n2.ts, max_bytes=100, used_bytes=80)
    cold = DatasetCache(dataset="coco", ts=n2.ts, max_bytes=100, used_bytes=10)
    await env.feed(msgspec.structs.replace(n2, cache=(cold, warm)))

    async def warm_sets() -> dict[str, list[str]]:
        body = await (await client.get("/v1/nodes", headers=READ)).json()
        return {n["handle"]: n["warm_datasets"] for n in body["nodes"]}

    assert (await warm_sets())["r1.c1.n2"] == ["imagenet"]
    assert (await warm_sets())["r1.c1.n1"] == []
    await env.feed(batch("c1", "n2", 3))
    assert (await warm_sets())["r1.c1.n2"] == []


async def test_bad_filters_are_400_naming_what_is_valid(client: TestClient[Any, Any]) -> None:
    error = await error_of(await client.get("/v1/nodes?grade=SICK", headers=READ), 400)
    assert "SICK" in error["message"]
    assert "HEALTHY" in error["message"]
    assert "UNREACHABLE" in error["message"]
    error = await error_of(await client.get("/v1/nodes?colour=red", headers=READ), 400)
    assert "colour" in error["message"]


async def test_pages_follow_the_cursor_and_say_the_total(
    client: TestClient[Any, Any], env: ApiEnv
) -> None:
    await env.feed(FATAL)  # r1.c1.n3 FAILING
    everyone = ["r1.c1.n1", "r1.c1.n2", "r1.c1.n3", "r1.c2.n1"]

    async def page(query: str) -> dict[str, Any]:
        response = await client.get(f"/v1/nodes?{query}", headers=READ)
        assert response.status == 200, await response.text()
        return dict(await response.json())

    first = await page("limit=3")
    assert [n["handle"] for n in first["nodes"]] == everyone[:3]
    assert first["total"] == 4
    assert isinstance(first["next"], str)
    second = await page(f"limit=3&cursor={first['next']}")
    assert [n["handle"] for n in second["nodes"]] == everyone[3:]
    assert second["total"] == 4
    assert second["next"] is None
    unpaged = await page("")
    assert [n["handle"] for n in unpaged["nodes"]] == everyone
    assert unpaged["next"] is None
    healthy = await page("grade=healthy&limit=2")
    assert [n["handle"] for n in healthy["nodes"]] == ["r1.c1.n1", "r1.c1.n2"]
    assert healthy["total"] == 3
    rest = await page(f"grade=healthy&limit=2&cursor={healthy['next']}")
    assert [n["handle"] for n in rest["nodes"]] == ["r1.c2.n1"]

    cordon = await client.post("/v1/nodes/n2/cordon", json={"reason": "x"}, headers=ADMIN)
    assert cordon.status == 200, await cordon.text()
    assert [n["handle"] for n in (await page("state=cordoned"))["nodes"]] == ["r1.c1.n2"]
    in_service = await page("state=in_service&cluster=c1")
    assert [n["handle"] for n in in_service["nodes"]] == ["r1.c1.n1", "r1.c1.n3"]


async def test_bad_paging_parameters_are_400s(client: TestClient[Any, Any]) -> None:
    for query, words in (
        ("limit=0", "limit must be an integer from 1 to 5000"),
        ("limit=abc", "'abc'"),
        ("limit=5001", "limit"),
        ("cursor=%21%21", "not a cursor"),
        ("state=sleepy", "valid: in_service, cordoned, maintenance, held"),
    ):
        error = await error_of(await client.get(f"/v1/nodes?{query}", headers=READ), 400)
        assert error["code"] == "bad_request"
        assert words in error["message"], (query, error)
    error = await error_of(await client.get("/v1/summary?by=node", headers=READ), 400)
    assert "rack or cluster" in error["message"]
    await error_of(await client.get("/v1/summary"), 401)


async def test_summary_counts_grades_per_rack_and_cluster(
    client: TestClient[Any, Any], env: ApiEnv
) -> None:
    await env.feed(FATAL)
    await env.set_rack("r1.c2.n1", "rk7")
    racks = await (await client.get("/v1/summary", headers=READ)).json()
    assert racks["by"] == "rack"
    assert racks["total"] == 4
    assert racks["grades"]["FAILING"] == 1
    assert racks["grades"]["HEALTHY"] == 3
    by_rack = {(g["cluster"], g["rack"]): (g["nodes"], g["grades"]) for g in racks["groups"]}
    assert by_rack[("c2", "rk7")] == (1, {"HEALTHY": 1})
    c1 = [g for g in racks["groups"] if g["cluster"] == "c1"]
    assert sum(g["nodes"] for g in c1) == 3
    clusters = await (await client.get("/v1/summary?by=cluster", headers=READ)).json()
    assert [(g["cluster"], g["nodes"]) for g in clusters["groups"]] == [("c1", 3), ("c2", 1)]
    assert "rack" not in clusters["groups"][0]
    one = await (await client.get("/v1/summary?by=cluster&cluster=c2", headers=READ)).json()
    assert [g["cluster"] for g in one["groups"]] == ["c2"]


async def test_node_by_handle_name_unknown_ambiguous(client: TestClient[Any, Any]) -> None:
    body = await (await client.get("/v1/nodes/r1.c1.n2", headers=READ)).json()
    assert body["handle"] == "r1.c1.n2"
    record = body["record"]
    assert record["grade"] == "HEALTHY"
    assert record["score"] == 100.0
    assert {"reasons", "history", "cordoned", "last_seen_ts"} <= set(record)
    signals = body["signals"]
    assert signals, "the node's recent counter samples"
    for counter in signals.values():
        assert counter["samples"]
        assert all(len(sample) == 2 for sample in counter["samples"])

    by_name = await (await client.get("/v1/nodes/n3", headers=READ)).json()
    assert by_name["handle"] == "r1.c1.n3"
    error = await error_of(await client.get("/v1/nodes/nope", headers=READ), 404)
    assert "nope" in error["message"]
    error = await error_of(await client.get("/v1/nodes/n1", headers=READ), 409)
    assert "r1.c1.n1" in error["message"]
    assert "r1.c2.n1" in error["message"]


async def test_node_page_shows_qos_verdicts_and_the_bmc_word(
    client: TestClient[Any, Any], env: ApiEnv
) -> None:
    plain = await (await client.get("/v1/nodes/r1.c1.n2", headers=READ)).json()
    assert plain["qos"] == []
    assert "bmc" not in plain
    word = BmcReading(source="redfish", reachable=True, power_state="on", health="warning")
    env.clock.now = FLEET[1].ts + 1
    oob = msgspec.structs.replace(FLEET[1], seq=99, bmc=(word,), out_of_band=True)
    await env.controller.on_batch(oob, env.clock.now)
    verdict = QosInterfaceStatus(interface="ens1f0", version=3, status="drift", reasons=("x",))
    await env.feed(msgspec.structs.replace(FLEET[1], seq=2, ts=FLEET[1].ts + 5, qos=(verdict,)))
    body = await (await client.get("/v1/nodes/r1.c1.n2", headers=READ)).json()
    assert body["qos"] == [
        {"interface": "ens1f0", "version": 3, "status": "drift", "reasons": ["x"]}
    ]
    assert (body["bmc"]["power_on"], body["bmc"]["health"]) == (True, "warning")
    # the BMC's warning joined the second batch: the score dropped, a new point
    assert [score for _, score in body["scores"]] == [100.0, 90.0]
    assert body["record"]["last_seq"] == 2  # the out-of-band batch is no sign of life


async def test_unknown_route_is_json_404(client: TestClient[Any, Any]) -> None:
    await error_of(await client.get("/v2/whatever", headers=READ), 404)
    await error_of(await client.delete("/v1/nodes/n3", headers=ADMIN), 405)


async def test_grade_history_after_an_isolation(client: TestClient[Any, Any], env: ApiEnv) -> None:
    await env.feed(FATAL)
    record = (await (await client.get("/v1/nodes/r1.c1.n3", headers=READ)).json())["record"]
    assert record["grade"] == "FAILING"
    assert record["score"] < 100
    assert [(h["grade_from"], h["grade_to"]) for h in record["history"]] == [("HEALTHY", "FAILING")]


# --- operator actions and auth ----------------------------------------------------------


async def test_cordon_uncordon_maintenance(client: TestClient[Any, Any], env: ApiEnv) -> None:
    body = {"reason": "DIMM swap", "who": "alice"}
    response = await client.post("/v1/nodes/n2/cordon", json=body, headers=ADMIN)
    assert response.status == 200, await response.text()
    answer = await response.json()
    assert answer["handle"] == "r1.c1.n2"
    assert [e["kind"] for e in answer["events"]] == ["node.cordoned"]
    assert answer["record"]["cordoned"] is True
    assert answer["record"]["operator_by"] == "operator:alice"
    assert env.controller.store.records["r1.c1.n2"].cordoned

    again = await (await client.post("/v1/nodes/n2/cordon", json=body, headers=ADMIN)).json()
    assert again["events"] == []  # the same cordon twice announces nothing

    response = await client.post("/v1/nodes/r1.c1.n2/maintenance", json=body, headers=ADMIN)
    answer = await response.json()
    assert answer["record"]["grade"] == "MAINTENANCE"
    response = await client.post("/v1/nodes/n2/uncordon", json={"reason": "done"}, headers=ADMIN)
    answer = await response.json()
    assert answer["record"]["cordoned"] is False
    assert answer["record"]["operator_by"] in ("", "operator:api")


async def test_actions_need_an_admin_token(client: TestClient[Any, Any], env: ApiEnv) -> None:
    body = {"reason": "x"}
    path = "/v1/nodes/n2/cordon"
    response = await client.post(path, json=body)
    await error_of(response, 401)
    assert response.headers["WWW-Authenticate"] == "Bearer"
    bad = {"Authorization": "Bearer wrong"}
    await error_of(await client.post(path, json=body, headers=bad), 401)
    await error_of(await client.post(path, json=body, headers=READ), 403)
    assert not env.controller.store.records["r1.c1.n2"].cordoned


async def test_reads_need_a_token_when_tokens_are_set(client: TestClient[Any, Any]) -> None:
    await error_of(await client.get("/v1/nodes"), 401)
    await error_of(await client.get("/v1/nodes/n2", headers={"Authorization": "Basic x"}), 401)
    await error_of(await client.get("/v1/events"), 401)
    assert (await client.get("/v1/nodes", headers=ADMIN)).status == 200
    assert (await client.get("/healthz")).status == 200
    assert (await client.get("/metrics")).status == 200


async def test_bad_bodies_are_400(client: TestClient[Any, Any], env: ApiEnv) -> None:
    path = "/v1/nodes/n2/cordon"
    headers = {**ADMIN, "Content-Type": "application/json"}
    for data in (b"{not json", b"[1, 2]", b'{"who": "x"}', b'{"reason": "  "}', b'{"reason": 3}'):
        error = await error_of(await client.post(path, data=data, headers=headers), 400)
        assert error["code"] == "bad_request"
    too_long = json.dumps({"reason": "x" * 501}).encode()
    await error_of(await client.post(path, data=too_long, headers=headers), 400)
    unknown = await client.post("/v1/nodes/zz/cordon", json={"reason": "x"}, headers=ADMIN)
    await error_of(unknown, 404)
    assert not env.controller.store.records["r1.c1.n2"].cordoned


async def test_without_tokens_reads_are_open_and_writes_refused(env: ApiEnv) -> None:
    app = make_app(env.controller, env.source)
    async with TestClient(TestServer(app)) as c:
        assert (await c.get("/v1/nodes")).status == 200
        error = await error_of(await c.post("/v1/nodes/n2/cordon", json={"reason": "x"}), 403)
        assert "no admin token" in error["message"]


# --- events ----------------------------------------------------------------------------


async def next_event(response: ClientResponse) -> tuple[str, dict[str, Any]]:
    """The next SSE message's event type and JSON data (comments skipped)."""
    _, kind, data = await next_message(response)
    return kind, data


async def next_message(response: ClientResponse) -> tuple[str, str, dict[str, Any]]:
    """The next SSE message's id, event type and JSON data (comments skipped)."""
    ident, kind, data = "", "", ""
    async with asyncio.timeout(DEADLINE_S):
        while True:
            line = (await response.content.readline()).decode().rstrip("\n")
            if line.startswith("id: "):
                ident = line.removeprefix("id: ")
            elif line.startswith("event: "):
                kind = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = line.removeprefix("data: ")
            elif not line and data:
                return ident, kind, json.loads(data)


async def subscribed(response: ClientResponse) -> None:
    """Wait for the stream's first comment: the subscription is in place."""
    assert response.status == 200, await response.text()
    assert response.headers["Content-Type"].startswith("text/event-stream")
    async with asyncio.timeout(DEADLINE_S):
        assert await response.content.readline() == b": subscribed\n"
        assert await response.content.readline() == b"\n"


async def test_events_stream_an_isolation(client: TestClient[Any, Any], env: ApiEnv) -> None:
    async with client.get("/v1/events", headers=READ) as response:
        await subscribed(response)
        await env.feed(FATAL)
        kind, event = await next_event(response)
    assert kind == "node.isolated"
    assert event["kind"] == "node.isolated"
    assert event["node"]["node"] == "n3"
    assert event["reasons"][0]["rule"] == "ecc_uncorrectable"


async def test_events_filter_by_kind_and_node(client: TestClient[Any, Any], env: ApiEnv) -> None:
    reason = {"reason": "test"}
    async with (
        client.get("/v1/events?kind=node.cordoned", headers=READ) as by_kind,
        client.get("/v1/events?kind=node.&node=r1.c1.n2", headers=READ) as by_node,
    ):
        await subscribed(by_kind)
        await subscribed(by_node)
        await env.feed(FATAL)  # node.isolated of n3: neither stream wants it
        await client.post("/v1/nodes/r1.c2.n1/cordon", json=reason, headers=ADMIN)
        await client.post("/v1/nodes/n2/maintenance", json=reason, headers=ADMIN)
        kind, event = await next_event(by_kind)
        assert (kind, event["node"]["cluster"]) == ("node.cordoned", "c2")
        kind, event = await next_event(by_node)
        assert (kind, event["node"]["node"]) == ("node.maintenance", "n2")


async def test_a_closed_stream_is_cleaned_up(client: TestClient[Any, Any]) -> None:
    hub = client.app[HUB]
    async with client.get("/v1/events", headers=READ) as response:
        await subscribed(response)
        assert hub.open_streams == 1
        line = await asyncio.wait_for(response.content.readline(), DEADLINE_S)
        assert line == b": keep-alive\n"
    await wait_until(lambda: hub.open_streams == 0, DEADLINE_S, "the stream to be dropped")


async def test_bad_event_query_is_400(client: TestClient[Any, Any]) -> None:
    error = await error_of(await client.get("/v1/events?until=3", headers=READ), 400)
    assert "until" in error["message"]
    error = await error_of(await client.get("/v1/events?since=yesterday", headers=READ), 400)
    assert "'yesterday'" in error["message"]
    assert "duration" in error["message"]
    error = await error_of(await client.get("/v1/events?since=2026-11-29T10:00", headers=READ), 400)
    assert "time zone" in error["message"]
    bad_id = {**READ, "Last-Event-ID": "r1.c1.n3:node.isolated:b2"}
    error = await error_of(await client.get("/v1/events", headers=bad_id), 400)
    assert "stream sequence" in error["message"]


async def test_late_subscriber_replays_the_past_then_follows(
    client: TestClient[Any, Any], env: ApiEnv
) -> None:
    await env.feed(FATAL)
    await client.post("/v1/nodes/n2/cordon", json={"reason": "late"}, headers=ADMIN)
    async with client.get("/v1/events?since=all", headers=READ) as response:
        await subscribed(response)
        first_id, kind, event = await next_message(response)
        assert (kind, event["node"]["node"]) == ("node.isolated", "n3")
        second_id, kind, _ = await next_message(response)
        assert kind == "node.cordoned"
        assert int(second_id) > int(first_id)
        await client.post("/v1/nodes/r1.c1.n1/cordon", json={"reason": "live"}, headers=ADMIN)
        _, kind, event = await next_message(response)  # then it follows live
        assert (kind, event["node"]["node"]) == ("node.cordoned", "n1")

    resume = {**READ, "Last-Event-ID": first_id}  # a reconnecting EventSource sends this
    async with client.get("/v1/events", headers=resume) as response:
        await subscribed(response)
        ident, kind, event = await next_message(response)
        assert (ident, kind, event["node"]["node"]) == (second_id, "node.cordoned", "n2")

    async with client.get("/v1/events?since=10m&kind=node.isolated", headers=READ) as response:
        await subscribed(response)
        ident, kind, _ = await next_message(response)
        assert (ident, kind) == (first_id, "node.isolated")


async def test_since_a_future_time_replays_nothing(
    client: TestClient[Any, Any], env: ApiEnv
) -> None:
    await env.feed(FATAL)
    async with client.get("/v1/events?since=2100-01-01T00:00:00Z", headers=READ) as response:
        await subscribed(response)
        await client.post("/v1/nodes/n2/cordon", json={"reason": "now"}, headers=ADMIN)
        _, kind, _ = await next_message(response)  # the isolation before is not replayed
        assert kind == "node.cordoned"


# --- metrics, health, errors -----------------------------------------------------------


async def test_metrics_exposition(client: TestClient[Any, Any], env: ApiEnv) -> None:
    env.clock.now = FATAL.ts + 0.5
    await env.controller.on_batch(FATAL, received_ts=FATAL.ts + 0.2)  # decided 0.3 s later
    env.metrics.count("T_TELEMETRY", "ingested", 3)
    env.metrics.set_lag("T_TELEMETRY", 7)
    response = await client.get("/metrics")
    assert response.status == 200
    assert response.headers["Content-Type"].startswith("text/plain")
    text = await response.text()
    assert 'metalguard_ingest_messages_total{stream="T_TELEMETRY"} 3.0' in text
    assert 'metalguard_ingest_lag_messages{stream="T_TELEMETRY"} 7.0' in text
    assert "# TYPE metalguard_ingest_decode_errors_total counter" in text
    assert "# TYPE metalguard_ingest_handle_seconds histogram" in text
    assert 'metalguard_nodes{grade="HEALTHY"} 3.0' in text
    assert 'metalguard_nodes{grade="FAILING"} 1.0' in text
    assert 'metalguard_nodes{grade="UNREACHABLE"} 0.0' in text
    assert "metalguard_nodes_cordoned 0.0" in text
    assert 'metalguard_decisions_total{kind="node.isolated"} 1.0' in text
    bucket = 'metalguard_decision_latency_seconds_bucket{kind="node.isolated",le="%s"}'
    assert f"{bucket % '0.25'} 0.0" in text
    assert f"{bucket % '0.5'} 1.0" in text


async def test_healthz(client: TestClient[Any, Any]) -> None:
    response = await client.get("/healthz")
    assert response.status == 200
    assert await response.json() == {"status": "ok"}


class _SecretError(RuntimeError):
    pass


class BrokenView:
    """A view whose records blow up with a message that must not reach the client."""

    @property
    def store(self) -> Any:
        raise _SecretError("secret internals /etc/metalguard")

    async def operator_action(self, handle: str, action: Any, reason: str, who: str) -> Any:
        raise AssertionError("not reached")

    def recent_signals(self, handle: str) -> Any:
        raise AssertionError("not reached")

    def recent_readings(self, handle: str) -> Any:
        raise AssertionError("not reached")

    def warm_datasets(self, handle: str) -> Any:
        raise AssertionError("not reached")


async def test_an_unexpected_error_is_a_bare_500(
    env: ApiEnv, caplog: pytest.LogCaptureFixture
) -> None:
    app = make_app(BrokenView(), env.source)
    async with TestClient(TestServer(app)) as c:
        response = await c.get("/v1/nodes")
        text = await response.text()
    error = await error_of(response, 500)
    assert error["code"] == "internal"
    assert "secret" not in text
    assert "Traceback" not in text
    assert "_SecretError" not in text
    assert "secret internals" in caplog.text  # logged server-side


async def test_event_history_as_json(client: TestClient[Any, Any], env: ApiEnv) -> None:
    await env.feed(FATAL)
    for name in ("r1.c1.n1", "n2", "r1.c2.n1"):
        await client.post(f"/v1/nodes/{name}/cordon", json={"reason": "h"}, headers=ADMIN)

    async def history(query: str) -> dict[str, Any]:
        response = await client.get(f"/v1/events/history?{query}", headers=READ)
        assert response.status == 200, await response.text()
        return dict(await response.json())

    everything = await history("since=all")
    kinds = [(e["kind"], e["node"]["node"]) for e in everything["events"]]
    assert kinds == [
        ("node.isolated", "n3"),
        ("node.cordoned", "n1"),
        ("node.cordoned", "n2"),
        ("node.cordoned", "n1"),
    ]
    seqs = [e["seq"] for e in everything["events"]]
    assert seqs == sorted(seqs)
    assert everything["last_seq"] == seqs[-1]
    assert everything["more"] is False

    page = await history("since=all&limit=2")
    assert [e["seq"] for e in page["events"]] == seqs[:2]
    assert page["more"] is True
    rest = await history(f"after={page['last_seq']}")
    assert [e["seq"] for e in rest["events"]] == seqs[2:]
    assert rest["more"] is False

    assert [e["kind"] for e in (await history("kind=node.isolated"))["events"]] == [
        "node.isolated"
    ]  # default since=1h
    only_c2 = await history("since=all&node=r1.c2.n1")
    assert [e["node"]["cluster"] for e in only_c2["events"]] == ["c2"]
    assert (await history("since=2100-01-01T00:00:00Z"))["events"] == []

    await error_of(await client.get("/v1/events/history?limit=0", headers=READ), 400)
    await error_of(await client.get("/v1/events/history?after=x", headers=READ), 400)
    await error_of(await client.get("/v1/events/history"), 401)
