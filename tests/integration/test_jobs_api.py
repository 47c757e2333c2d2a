"""``/v1/jobs`` (controller/api_jobs.py) over a real MG_JOBS bucket, and ``metalguard jobs``
as a subprocess against it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from nats.aio.client import Client

from metalguard.controller.api.app import make_app
from metalguard.controller.api.events import HUB
from metalguard.controller.api.nodes import VIEW
from metalguard.controller.core.topology import TopologyView
from metalguard.controller.jobs.manager import JobManager
from metalguard.controller.jobs.store import JobStore
from metalguard.proto.nodes import NodeRecord
from metalguard.proto.subjects import Subjects
from tests.support.clock import ManualClock
from tests.support.harness.api_env import ADMIN_TOKEN, READ_TOKEN, api_env
from tests.support.waiting import wait_for_line

METALGUARD = Path(sys.executable).parent / "metalguard"
READ = {"Authorization": f"Bearer {READ_TOKEN}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

JOB = """\
name = "llm-small"
tenant = "research"
nodes = 4
command = "python"
args = ["examples/trainer.py", "--steps", "100"]
checkpoint_every = 5.0
max_spread = "cluster"
[env]
SEED = "7"
"""


@dataclass
class NoNodes:
    """A region with no node records yet: jobs stay queued."""

    records: Mapping[str, NodeRecord] = field(default_factory=dict)


@dataclass
class Env:
    client: TestClient[Any, Any]
    manager: JobManager
    subjects: Subjects
    nc: Client
    clock: ManualClock

    @property
    def url(self) -> str:
        return str(self.client.make_url("")).rstrip("/")


@pytest.fixture
async def env(nc: Client, subjects: Subjects) -> AsyncIterator[Env]:
    async with api_env(nc, subjects) as api:
        js = nc.jetstream(timeout=5)
        store = await JobStore.open(js, subjects)
        manager = JobManager(
            nc, js, store, NoNodes(), subjects, "r1", fleet=TopologyView().fleet, clock=api.clock
        )
        app = make_app(
            api.controller,
            api.source,
            read_tokens={READ_TOKEN},
            admin_tokens={ADMIN_TOKEN},
            jobs=manager,
        )
        async with TestClient(TestServer(app)) as client:
            yield Env(client, manager, subjects, nc, api.clock)


async def cli(env: Env, *args: str, token: str = ADMIN_TOKEN) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        str(METALGUARD),
        "jobs",
        *args,
        "--api",
        env.url,
        "--token",
        token,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "COLUMNS": "200"},
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_submit_list_show_and_the_bucket_holds_the_job(env: Env) -> None:
    response = await env.client.post(
        "/v1/jobs", data=JOB.encode(), headers={**ADMIN, "Content-Type": "application/toml"}
    )
    assert response.status == 201, await response.text()
    created = await response.json()
    job_id = created["id"]
    assert created["state"] == "queued"
    assert created["status"]["job"]["args"] == ["examples/trainer.py", "--steps", "100"]

    listed = await (await env.client.get("/v1/jobs", headers=READ)).json()
    assert [j["id"] for j in listed["jobs"]] == [job_id]
    running = await (await env.client.get("/v1/jobs?state=running", headers=READ)).json()
    assert running["jobs"] == []
    shown = await (await env.client.get(f"/v1/jobs/{job_id}", headers=READ)).json()
    assert shown["status"]["history"][0]["reason"] == "submitted"

    # a fresh store (a restarted controller) reads the same job back from MG_JOBS
    fresh = await JobStore.open(env.nc.jetstream(timeout=5), env.subjects)
    stored = fresh.jobs[job_id]
    assert stored.state == "queued"
    assert stored.job is not None
    assert stored.job.env == {"SEED": "7"}


async def test_invalid_job_is_422_with_every_reason_and_nothing_stored(env: Env) -> None:
    bad = {"name": "", "nodes": 0, "command": "", "colour": "blue", "max_spread": "planet"}
    response = await env.client.post("/v1/jobs", json=bad, headers=ADMIN)
    assert response.status == 422
    error = (await response.json())["error"]
    assert error["code"] == "invalid_job"
    keys = sorted(r.split(":")[0] for r in error["reasons"])
    assert keys == ["colour", "max_spread", "nodes"]
    assert env.manager.jobs == {}
    response = await env.client.post("/v1/jobs", json={"name": "x"}, headers=READ)
    assert response.status == 403


async def test_duplicate_id_is_409_and_unknown_job_404(env: Env) -> None:
    job = {"job_id": "fixed-1", "name": "x", "command": "python"}
    assert (await env.client.post("/v1/jobs", json=job, headers=ADMIN)).status == 201
    again = await env.client.post("/v1/jobs", json=job, headers=ADMIN)
    assert again.status == 409
    assert (await env.client.get("/v1/jobs/nope", headers=READ)).status == 404
    assert (await env.client.delete("/v1/jobs/nope", headers=ADMIN)).status == 404


async def test_cli_submit_list_show_cancel(env: Env, tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text(JOB)
    code, out, err = await cli(env, "submit", str(path), "--priority", "5", "--env", "X=1")
    assert code == 0, err
    job_id = out.split(":")[0]
    status = env.manager.jobs[job_id]
    assert status.job is not None
    assert status.job.priority == 5
    assert status.job.env == {"SEED": "7", "X": "1"}

    code, out, _ = await cli(env, "list")
    assert code == 0
    assert job_id in out
    assert "queued" in out
    code, out, _ = await cli(env, "show", job_id, "--format", "json")
    assert json.loads(out)["status"]["job"]["name"] == "llm-small"

    code, out, _ = await cli(env, "cancel", job_id)
    assert code == 0
    assert "cancel requested" in out
    await env.manager.run_pass()
    assert env.manager.jobs[job_id].state == "cancelled"
    code, out, _ = await cli(env, "show", job_id)
    assert "cancelled by request" in out


async def test_cli_invalid_job_exits_2_with_the_reasons(env: Env) -> None:
    code, _, err = await cli(env, "submit", "--name", "x", "--nodes", "0")
    assert code == 2
    assert "invalid job" in err
    assert "nodes: Expected `int` >= 1" in err
    assert "command: must not be empty" not in err  # type errors first, then semantics


async def test_cli_elastic_bounds_are_checked_and_kept(env: Env) -> None:
    code, _, err = await cli(
        env, "submit", "--name", "x", "--command", "true", "--min-nodes", "4", "--max-nodes", "2"
    )
    assert code == 2
    assert "min_nodes: must be <= max_nodes (4 > 2)" in err
    code, out, err = await cli(
        env, "submit", "--name", "el", "--command", "true", "--min-nodes", "2",
        "--max-nodes", "8", "--resize-interval-s", "60",
    )  # fmt: skip
    assert code == 0, err
    job = env.manager.jobs[out.split(":")[0]].job
    assert job is not None
    assert (job.nodes, job.min_nodes, job.max_nodes, job.resize_interval_s) == (2, 2, 8, 60.0)


async def test_controller_run_serves_the_jobs_api_from_mg_jobs(
    nc: Client, nats_url: str, tmp_path: Path, subjects: Subjects
) -> None:
    """``metalguard controller run`` runs the job manager: a job submitted through one
    controller process is listed by the next one (it lives in MG_JOBS)."""
    (tmp_path / "admin.tokens").write_text(f"{ADMIN_TOKEN}\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    config = tmp_path / "controller.toml"
    config.write_text(
        f'region = "r1"\n[nats]\nservers = ["{nats_url}"]\nprefix = "{subjects.prefix}"\n'
        f'[http]\nlisten = "127.0.0.1:{port}"\n'
        f'admin_tokens_file = "{tmp_path / "admin.tokens"}"\n'
    )
    url = f"http://127.0.0.1:{port}"

    async def controller(*cli_args: str) -> tuple[int, str]:
        proc = await asyncio.create_subprocess_exec(
            str(METALGUARD), "controller", "run", "--config", str(config),
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert proc.stderr is not None
        try:
            await wait_for_line(proc.stderr, "running", 30, [])
            run = await asyncio.create_subprocess_exec(
                str(METALGUARD), "jobs", *cli_args, "--api", url, "--token", ADMIN_TOKEN,
                stdout=asyncio.subprocess.PIPE,
            )  # fmt: skip
            out, _ = await asyncio.wait_for(run.communicate(), 30)
            assert run.returncode is not None
            proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(proc.communicate(), 30)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        assert proc.returncode == 0
        return run.returncode, out.decode()

    code, out = await controller("submit", "--name", "kept", "--command", "python")
    assert code == 0
    job_id = out.split(":")[0]
    code, out = await controller("list", "--format", "json")
    assert code == 0
    (job,) = json.loads(out)["jobs"]
    assert (job["id"], job["state"]) == (job_id, "queued")  # no node yet: waiting


async def test_a_follower_serves_reads_from_mg_jobs_and_refuses_writes(env: Env) -> None:
    created = await env.manager.submit({"name": "x", "command": "python"})
    js = env.nc.jetstream(timeout=5)
    follower = JobManager(
        env.nc, js, JobStore(await js.key_value(env.subjects.bucket("jobs")), js), NoNodes(),
        env.subjects, "r1", fleet=TopologyView().fleet, leading=lambda: False,
    )  # fmt: skip
    await follower.run_pass()  # a follower's pass only reloads MG_JOBS
    assert follower.jobs[created.job_id].state == "queued"
    app = make_app(
        env.client.app[VIEW], env.client.app[HUB].source, admin_tokens={ADMIN_TOKEN},
        jobs=follower,
    )  # fmt: skip
    async with TestClient(TestServer(app)) as client:
        listed = await (await client.get("/v1/jobs", headers=ADMIN)).json()
        assert [j["id"] for j in listed["jobs"]] == [created.job_id]
        response = await client.post("/v1/jobs", json={"name": "y", "command": "p"}, headers=ADMIN)
        assert response.status == 503
        assert (await response.json())["error"]["code"] == "not_leader"
        cancel = await client.delete(f"/v1/jobs/{created.job_id}", headers=ADMIN)
        assert cancel.status == 503
