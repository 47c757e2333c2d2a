"""``/v1/tenants`` (controller/api/tenants.py) over a real MG_TENANTS bucket and the job
manager, and ``metalguard tenants`` as a subprocess against it; the config's
``[[tenants]]`` seeding the bucket (docs/scheduler.md "Tenant quotas")."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from nats.aio.client import Client

from metalguard.controller.api.app import make_app
from metalguard.controller.config import configured_quotas, parse_config
from metalguard.controller.jobs.manager import JobManager
from metalguard.controller.jobs.scheduler import FleetNode
from metalguard.controller.jobs.store import JobStore
from metalguard.controller.jobs.tenant_store import TenantStore
from metalguard.proto.nodes import NodeRecord
from metalguard.proto.subjects import Subjects
from metalguard.proto.tenants import TenantQuota
from tests.support.harness.api_env import ADMIN_TOKEN, READ_TOKEN, api_env

METALGUARD = Path(sys.executable).parent / "metalguard"
READ = {"Authorization": f"Bearer {READ_TOKEN}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
FLEET = [
    FleetNode(handle=f"r1.c1.n{i}", region="r1", cluster="c1", rack="k1", gpus=8, gpu_type="h100")
    for i in range(4)
]
"""Four 8-GPU nodes: 32 GPUs."""


@dataclass
class NoRecords:
    records: Mapping[str, NodeRecord] = field(default_factory=dict)


@dataclass
class Env:
    client: TestClient[Any, Any]
    manager: JobManager
    tenants: TenantStore

    @property
    def url(self) -> str:
        return str(self.client.make_url("")).rstrip("/")


@pytest.fixture
async def env(nc: Client, subjects: Subjects) -> AsyncIterator[Env]:
    async with api_env(nc, subjects) as api:
        js = nc.jetstream(timeout=5)
        tenants = await TenantStore.open(js, subjects)
        manager = JobManager(
            nc, js, await JobStore.open(js, subjects), NoRecords(), subjects, "r1",
            fleet=lambda _records: FLEET, clock=api.clock, tenants=tenants,
        )  # fmt: skip
        app = make_app(
            api.controller,
            api.source,
            read_tokens={READ_TOKEN},
            admin_tokens={ADMIN_TOKEN},
            jobs=manager,
            tenants=manager,
        )
        async with TestClient(TestServer(app)) as client:
            yield Env(client, manager, tenants)


async def cli(env: Env, *args: str, token: str = ADMIN_TOKEN) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        str(METALGUARD), "tenants", *args, "--api", env.url, "--token", token,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def put(env: Env, name: str, body: Any, headers: Mapping[str, str] = ADMIN) -> Any:
    return await env.client.put(f"/v1/tenants/{name}", json=body, headers=dict(headers))


async def test_set_list_show_and_the_bucket_keeps_the_quota(
    env: Env, nc: Client, subjects: Subjects
) -> None:
    response = await put(env, "team-a", {"gpus": 16, "borrow_limit": 8})
    assert response.status == 200, await response.text()
    body = await response.json()
    assert body["quota"]["gpus"] == 16
    assert body["quota"]["borrow_limit"] == 8
    assert body["usage"]["guarantee"] == 16

    await env.manager.submit({"name": "w", "tenant": "research", "nodes": 2, "command": "x"})
    listed = await (await env.client.get("/v1/tenants", headers=READ)).json()
    assert listed["fleet_gpus"] == 32
    by_name = {t["name"]: t for t in listed["tenants"]}
    assert by_name["team-a"]["guarantee"] == 16
    assert by_name["team-a"]["in_use"] == 0
    # a tenant without a quota is listed by its jobs: it waits for 2 whole 8-GPU nodes
    assert by_name["research"]["quota"] is None
    assert (by_name["research"]["waiting"], by_name["research"]["waiting_jobs"]) == (16, 1)

    shown = await (await env.client.get("/v1/tenants/team-a", headers=READ)).json()
    assert shown["quota"]["updated_by"] == "api"
    assert (await env.client.get("/v1/tenants/nobody", headers=READ)).status == 404

    # a restarted controller reads the quota back from MG_TENANTS
    fresh = await TenantStore.open(nc.jetstream(timeout=5), subjects)
    assert fresh.quotas["team-a"].gpus == 16


async def test_bad_quotas_are_400_with_the_field_and_nothing_is_stored(env: Env) -> None:
    cases = [
        ({"gpus": -1}, "tenants.team-a.gpus: must not be negative"),
        ({"gpus": 8, "colour": "blue"}, "tenants.team-a.colour: unknown key"),
        ({"gpus": "eight"}, "tenants.team-a.gpus: must be a whole number"),
        ({"gpus": 8, "gpus_by_type": {"h100": 16}}, "tenants.team-a.gpus_by_type"),
        ({"gpus": 8, "lend_limit": 9}, "tenants.team-a.lend_limit"),
        ({"gpus": 64}, "the fleet has 32"),
        ([1, 2], "must be a JSON object"),
    ]
    for body, named in cases:
        response = await put(env, "team-a", body)
        assert response.status == 400, (body, await response.text())
        assert named in (await response.json())["error"]["message"], body
    assert env.tenants.quotas == {}
    assert (await put(env, "team-a", {"gpus": 24})).status == 200
    # together beyond the fleet: 24 + 16 > 32
    response = await put(env, "team-b", {"gpus": 16})
    assert response.status == 400
    assert "add up to 40 GPUs, the fleet has 32" in (await response.json())["error"]["message"]
    assert set(env.tenants.quotas) == {"team-a"}
    # no token, a read token: refused
    assert (await put(env, "team-b", {"gpus": 1}, headers={})).status == 401
    assert (await put(env, "team-b", {"gpus": 1}, headers=READ)).status == 403
    bad_name = await env.client.put("/v1/tenants/a.b", json={"gpus": 1}, headers=ADMIN)
    assert bad_name.status == 400


async def test_cli_set_list_show_and_bad_input_exits_2(env: Env) -> None:
    code, out, err = await cli(env, "set", "team-b", "--gpus", "8", "--borrow-limit", "4")
    assert code == 0, err
    assert "8 GPUs" in out
    assert env.tenants.quotas["team-b"].borrow_limit == 4
    code, out, err = await cli(env, "set", "team-c", "--gpus", "8", "--gpu-type", "h100=8")
    assert code == 0, err
    assert env.tenants.quotas["team-c"].gpus_by_type == {"h100": 8}

    code, out, _ = await cli(env, "list")
    assert code == 0
    assert "team-b" in out
    assert "fleet: 32 GPUs" in out
    code, out, _ = await cli(env, "show", "team-b", "--format", "json")
    assert code == 0
    assert json.loads(out)["quota"]["gpus"] == 8

    code, _, err = await cli(env, "set", "team-b", "--gpus", "-3")
    assert code == 2
    assert "gpus" in err
    code, _, err = await cli(env, "set", "team-b", "--gpus", "99")
    assert code == 2
    assert "the fleet has 32" in err
    code, _, err = await cli(env, "set", "team-b", "--gpus", "8", "--gpu-type", "h100")
    assert code == 2
    assert "TYPE=N" in err
    code, _, _ = await cli(env, "show", "nobody")
    assert code == 2
    assert env.tenants.quotas["team-b"].gpus == 8  # nothing refused was stored


async def test_the_config_seeds_the_bucket_and_keeps_what_the_api_set(
    nc: Client, subjects: Subjects
) -> None:
    cfg = parse_config(
        'region = "r1"\n'
        '[[tenants]]\nname = "team-a"\ngpus = 16\n'
        '[[tenants]]\nname = "team-b"\ngpus = 8\nlend_limit = 4\n',
        "controller.toml",
    )
    js = nc.jetstream(timeout=5)
    store = await TenantStore.open(js, subjects)
    assert await store.seed(configured_quotas(cfg)) == ["team-a", "team-b"]
    assert store.quotas["team-b"].lend_limit == 4
    await store.put(TenantQuota(name="team-a", gpus=4, updated_by="api"))
    again = await TenantStore.open(js, subjects)  # a restarted controller seeds again
    assert await again.seed(configured_quotas(cfg)) == []
    assert again.quotas["team-a"].gpus == 4
