"""Two regions on two nats-servers joined by a gateway, each with JetStream in its own
account, a ``metalguard controller run`` per region and a simulated fleet per region
(docs/federation.md, docs/operations.md):

- ``GET /v1/fleet`` on either controller lists both regions;
- a job too big for r1 runs in r2 (forwarded) and shows from r1, while one whose
  ``max_latency_ms`` excludes r2 stays queued in r1 with the reason;
- the gateway cut (r2's server restarted without it): each region still isolates its
  failing node, and sees the other as stale;
- the gateway back: both views converge within a few summary intervals.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import nats
import pytest
from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.js.errors import Error as JsError

from metalguard.demo.run import WorkloadFleet
from tests.support.harness.supercluster import RegionServer, free_port
from tests.support.waiting import wait_for_value

pytestmark = pytest.mark.skipif(
    sys.platform != "linux", reason="the simulated fleet runs its members as Linux processes"
)

ROOT = Path(__file__).resolve().parents[2]
METALGUARD = Path(sys.executable).parent / "metalguard"
TOKEN = "fed-admin-token"
INTERVAL_S = 0.5
"""Summary interval: stale after 1.5 s."""
R1_TO_R2_MS = 40.0
"""The WAN latency r1 declares for r2 (loopback's measured one is far below 1 ms)."""
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
JS_READY_S = 60.0
DEADLINE_S = 30.0


@dataclass
class Region:
    name: str
    number: int
    server: RegionServer
    api: str
    log: Path
    proc: asyncio.subprocess.Process | None = None
    fleet: WorkloadFleet | None = None


def controller_toml(region: Region, tmp: Path) -> str:
    latency = f"latency_ms = {{ r2 = {R1_TO_R2_MS} }}\n" if region.name == "r1" else ""
    return (
        f'region = "{region.name}"\n'
        f'[nats]\nservers = ["{region.server.url}"]\nprefix = "mg"\n'
        "connect_deadline_s = 30.0\n"
        f'[http]\nlisten = "{region.api.removeprefix("http://")}"\n'
        f'admin_tokens_file = "{tmp / "admin.tokens"}"\n'
        f"[federation]\nenabled = true\ninterval_s = {INTERVAL_S}\n{latency}"
    )


async def js_ready(url: str) -> None:
    """Wait until the region's account has JetStream (the meta leader is elected); the
    connection itself is retried within the same deadline (a loaded machine: a CI run
    once saw the first connect refused)."""

    async def connected() -> Client | None:
        try:
            return await nats.connect(url, connect_timeout=5, max_reconnect_attempts=5)
        except (OSError, NatsError, TimeoutError):
            return None

    nc = await wait_for_value(connected, lambda c: c is not None, JS_READY_S, f"NATS at {url}")
    assert nc is not None
    try:

        async def probe() -> bool:
            try:
                await nc.jetstream(timeout=2).account_info()
            except (JsError, NatsError, TimeoutError):
                return False
            return True

        await wait_for_value(probe, bool, JS_READY_S, f"JetStream at {url}")
    finally:
        await nc.close()


async def get(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url, headers=ADMIN) as response:
        return await response.json() if response.status == 200 else None


async def try_get(session: aiohttp.ClientSession, url: str) -> Any:
    try:
        return await get(session, url)
    except aiohttp.ClientError:
        return None


async def cli(api: str, *args: str) -> str:
    """``metalguard ARGS --api API --token T``: its output (exit 0 asserted)."""
    proc = await asyncio.create_subprocess_exec(
        str(METALGUARD), *args, "--api", api, "--token", TOKEN,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), DEADLINE_S)
    assert proc.returncode == 0, err.decode()
    return out.decode()


def fleet_of(body: Any) -> dict[str, dict[str, Any]]:
    return {r["region"]: r for r in body["regions"]} if body else {}


def sees_stale(other: str, body: Any) -> bool:
    return fleet_of(body).get(other, {}).get("stale") is True


@pytest.fixture
async def regions(tmp_path: Path) -> AsyncIterator[dict[str, Region]]:
    (tmp_path / "admin.tokens").write_text(f"{TOKEN}\n")
    servers = [RegionServer("r1", tmp_path), RegionServer("r2", tmp_path)]
    out = {
        s.region: Region(
            s.region, i + 1, s, f"http://127.0.0.1:{free_port()}", tmp_path / f"{s.region}.log"
        )
        for i, s in enumerate(servers)
    }
    try:
        for s in servers:
            s.start(servers)
        for s in servers:
            await js_ready(s.url)
        for region in out.values():
            config = tmp_path / f"{region.name}.toml"
            config.write_text(controller_toml(region, tmp_path))
            with region.log.open("wb") as log:
                region.proc = await asyncio.create_subprocess_exec(
                    str(METALGUARD), "controller", "run", "--config", str(config),
                    stderr=log, cwd=ROOT, env=os.environ | {"PYTHONUNBUFFERED": "1"},
                )  # fmt: skip
            nodes = 2 if region.name == "r1" else 4  # r1 cannot hold a 3-node gang
            region.fleet = WorkloadFleet(
                tmp_path / f"fleet-{region.name}", region.server.url, region=region.number,
                clusters=1, racks=1, nodes_per_rack=nodes, interval_s=0.5, seed=region.number,
            )  # fmt: skip
            await region.fleet.start()
        yield out
    finally:
        for region in out.values():
            if region.fleet is not None:
                await region.fleet.stop()
            if region.proc is not None and region.proc.returncode is None:
                region.proc.send_signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(region.proc.wait(), 20)
                except TimeoutError:
                    region.proc.kill()
                    await region.proc.wait()
        for s in servers:
            s.stop()


def log_tail(region: Region) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(region.log.read_text(errors="replace").splitlines()[-30:])
    return ""


async def test_two_regions_forward_jobs_survive_a_cut_and_converge(
    regions: dict[str, Region], tmp_path: Path
) -> None:
    r1, r2 = regions["r1"], regions["r2"]
    async with aiohttp.ClientSession() as http:

        def both_heard(body: Any) -> bool:
            seen = fleet_of(body)
            return set(seen) == {"r1", "r2"} and all(
                not r["stale"] and r["nodes"] == n
                for r, n in ((seen.get("r1", {}), 2), (seen.get("r2", {}), 4))
                if r
            )

        for region in (r1, r2):
            try:
                await wait_for_value(
                    functools.partial(try_get, http, f"{region.api}/v1/fleet"),
                    both_heard, 60, f"{region.name}'s /v1/fleet to list both regions",
                )  # fmt: skip
            except AssertionError:
                print(log_tail(region))
                raise
        fleet = fleet_of(await get(http, f"{r1.api}/v1/fleet"))
        assert fleet["r2"]["latency_ms"] == R1_TO_R2_MS  # declared
        assert fleet["r2"]["rtt_ms"] is not None  # measured between the controllers

        # A 3-node job does not fit r1 (2 nodes): it is forwarded to r2 and runs there.
        trainer = str(ROOT / "examples" / "trainer.py")
        big = {
            "job_id": "big-gang",
            "name": "big",
            "nodes": 3,
            "command": "python",
            "args": [trainer, "--steps", "100000", "--step-seconds", "0.05"],
            "checkpoint_dir": str(tmp_path / "ckpt"),
        }
        async with http.post(f"{r1.api}/v1/jobs", json=big, headers=ADMIN) as response:
            body = await response.json()
            assert response.status == 201, body
        assert body["region"] == "r2"
        assert "forwarded from r1" in body["status"]["history"][0]["reason"]

        async def big_from_r1() -> Any:
            return await get(http, f"{r1.api}/v1/jobs/big-gang")

        shown = await wait_for_value(
            big_from_r1, lambda b: b is not None and b["state"] == "running", DEADLINE_S,
            "the forwarded job to run in r2, shown from r1",
        )  # fmt: skip
        assert shown["region"] == "r2"
        assert all(p.startswith("r2.") for p in shown["placement"])
        assert len(shown["placement"]) == 3
        assert "big-gang" not in {j["id"] for j in (await get(http, f"{r1.api}/v1/jobs"))["jobs"]}

        # The same gang with max_latency_ms below r1 -> r2: never sent there, queued in r1.
        near = big | {"job_id": "near-gang", "name": "near", "max_latency_ms": 10.0}
        async with http.post(f"{r1.api}/v1/jobs", json=near, headers=ADMIN) as response:
            body = await response.json()
            assert response.status == 201, body
        assert body["region"] == "r1"
        assert body["state"] == "queued"
        assert "r2: latency 40 ms > max_latency_ms 10" in body["reason"]
        from_r2 = await get(http, f"{r2.api}/v1/jobs/near-gang")  # r2 asks r1 for it
        assert (from_r2["region"], from_r2["state"]) == ("r1", "queued")
        r2_jobs = {j["id"] for j in (await get(http, f"{r2.api}/v1/jobs"))["jobs"]}
        assert r2_jobs == {"big-gang"}
        still = await get(http, f"{r1.api}/v1/jobs/near-gang")
        assert (still["state"], still["region"]) == ("queued", "r1")

        # The CLI over r1's API: the fleet with the latencies, a job of r2 by its id.
        fleet_table = await cli(r1.api, "fleet")
        assert "r1 (here)" in fleet_table
        assert "40 ms" in fleet_table
        shown_text = await cli(r1.api, "jobs", "show", "big-gang")
        assert "region" in shown_text
        assert "r2" in shown_text

        # The gateway cut: r2's server restarted on its own (no gateway, JetStream alone).
        r2.server.start([r1.server, r2.server], gateway=False)
        for region, other in ((r1, "r2"), (r2, "r1")):
            await wait_for_value(
                functools.partial(try_get, http, f"{region.api}/v1/fleet"),
                functools.partial(sees_stale, other),
                DEADLINE_S, f"{region.name} to see {other} stale",
            )  # fmt: skip
        # A gang submitted while r2 is cut off waits in r1, saying why.
        during = big | {"job_id": "cut-gang", "name": "cut"}
        async with http.post(f"{r1.api}/v1/jobs", json=during, headers=ADMIN) as response:
            body = await response.json()
            assert response.status == 201, body
        assert (body["region"], body["state"]) == ("r1", "queued")
        assert "r2: stale (cut off)" in body["reason"]

        failing = {"r1": "r1c1k1n2", "r2": "r2c1k1n4"}
        for region in (r1, r2):
            assert region.fleet is not None
            region.fleet.apply("ecc_ue", failing[region.name])
        for region in (r1, r2):
            handle = f"{region.name}.c1.{failing[region.name]}"
            try:
                await wait_for_value(
                    functools.partial(try_get, http, f"{region.api}/v1/nodes/{handle}"),
                    lambda b: b is not None and b["record"]["grade"] == "FAILING",
                    DEADLINE_S, f"{region.name} to isolate {handle} while cut off",
                )  # fmt: skip
            except AssertionError:
                print(log_tail(region))
                raise

        # The gateway back: both views converge (each sees the other's isolation).
        r2.server.start([r1.server, r2.server], gateway=True)
        healed = time.monotonic()

        async def views() -> tuple[Any, Any]:
            return (
                await try_get(http, f"{r1.api}/v1/fleet"),
                await try_get(http, f"{r2.api}/v1/fleet"),
            )

        def converged(pair: tuple[Any, Any]) -> bool:
            a, b = fleet_of(pair[0]), fleet_of(pair[1])
            if set(a) != {"r1", "r2"} or set(b) != {"r1", "r2"}:
                return False
            return all(
                not a[r]["stale"]
                and not b[r]["stale"]
                and a[r]["grades"] == b[r]["grades"]
                and a[r]["grades"]["FAILING"] == 1
                for r in ("r1", "r2")
            )

        try:
            await wait_for_value(views, converged, 60, "both views to converge")
            print(f"gateway back -> views converged: {time.monotonic() - healed:.2f}s")
        except AssertionError:
            print(log_tail(r1), log_tail(r2), sep="\n")
            raise

        # A job of r2 cancelled through r1's API (it holds r2's 3 healthy nodes: r2 has
        # no free node for the waiting gang until it ends).
        async with http.delete(f"{r1.api}/v1/jobs/big-gang", headers=ADMIN) as response:
            body = await response.json()
            assert response.status == 202, body
        assert body["region"] == "r2"
        await wait_for_value(
            functools.partial(try_get, http, f"{r2.api}/v1/jobs/big-gang"),
            lambda b: b is not None and b["state"] == "cancelled",
            DEADLINE_S, "the job cancelled in r2",
        )  # fmt: skip

        # ... and with r2 heard again and its 3 healthy nodes free, the waiting gang goes
        # there (r1 now has 1).
        moved = await wait_for_value(
            functools.partial(try_get, http, f"{r1.api}/v1/jobs/cut-gang"),
            lambda b: b is not None and b.get("region") == "r2",
            DEADLINE_S, "the gang queued during the cut to be forwarded to r2",
        )  # fmt: skip
        assert moved["status"]["history"][0]["reason"] == "forwarded from r1"
        async with http.delete(f"{r1.api}/v1/jobs/nowhere", headers=ADMIN) as response:
            assert response.status == 404
        assert "cut-gang" not in {j["id"] for j in (await get(http, f"{r1.api}/v1/jobs"))["jobs"]}
