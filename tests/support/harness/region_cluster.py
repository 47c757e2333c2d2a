"""A region on a 3-server NATS cluster for the shard tests (docs/scaling.md): the
cluster, the shard processes (``metalguard controller run`` with ``[shards]``), a fleet
publishing real TelemetryBatches with message ids (retried across a server's death), and
readers of the control stream and the leases."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError

from metalguard.controller.config import IngestSection
from metalguard.controller.ingest.settings import StreamKind, durable_name
from metalguard.controller.shards.plan import shard_key
from metalguard.controller.shards.service import shard_settings
from metalguard.controller.state.streams import StreamSettings, bucket_configs
from metalguard.proto.base import NodeIdentity
from metalguard.proto.codec import decode, encode
from metalguard.proto.events import ControllerEvent
from metalguard.proto.subjects import Subjects
from metalguard.proto.telemetry import TelemetryBatch
from tests.support.harness.ha_leases import MARGIN_S, POLL_S, RENEW_S, TTL_S
from tests.support.scoring_helpers import dimm_mc

METALGUARD = Path(sys.executable).parent / "metalguard"
REGION = "r1"
INTERVAL_S = 0.5
TAKEOVER_AFTER_S = 1.0
T = TypeVar("T")


async def short_leases_r3(js: JetStreamContext, subjects: Subjects) -> None:
    """The leases bucket made again with TTL_S, still replicated on three servers."""
    (leases,) = [
        b
        for b in bucket_configs(subjects, StreamSettings(replicas=3, lease_ttl_s=TTL_S))
        if b.bucket == subjects.bucket("leases")
    ]
    await js.delete_key_value(leases.bucket)
    await js.create_key_value(leases)


def shard_config(
    urls: list[str],
    prefix: str,
    instance: str,
    groups: dict[str, list[str]],
    home: list[str],
    *,
    takeover: bool = True,
) -> str:
    """A shard process's controller.toml (``takeover``: whether it takes other shards)."""
    servers = ", ".join(f'"{u}"' for u in urls)
    lines = [
        f'region = "{REGION}"',
        "silence_check_s = 0.5",
        "[nats]",
        f"servers = [{servers}]",
        f'prefix = "{prefix}"',
        "[lifecycle]",
        "rail_max_fraction = 1.0",
        "[ha]",
        f'instance = "{instance}"',
        f"renew_s = {RENEW_S}",
        f"poll_s = {POLL_S}",
        f"margin_s = {MARGIN_S}",
        "[shards]",
        "home = [" + ", ".join(f'"{h}"' for h in home) + "]",
        f"takeover = {'true' if takeover else 'false'}",
        f"takeover_after_s = {TAKEOVER_AFTER_S}",
        "[shards.groups]",
    ]
    lines += [f"{name} = [" + ", ".join(f'"{c}"' for c in cs) + "]" for name, cs in groups.items()]
    return "\n".join(lines) + "\n"


@dataclass
class ShardProc:
    """A shard process and its log file."""

    instance: str
    proc: asyncio.subprocess.Process
    log: Path

    def kill(self) -> None:
        """SIGKILL: no release, no last write."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGKILL)

    async def stop(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 20)
            except TimeoutError:
                self.kill()
                await self.proc.wait()


async def run_setup(urls: list[str], prefix: str, replicas: int) -> tuple[int, str]:
    """``metalguard controller setup`` against the cluster, as an operator runs it."""
    proc = await asyncio.create_subprocess_exec(
        str(METALGUARD),
        "controller",
        "setup",
        "--nats",
        ",".join(urls),
        "--prefix",
        prefix,
        "--replicas",
        str(replicas),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, out.decode()


async def start_shard(config: Path, instance: str) -> ShardProc:
    """``metalguard controller run --config`` as a child, its output in a log file."""
    log = config.with_suffix(".log")
    out = log.open("wb")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = await asyncio.create_subprocess_exec(
        str(METALGUARD),
        "controller",
        "run",
        "--config",
        str(config),
        stdout=out,
        stderr=asyncio.subprocess.STDOUT,
        env=env,
    )
    out.close()
    return ShardProc(instance, proc, log)


async def holder(js: JetStreamContext, subjects: Subjects, shard: str) -> str | None:
    """Who holds a shard's lease now (None: nobody)."""
    kv = await js.key_value(subjects.bucket("leases"))
    try:
        entry = await kv.get(shard_key(REGION, shard))
    except KeyNotFoundError:
        return None
    if entry.value is None:
        return None
    return str(json.loads(entry.value)["holder"])


async def stream_messages(js: JetStreamContext, subjects: Subjects) -> int:
    """How many batches the telemetry stream holds."""
    info = await js.stream_info(subjects.stream_telemetry)
    return int(info.state.messages)


async def backlog(js: JetStreamContext, subjects: Subjects, shard: str, clusters: list[str]) -> int:
    """Batches of the shard's telemetry consumer not yet acknowledged (pending or in
    flight): 0 once its owner has taken in everything the stream holds."""
    settings = shard_settings(REGION, shard, tuple(clusters), IngestSection())
    info = await js.consumer_info(
        subjects.stream_telemetry, durable_name(settings, StreamKind.TELEMETRY)
    )
    return int(info.num_pending or 0) + int(info.num_ack_pending or 0)


async def isolations(js: JetStreamContext, subjects: Subjects) -> Counter[str]:
    """How many node.isolated events the control stream holds per node handle."""
    info = await js.stream_info(subjects.stream_control)
    out: Counter[str] = Counter()
    if info.state.messages == 0:
        return out
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        msg = await js.get_msg(subjects.stream_control, seq)
        assert msg.data is not None
        event = decode(msg.data, ControllerEvent)
        if event.kind == "node.isolated" and event.node is not None:
            out[event.node.handle] += 1
    return out


async def settled(probe: Awaitable[T], default: T) -> T:
    """``probe``'s value, or ``default`` while the cluster cannot answer (a server just
    died, JetStream re-electing): for waits that poll until a deadline."""
    try:
        return await probe
    except (NatsError, TimeoutError):
        return default


@dataclass
class Fleet:
    """Every node's batch each interval, with ``Nats-Msg-Id`` = node + seq, retried until
    acknowledged (a server's death costs a retry, never a batch); ``failing`` nodes report
    an uncorrectable memory error."""

    js: JetStreamContext
    subjects: Subjects
    nodes: list[tuple[str, str]]
    failing: set[str] = field(default_factory=set)
    seq: int = 0
    acked: int = 0
    retries: int = 0
    rounds: asyncio.Event = field(default_factory=asyncio.Event)
    longest_publish_s: float = 0.0
    """The longest one batch took to be acknowledged, retries included (an outage)."""
    paused: bool = False
    """Publish nothing while set (to count what the stream and the consumers hold)."""

    async def run(self) -> None:
        while True:
            if self.paused:
                await asyncio.sleep(INTERVAL_S)
                continue
            self.seq += 1
            for cluster, name in self.nodes:
                handle = f"{REGION}.{cluster}.{name}"
                batch = TelemetryBatch(
                    node=NodeIdentity(region=REGION, cluster=cluster, node=name),
                    seq=self.seq,
                    ts=time.time(),
                    interval_s=INTERVAL_S,
                    edac=(dimm_mc(ue=1 if handle in self.failing else 0),),
                )
                await self._publish(
                    self.subjects.telemetry(REGION, cluster, name),
                    encode(batch),
                    f"{handle}-{self.seq}",
                )
            self.rounds.set()
            self.rounds = asyncio.Event()
            await asyncio.sleep(INTERVAL_S)  # the fleet's pace, not a synchronisation

    async def _publish(self, subject: str, data: bytes, msg_id: str) -> None:
        started = time.monotonic()
        while True:
            try:
                await self.js.publish(subject, data, timeout=2, headers={"Nats-Msg-Id": msg_id})
            except (NatsError, TimeoutError):
                self.retries += 1
                await asyncio.sleep(0.1)  # the cluster re-electing: retry the same id
                continue
            self.acked += 1
            self.longest_publish_s = max(self.longest_publish_s, time.monotonic() - started)
            return
