"""Two controllers of one region on one nats-server: one leads by the KV lease, the other
stays hot; killing the leader hands over within the TTL + 1 s, and a node isolated before
or during the takeover is isolated exactly once (docs/operations.md)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import nats
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext

from metalguard.controller.core.lifecycle import LifecycleConfig
from metalguard.controller.leader import Leadership, region_leadership
from metalguard.controller.region import RegionController
from metalguard.controller.service import reload_on_election, start_ingest
from metalguard.controller.state.store import NodeStore
from metalguard.proto.base import NodeIdentity
from metalguard.proto.codec import decode, encode
from metalguard.proto.events import ControllerEvent
from metalguard.proto.subjects import Subjects
from metalguard.proto.telemetry import TelemetryBatch
from tests.support.harness.ha_leases import MARGIN_S, POLL_S, RENEW_S, TTL_S
from tests.support.scoring_helpers import dimm_mc
from tests.support.waiting import wait_for_line, wait_for_value, wait_until

INTERVAL_S = 0.5
NODES = ("n1", "n2", "n3", "n4")
LIFECYCLE = LifecycleConfig(rail_max_fraction=1.0)
DEADLINE_S = 20.0
METALGUARD = Path(sys.executable).parent / "metalguard"


@dataclass
class Ctl:
    """One controller process's parts, on its own connection."""

    instance: str
    nc: Client
    leadership: Leadership
    controller: RegionController
    stopped: bool = False
    tasks: list[object] = field(default_factory=list)

    def leading(self) -> bool:
        return not self.stopped and self.leadership.leading()


async def start_controller(url: str, subjects: Subjects, instance: str) -> Ctl:
    """What ``controller run`` with ``[ha] instance = ...`` starts, in this process."""
    nc = await nats.connect(url, connect_timeout=2, max_reconnect_attempts=1)
    js = nc.jetstream(timeout=5)
    store = await NodeStore.open(js, subjects)
    kv = await js.key_value(subjects.bucket("leases"))
    leadership = await region_leadership(
        kv, "r1", instance, renew_s=RENEW_S, poll_s=POLL_S, margin_s=MARGIN_S
    )
    controller = RegionController(js, store, subjects, "r1", LIFECYCLE, leading=leadership.leading)
    reload_on_election(leadership, controller)
    ingest = start_ingest(js, subjects, "r1", controller, instance)
    await leadership.start()
    await controller.start(silence_interval_s=INTERVAL_S)
    await ingest.start()
    ctl = Ctl(instance, nc, leadership, controller)
    ctl.tasks = [ingest]
    return ctl


async def kill(ctl: Ctl) -> None:
    """Stop abruptly: the lease is not released, nothing more is written."""
    ctl.stopped = True
    await ctl.leadership.stop(release=False)
    with contextlib.suppress(Exception):
        await ctl.nc.close()
    for ingest in ctl.tasks:
        with contextlib.suppress(Exception):
            await ingest.stop()  # type: ignore[attr-defined]
    with contextlib.suppress(Exception):
        await ctl.controller.stop()


async def stop(ctl: Ctl) -> None:
    if ctl.stopped:
        return
    ctl.stopped = True
    for ingest in ctl.tasks:
        await ingest.stop()  # type: ignore[attr-defined]
    await ctl.controller.stop()
    await ctl.leadership.stop()
    await ctl.nc.close()


@dataclass
class Fleet:
    """Publishes a batch of every node each interval; ``failing`` nodes report an UE."""

    js: JetStreamContext
    subjects: Subjects
    failing: set[str] = field(default_factory=set)
    seq: int = 0

    async def run(self) -> None:
        while True:
            self.seq += 1
            for name in NODES:
                ue = 1 if name in self.failing else 0
                batch = TelemetryBatch(
                    node=NodeIdentity(region="r1", cluster="c1", node=name),
                    seq=self.seq,
                    ts=time.time(),
                    interval_s=INTERVAL_S,
                    edac=(dimm_mc(ue=ue),),
                )
                subject = self.subjects.telemetry("r1", "c1", name)
                await self.js.publish(subject, encode(batch))
            await asyncio.sleep(INTERVAL_S)  # the fleet's pace, not a synchronisation


@pytest.fixture
async def fleet(nc: Client, short_leases: Subjects) -> AsyncIterator[Fleet]:
    f = Fleet(nc.jetstream(timeout=5), short_leases)
    task = asyncio.create_task(f.run())
    try:
        yield f
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def isolations(js: JetStreamContext, subjects: Subjects) -> list[str]:
    """The node of every node.isolated event in the control stream, in order."""
    info = await js.stream_info(subjects.stream_control)
    out: list[str] = []
    if info.state.messages == 0:
        return out
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        msg = await js.get_msg(subjects.stream_control, seq)
        assert msg.data is not None
        event = decode(msg.data, ControllerEvent)
        if event.kind == "node.isolated" and event.node is not None:
            out.append(event.node.node)
    return out


async def test_killed_leader_hands_over_within_ttl_and_nothing_is_isolated_twice(
    nc: Client, nats_url: str, fleet: Fleet
) -> None:
    subjects = fleet.subjects
    js = nc.jetstream(timeout=5)
    a = await start_controller(nats_url, subjects, "ctl-a")
    b: Ctl | None = None
    try:
        await wait_until(a.leading, DEADLINE_S, "controller a to lead")
        b = await start_controller(nats_url, subjects, "ctl-b")
        follower = b
        await wait_until(
            lambda: follower.leadership.status().get("leader") == "ctl-a",
            DEADLINE_S,
            "b to see a as the leader",
        )
        assert not b.leading()
        status = a.leadership.status()
        assert status["leader"] == status["self"] == "ctl-a"
        assert status["leading"]
        assert 0 < status["expires_in_s"] <= TTL_S

        # n2 fails while a leads: a isolates it.
        await wait_until(
            lambda: len(a.controller.store.records) == len(NODES), DEADLINE_S, "a knows the fleet"
        )
        fleet.failing.add("n2")
        await wait_until(
            lambda: a.controller.store.records["r1.c1.n2"].grade == "FAILING",
            DEADLINE_S,
            "a isolates n2",
        )
        assert b.controller.store.outbox == {}  # the follower wrote nothing

        # a dies; n3 fails during the takeover.
        killed = time.monotonic()
        await kill(a)
        fleet.failing.add("n3")
        await wait_until(follower.leading, DEADLINE_S, "b to lead")
        took = time.monotonic() - killed
        assert took <= TTL_S + 1.0, f"takeover took {took:.2f}s"
        print(f"takeover after the leader's death: {took:.2f}s (TTL {TTL_S}s)")
        assert b.leadership.status()["leader"] == "ctl-b"

        await wait_until(
            lambda: follower.controller.store.records["r1.c1.n3"].grade == "FAILING",
            DEADLINE_S,
            "b isolates n3",
        )
        # a few more rounds of the failing nodes' batches: nothing is decided again
        seen = fleet.seq
        await wait_until(lambda: fleet.seq >= seen + 3, DEADLINE_S, "three more rounds")
        await wait_until(lambda: not follower.controller.store.outbox, DEADLINE_S, "outbox empty")
        assert sorted(await isolations(js, subjects)) == ["n2", "n3"]
    finally:
        if b is not None:
            await stop(b)
        if not a.stopped:
            await stop(a)


async def test_clean_stop_releases_the_lease_at_once(
    nc: Client, nats_url: str, short_leases: Subjects
) -> None:
    a = await start_controller(nats_url, short_leases, "ctl-a")
    b = await start_controller(nats_url, short_leases, "ctl-b")
    try:
        await wait_until(a.leading, DEADLINE_S, "controller a to lead")
        assert not b.leading()
        stopped = time.monotonic()
        await stop(a)
        await wait_until(b.leading, DEADLINE_S, "b to lead")
        assert time.monotonic() - stopped < TTL_S  # released, not expired
        assert b.leadership.elections == 1
    finally:
        await stop(b)
        await stop(a)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


ADMIN_TOKEN = "admin-secret"


async def leader_of(url: str) -> dict[str, Any]:
    try:
        async with (
            aiohttp.ClientSession() as http,
            http.get(
                f"{url}/v1/leader",
                timeout=aiohttp.ClientTimeout(total=2),
                headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},  # open APIs ignore it
            ) as r,
        ):
            body: dict[str, Any] = await r.json()
            return body
    except (aiohttp.ClientError, TimeoutError):
        return {}


async def test_two_controller_processes_elect_one_leader_and_hand_over_on_sigkill(
    nats_url: str, short_leases: Subjects, tmp_path: Path
) -> None:
    procs: dict[str, asyncio.subprocess.Process] = {}
    urls: dict[str, str] = {}
    drains: list[asyncio.Task[bytes]] = []
    admin_tokens = tmp_path / "admin.tokens"
    admin_tokens.write_text(f"{ADMIN_TOKEN}\n")
    try:
        for instance in ("ctl-a", "ctl-b"):
            port = free_port()
            config = tmp_path / f"{instance}.toml"
            config.write_text(
                f'region = "r1"\nsilence_check_s = 0.5\n'
                f'[nats]\nservers = ["{nats_url}"]\nprefix = "{short_leases.prefix}"\n'
                f'[ha]\ninstance = "{instance}"\nrenew_s = {RENEW_S}\npoll_s = {POLL_S}\n'
                f"margin_s = {MARGIN_S}\n"
                f'[http]\nlisten = "127.0.0.1:{port}"\n'
                f'admin_tokens_file = "{admin_tokens}"\n'
            )
            procs[instance] = await asyncio.create_subprocess_exec(
                str(METALGUARD),
                "controller",
                "run",
                "--config",
                str(config),
                stderr=asyncio.subprocess.PIPE,
            )
            urls[instance] = f"http://127.0.0.1:{port}"
            seen: list[str] = []
            stderr = procs[instance].stderr
            assert stderr is not None
            await wait_for_line(stderr, "running", DEADLINE_S, seen)
            drains.append(asyncio.create_task(stderr.read()))  # never a full pipe
        views = {i: await leader_of(u) for i, u in urls.items()}
        leader = views["ctl-a"]["leader"]
        assert leader in urls
        assert all(v["leader"] == leader and v["ha"] for v in views.values()), views
        assert [i for i, v in views.items() if v["leading"]] == [leader]
        other = "ctl-b" if leader == "ctl-a" else "ctl-a"

        # an operator's action sent to the follower is refused, naming the leader
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                f"{urls[other]}/v1/nodes/r1.c1.n1/cordon",
                json={"reason": "disk swap"},
                headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
            ) as refused,
        ):
            assert refused.status == 503, await refused.text()
            error = (await refused.json())["error"]
            assert error["code"] == "not_leader"
            assert leader in error["message"]

        procs[leader].kill()  # SIGKILL: the lease is left to expire
        await procs[leader].wait()
        killed = time.monotonic()
        view = await wait_for_value(
            lambda: leader_of(urls[other]),
            lambda v: bool(v.get("leading")),
            DEADLINE_S,
            f"{other} to lead",
        )
        took = time.monotonic() - killed
        assert view["leader"] == other
        assert took <= TTL_S + 1.0 + 0.5, f"takeover took {took:.2f}s"  # + one HTTP poll
    finally:
        for proc in procs.values():
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
                await asyncio.wait_for(proc.wait(), DEADLINE_S)
        await asyncio.gather(*drains)
