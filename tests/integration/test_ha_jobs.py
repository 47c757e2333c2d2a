"""High availability with jobs (docs/operations.md): two ``metalguard controller run``
processes of one region with ``[ha]``, a simulated fleet whose agents run job members;
the leader is SIGKILLed while a job runs, and a node of that job fails during the
takeover: the new leader isolates the node exactly once and moves the job exactly once.
"""

from __future__ import annotations

import asyncio
import functools
import signal
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from metalguard.demo.run import WorkloadFleet
from metalguard.proto.codec import decode
from metalguard.proto.events import ControllerEvent
from metalguard.proto.subjects import Subjects
from tests.support.harness.ha_leases import MARGIN_S, POLL_S, RENEW_S, TTL_S
from tests.support.harness.supercluster import free_port
from tests.support.waiting import wait_for_value, wait_until

pytestmark = pytest.mark.skipif(
    sys.platform != "linux", reason="the simulated fleet runs its members as Linux processes"
)

ROOT = Path(__file__).resolve().parents[2]
METALGUARD = Path(sys.executable).parent / "metalguard"
TOKEN = "ha-jobs-admin"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}
DEADLINE_S = 60.0


async def get(http: aiohttp.ClientSession, url: str) -> Any:
    try:
        async with http.get(url, headers=HEADERS) as response:
            return await response.json() if response.status == 200 else None
    except aiohttp.ClientError:
        return None


def running_on_healthy(failed: str, body: Any) -> bool:
    return (
        body is not None
        and body["state"] == "running"
        and body["restarts"] == 1
        and failed not in body["placement"]
    )


async def test_a_job_on_a_node_failing_during_the_takeover_moves_exactly_once(
    nats_url: str,
    nc: Client,
    short_leases: Subjects,
    tmp_path: Path,
) -> None:
    subjects = short_leases
    events: list[ControllerEvent] = []

    async def on_event(msg: Msg) -> None:
        events.append(decode(msg.data, ControllerEvent))

    await nc.subscribe(subjects.control_all("r1"), cb=on_event)
    (tmp_path / "admin.tokens").write_text(f"{TOKEN}\n")
    procs: dict[str, asyncio.subprocess.Process] = {}
    urls: dict[str, str] = {}
    fleet = WorkloadFleet(
        tmp_path / "fleet", nats_url, region=1, clusters=1, racks=1, nodes_per_rack=4,
        interval_s=0.5, prefix=subjects.prefix, seed=3,
    )  # fmt: skip
    try:
        for instance in ("ctl-a", "ctl-b"):
            port = free_port()
            config = tmp_path / f"{instance}.toml"
            config.write_text(
                f'region = "r1"\nsilence_check_s = 0.5\n'
                f'[nats]\nservers = ["{nats_url}"]\nprefix = "{subjects.prefix}"\n'
                f'[ha]\ninstance = "{instance}"\nrenew_s = {RENEW_S}\npoll_s = {POLL_S}\n'
                f"margin_s = {MARGIN_S}\n"
                f'[http]\nlisten = "127.0.0.1:{port}"\n'
                f'admin_tokens_file = "{tmp_path / "admin.tokens"}"\n'
            )
            with (tmp_path / f"{instance}.log").open("wb") as log:
                procs[instance] = await asyncio.create_subprocess_exec(
                    str(METALGUARD), "controller", "run", "--config", str(config), stderr=log,
                )  # fmt: skip
            urls[instance] = f"http://127.0.0.1:{port}"
        await fleet.start()
        async with aiohttp.ClientSession() as http:
            views = {
                i: await wait_for_value(
                    functools.partial(get, http, f"{u}/v1/leader"),
                    lambda v: v is not None and bool(v.get("leader")),
                    DEADLINE_S,
                    f"{i} to know the leader",
                )
                for i, u in urls.items()
            }
            leader = views["ctl-a"]["leader"]
            other = "ctl-b" if leader == "ctl-a" else "ctl-a"

            def all_healthy(body: Any) -> bool:
                nodes = body["nodes"] if isinstance(body, dict) else body
                return (
                    bool(nodes) and len(nodes) == 4 and all(n["grade"] == "HEALTHY" for n in nodes)
                )

            await wait_for_value(
                functools.partial(get, http, f"{urls[leader]}/v1/nodes"),
                lambda b: b is not None and all_healthy(b), DEADLINE_S, "4 healthy nodes",
            )  # fmt: skip
            job = {
                "job_id": "ha-gang",
                "name": "ha",
                "nodes": 2,
                "command": "python",
                "args": [str(ROOT / "examples" / "trainer.py"), "--steps", "100000",
                         "--step-seconds", "0.05"],
                "checkpoint_dir": str(tmp_path / "ckpt"),
                "checkpoint_every": 0.5,
            }  # fmt: skip
            async with http.post(f"{urls[leader]}/v1/jobs", json=job, headers=HEADERS) as r:
                assert r.status == 201, await r.text()
            started = await wait_for_value(
                functools.partial(get, http, f"{urls[leader]}/v1/jobs/ha-gang"),
                lambda b: b is not None
                and b["state"] == "running"
                and b["last_checkpoint_step"] is not None,
                DEADLINE_S, "the job running with a checkpoint",
            )  # fmt: skip

            # The leader dies; a node of the job fails while nobody leads.
            procs[leader].kill()
            await procs[leader].wait()
            killed = time.monotonic()
            failed_handle = started["placement"][0]
            fleet.apply("ecc_ue", failed_handle.rsplit(".", 1)[-1])
            await wait_for_value(
                functools.partial(get, http, f"{urls[other]}/v1/leader"),
                lambda v: v is not None and bool(v.get("leading")),
                DEADLINE_S, f"{other} to lead",
            )  # fmt: skip
            took = time.monotonic() - killed
            assert took <= TTL_S + 1.0 + 0.5, f"takeover took {took:.2f}s"  # + one poll
            print(f"takeover after SIGKILL: {took:.2f}s (TTL {TTL_S}s)")
            moved = await wait_for_value(
                functools.partial(get, http, f"{urls[other]}/v1/jobs/ha-gang"),
                functools.partial(running_on_healthy, failed_handle),
                DEADLINE_S, "the job moved off the failed node by the new leader",
            )  # fmt: skip
            moved_s = time.monotonic() - killed
            print(f"leader killed -> job running on healthy nodes: {moved_s:.2f}s")
            # Some progress after the move, then count what was announced.
            step = moved["step"] or 0
            await wait_for_value(
                functools.partial(get, http, f"{urls[other]}/v1/jobs/ha-gang"),
                lambda b: b is not None and (b["step"] or 0) >= step + 10,
                DEADLINE_S, "the job to progress after the move",
            )  # fmt: skip
        failed_node = failed_handle.rsplit(".", 1)[-1]
        await wait_until(
            lambda: any(e.kind == "node.isolated" for e in events), DEADLINE_S, "isolation"
        )
        isolated = [
            e for e in events if e.kind == "node.isolated" and e.node and e.node.node == failed_node
        ]
        rescheduled = [e for e in events if e.kind == "job.rescheduled" and e.job_id == "ha-gang"]
        assert len(isolated) == 1, [(e.event_id, e.ts, e.message, e.attributes) for e in isolated]
        assert len(rescheduled) == 1, [(e.event_id, e.ts, e.message) for e in rescheduled]
    finally:
        await fleet.stop()
        for proc in procs.values():
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(proc.wait(), 30)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()
