"""Per-node NATS security on a nats-server started with the configuration that
``metalguard creds`` generates (docs/security.md): a node speaks only for itself, hears
only its own commands, a subscriber only reads, and the controller and a real agent
publisher work with their own credentials."""

from __future__ import annotations

import asyncio
import contextlib
import random
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import ConsumerConfig

from metalguard.agent.publisher import Publisher, PublisherSettings
from metalguard.agent.spool import Spool
from metalguard.controller.broker.server import NatsServer
from metalguard.controller.region import RegionController
from metalguard.controller.service import start_ingest
from metalguard.controller.state.store import NodeStore
from metalguard.controller.state.streams import ensure_streams
from metalguard.proto.base import NodeIdentity
from metalguard.proto.codec import encode
from metalguard.proto.subjects import Subjects
from metalguard.proto.telemetry import TelemetryBatch
from tests.support.scoring_helpers import dimm_mc
from tests.support.waiting import wait_until

METALGUARD = Path(sys.executable).parent / "metalguard"
S = Subjects("mg")
DEADLINE_S = 30.0
NODE_A, NODE_B = "r1.c1.a", "r1.c1.b"


@dataclass(frozen=True)
class Creds:
    dir: Path
    url: str

    def seed(self, kind: str, name: str) -> str:
        return str(self.dir / kind / f"{name}.nk")


def creds(*args: str) -> str:
    """Run ``metalguard creds ...``; its output."""
    done = subprocess.run(
        [str(METALGUARD), "creds", *args], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Creds]:
    """Credentials made by the CLI, and a JetStream server that includes its conf."""
    root = tmp_path_factory.mktemp("secured")
    directory = root / "creds"
    creds("init", "--dir", str(directory))
    for node in (NODE_A, NODE_B):
        out = creds("add-node", "--dir", str(directory), "--node", node)
        assert f'inbox_prefix = "_INBOX_MG.{node}"' in out
    creds("add-subscriber", "--dir", str(directory), "--name", "audit")
    conf = root / "server.conf"
    conf.write_text(
        "listen: 127.0.0.1:-1\n"
        f'jetstream {{ store_dir: "{root / "js"}" }}\n'
        "include ./creds/nats-server.conf\n"
    )
    server = NatsServer(config_file=conf)
    server.start()
    try:
        yield Creds(directory, server.url)
    finally:
        server.close()


@dataclass
class Errors:
    seen: list[str] = field(default_factory=list)

    def callback(self) -> Callable[[Exception], Awaitable[None]]:
        async def on_error(exc: Exception) -> None:
            self.seen.append(str(exc))

        return on_error

    def violation(self, text: str) -> bool:
        return any("permissions violation" in s.lower() and text in s for s in self.seen)

    async def expect_violation(self, text: str) -> None:
        """Wait for the server's permissions violation naming ``text``."""
        with contextlib.suppress(AssertionError):
            await wait_until(lambda: self.violation(text), DEADLINE_S, "a violation")
        assert self.violation(text), f"no permissions violation for {text}: {self.seen}"


async def connect(c: Creds, kind: str, name: str, errors: Errors | None = None) -> Client:
    options: dict[str, Any] = {
        "nkeys_seed": c.seed(kind, name),
        "connect_timeout": 2,
        "max_reconnect_attempts": 1,
        "error_cb": (errors or Errors()).callback(),
    }
    if kind == "nodes":
        options["inbox_prefix"] = f"_INBOX_MG.{name}"
    elif kind == "subscribers":
        options["inbox_prefix"] = f"_INBOX_MG.sub.{name}"
    return await nats.connect(c.url, **options)


@pytest.fixture
async def controller_nc(secured: Creds) -> AsyncIterator[Client]:
    nc = await connect(secured, "controllers", "controller")
    await ensure_streams(nc.jetstream(timeout=5), S)
    try:
        yield nc
    finally:
        await nc.close()


def batch(node: str, seq: int) -> TelemetryBatch:
    region, cluster, name = node.split(".")
    return TelemetryBatch(
        node=NodeIdentity(region=region, cluster=cluster, node=name),
        seq=seq,
        ts=1_800_000_000.0 + seq,
        interval_s=5.0,
        edac=(dimm_mc(),),
    )


async def first_after_markers(nc: Client, sub: Any, marker: str) -> Msg:
    """The first message ``sub`` gets while ``nc`` publishes a marker on ``marker``.

    The marker is published again each second until something arrives (deadline
    ``DEADLINE_S``): what ``nc`` published before the first marker would arrive ahead
    of it, so a message that came through is seen first whatever the server's load.
    """
    deadline = asyncio.get_running_loop().time() + DEADLINE_S
    seq = 0
    while True:
        seq += 1
        await nc.publish(marker, encode(batch(NODE_A, seq)))
        await nc.flush()
        with contextlib.suppress(NatsTimeoutError, TimeoutError):
            msg: Msg = await sub.next_msg(timeout=1.0)
            return msg
        assert asyncio.get_running_loop().time() < deadline, f"nothing on {marker}"


async def next_or_none(sub: Any) -> Msg | None:
    with contextlib.suppress(NatsTimeoutError, TimeoutError):
        msg: Msg = await sub.next_msg(timeout=0.5)
        return msg
    return None


async def test_a_node_cannot_publish_on_another_nodes_telemetry(
    secured: Creds, controller_nc: Client
) -> None:
    errors = Errors()
    a = await connect(secured, "nodes", NODE_A, errors)
    try:
        sub = await controller_nc.subscribe(S.all_of("tel"))
        await controller_nc.flush()
        forged = S.telemetry("r1", "c1", "b")
        await a.publish(forged, encode(batch(NODE_B, 1)))
        first = await first_after_markers(a, sub, S.telemetry("r1", "c1", "a"))
        assert first.subject == S.telemetry("r1", "c1", "a"), "the forged one came through"
        await errors.expect_violation(forged)
        assert a.is_connected  # a violation is reported, the connection stays
        js = controller_nc.jetstream(timeout=5)
        info = await js.stream_info(S.stream_telemetry, subjects_filter=">")
        assert forged not in (info.state.subjects or {})
    finally:
        await a.close()


async def test_a_node_cannot_subscribe_to_another_nodes_commands(
    secured: Creds, controller_nc: Client
) -> None:
    errors = Errors()
    a = await connect(secured, "nodes", NODE_A, errors)
    try:
        theirs = await a.subscribe(S.command("r1", "c1", "b", "*"))
        ours = await a.subscribe(S.command("r1", "c1", "a", "*"))

        async def answer() -> None:
            msg = await ours.next_msg(timeout=DEADLINE_S)
            await msg.respond(b"done")  # allowed: a reply to its own command

        answering = asyncio.create_task(answer())
        await a.flush()
        with pytest.raises(NoRespondersError):
            await controller_nc.request(S.command("r1", "c1", "b", "drain"), b"", timeout=2)
        reply = await controller_nc.request(S.command("r1", "c1", "a", "drain"), b"", timeout=5)
        assert reply.data == b"done"
        await answering
        assert await next_or_none(theirs) is None
        await errors.expect_violation("mg.cmd.r1.c1.b")
    finally:
        await a.close()


async def test_a_subscriber_reads_events_and_cannot_publish_a_command(
    secured: Creds, controller_nc: Client
) -> None:
    errors = Errors()
    audit = await connect(secured, "subscribers", "audit", errors)
    a = await connect(secured, "nodes", NODE_A)
    try:
        commands = await a.subscribe(S.command("r1", "c1", "a", "*"))
        events = await audit.subscribe(S.all_of("ctl"))
        await a.flush()
        await audit.flush()
        forged = S.command("r1", "c1", "a", "isolate")
        await audit.publish(forged, b"forged")
        await audit.flush()
        await controller_nc.publish(S.command("r1", "c1", "a", "marker"), b"marker")
        got = await commands.next_msg(timeout=DEADLINE_S)
        assert got.data == b"marker"
        await errors.expect_violation(forged)

        js = controller_nc.jetstream(timeout=5)
        await js.publish(S.control("r1", "node.isolated"), b"event")
        assert (await events.next_msg(timeout=DEADLINE_S)).data == b"event"
        # ... and the control stream, through a consumer of its own
        audit_js = audit.jetstream(timeout=5)
        stream = await audit_js.subscribe(
            S.all_of("ctl"), stream=S.stream_control, ordered_consumer=True
        )
        assert (await stream.next_msg(timeout=DEADLINE_S)).data == b"event"
        await stream.unsubscribe()
        # ... but nothing else: not the telemetry stream
        with pytest.raises(NatsTimeoutError):  # refused: the server never answers
            await audit.jetstream(timeout=1).stream_info(S.stream_telemetry)
    finally:
        await a.close()
        await audit.close()


async def test_the_controller_and_a_real_agent_work_with_their_credentials(
    secured: Creds, controller_nc: Client, tmp_path: Path
) -> None:
    js = controller_nc.jetstream(timeout=5)
    store = await NodeStore.open(js, S)
    controller = RegionController(js, store, S, "r1")
    ingest = start_ingest(js, S, "r1", controller)
    await controller.start()
    await ingest.start()
    qos = await js.key_value(S.bucket("qos"))
    spool = Spool(tmp_path / "spool", max_bytes=1 << 20)
    settings = PublisherSettings(
        servers=[secured.url],
        nkey_seed=secured.seed("nodes", NODE_A),
        inbox_prefix=f"_INBOX_MG.{NODE_A}",
        reconnect_base_s=0.1,
        reconnect_max_s=0.5,
    )
    publisher = Publisher(settings, spool=spool, subjects=S, rng=random.Random(1))
    try:
        assert await publisher.start()
        for seq in (1, 2):
            await publisher.publish_batch(batch(NODE_A, seq))
        await asyncio.wait_for(publisher.wait_idle(), DEADLINE_S)
        assert publisher.stats().published == 2
        await wait_until(
            lambda: (r := store.records.get(NODE_A)) is not None and r.last_seq == 2,
            DEADLINE_S,
            "the controller to take in a's batches",
        )
        # the agent's connection reads its own QoS key, not another node's
        node_js = publisher.connection.js
        assert node_js is not None
        await qos.put("c1.a", b"mine")
        await qos.put("c1.b", b"theirs")
        kv = await node_js.key_value(S.bucket("qos"))
        watcher = await kv.watch("c1.a")  # what the agent's QoS watch does
        entry = await watcher.updates(timeout=DEADLINE_S)  # type: ignore[no-untyped-call]
        assert entry is not None
        assert entry.value == b"mine"
        await watcher.stop()  # type: ignore[no-untyped-call]
        stream = f"KV_{S.bucket('qos')}"
        inbox = f"_INBOX_MG.{NODE_A}.qos"
        mine = ConsumerConfig(
            name="qos-a", filter_subject=f"$KV.{S.bucket('qos')}.c1.a", deliver_subject=inbox
        )
        await node_js.add_consumer(stream, mine, timeout=5)
        theirs = ConsumerConfig(
            name="qos-b", filter_subject=f"$KV.{S.bucket('qos')}.c1.b", deliver_subject=inbox
        )
        with pytest.raises(NatsTimeoutError):  # refused: the server never answers
            await node_js.add_consumer(stream, theirs, timeout=1)
    finally:
        await publisher.close()
        await ingest.stop()
        await controller.stop()


def test_controller_setup_takes_the_controllers_credentials_from_its_config(
    secured: Creds, tmp_path: Path
) -> None:
    """On a server that requires credentials, ``controller setup --config`` connects as
    the controller (its nkey seed from the controller's TOML); without them it cannot."""
    config = tmp_path / "controller.toml"
    config.write_text(
        f'region = "r1"\n[nats]\nservers = ["{secured.url}"]\nprefix = "mg"\n'
        f'nkey_seed = "{secured.seed("controllers", "controller")}"\n'
    )
    done = subprocess.run(
        [str(METALGUARD), "controller", "setup", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "MG_TELEMETRY" in done.stdout
    refused = subprocess.run(
        [str(METALGUARD), "controller", "setup", "--nats", secured.url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 1
    assert "cannot connect" in refused.stderr
