"""A region on a 3-server NATS cluster (JetStream R3) with 1, 2 and 4 controller shards.

Starts its own 3-server cluster on loopback (controller/broker/cluster.py), runs
``controller setup``'s stream creation with 3 replicas, and starts the shards as child
processes (``metalguard controller run`` with ``[shards]``, docs/scaling.md).  The load
is real TelemetryBatches (bench/ingest_bench.py's ``make_batch``: EDAC, PCIe/AER, hwmon,
collector runs) for ``--nodes`` nodes over ``--clusters`` clusters at a ``--interval-s``
cycle (100,000 nodes at 30 s is 3,333 batches/s: the issue's size).  In one run:

(a) Sustained ingest with 1, 2, 4 shards: each shard count gets a fresh prefix; its
    shards take in two warm-up cycles of every node (records in KV), stop, ``--cycles``
    more cycles are published, the shards start again, and the rate is read from the
    consumers' backlog going from 90 % to 10 % (start-up excluded).  Baseline in the
    same run: a raw nats-py pull consumer (fetch, decode, ack) over the same batches.
(b) Fault-to-isolation with the largest shard count: while the fleet keeps its pace
    (every node's batch each ``--interval-s``, acknowledged), 1 % of the nodes (spread
    over the clusters) publish a batch with an uncorrectable ECC error at once; a core
    subscription times each ``node.isolated``; p50/p99 of arrival minus publish.  The
    shards' memory after the warm-up is printed per node.
(c) A shard SIGKILLed mid-run (lease TTL ``--lease-ttl-s``): the fleet keeps its pace,
    1 % of the dead shard's nodes fail right after; takeover time (kill -> the lease
    held by another shard) and isolations exactly once.
(d) One NATS server (the telemetry stream's leader) SIGKILLed mid-run: the longest a
    batch waited for its acknowledgement (the recovery), and nothing lost (the stream
    holds each acknowledged batch once, every shard's consumer drained).

Usage: python bench/region_bench.py [--quick] [--nodes N] [--clusters N] [--cycles N]
       [--shards 1,2,4] [--interval-s S] [--lease-ttl-s S] [--no-sustained]
       [--warmup-cycles N]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar
from uuid import uuid4

import nats
from ingest_bench import REGION, cluster_name, machine_note, make_batch, node_name
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig
from nats.js.errors import KeyNotFoundError

from metalguard.controller.broker.cluster import NatsCluster
from metalguard.controller.config import IngestSection
from metalguard.controller.ingest.settings import StreamKind, durable_name
from metalguard.controller.setup import ensure_streams_electing
from metalguard.controller.shards.plan import shard_key
from metalguard.controller.shards.service import shard_settings
from metalguard.controller.state.streams import StreamSettings
from metalguard.proto.codec import decode, encode
from metalguard.proto.events import ControllerEvent
from metalguard.proto.subjects import Subjects

METALGUARD = Path(sys.executable).parent / "metalguard"
PUBLISH_CHUNK = 512
LIMITS = {"wait_s": 1800.0, "stop_s": 300.0}
"""The longest any one wait (``until``) and a shard's clean stop may take; ``--quick``
shortens them, so a stuck step fails the bench naming the step (not the caller's
timeout with nothing said)."""
CHILDREN: list[asyncio.subprocess.Process] = []
"""Every shard process started: killed at the end whatever happened."""
T = TypeVar("T")
STARTED = time.monotonic()
LOGS: list[Path] = []
"""The shard processes' logs (their tails are printed when the bench fails)."""


def progress(what: str) -> None:
    """One line on stderr per step, with the seconds since the start: where a run that
    fails or is killed got to."""
    print(f"[region_bench +{time.monotonic() - STARTED:.1f} s] {what}", file=sys.stderr,
          flush=True)  # fmt: skip


def print_log_tails(lines: int = 20) -> None:
    """The last ``lines`` of every shard's log, on stderr."""
    for log in LOGS:
        with contextlib.suppress(OSError):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            print(f"--- {log.name} (last {len(tail)} lines)", file=sys.stderr)
            print("\n".join(tail), file=sys.stderr, flush=True)


def groups_of(clusters: int, shards: int) -> dict[str, list[str]]:
    """The shard map: clusters dealt round robin over ``shards`` shards."""
    out: dict[str, list[str]] = {f"s{i}": [] for i in range(shards)}
    for c in range(clusters):
        out[f"s{c % shards}"].append(cluster_name(c))
    return out


def shard_toml(urls: list[str], prefix: str, instance: str, groups: dict[str, list[str]],
               home: str, ttl_s: float) -> str:  # fmt: skip
    renew = min(3.0, ttl_s / 4)
    lines = [
        f'region = "{REGION}"',
        "silence_check_s = 1.0",
        "[nats]",
        "servers = [" + ", ".join(f'"{u}"' for u in urls) + "]",
        f'prefix = "{prefix}"',
        "[ha]",
        f'instance = "{instance}"',
        f"renew_s = {renew}",
        "poll_s = 0.2",
        f"margin_s = {min(1.0, ttl_s / 4)}",
        "[shards]",
        f'home = ["{home}"]',
        "takeover_after_s = 2.0",
        "[shards.groups]",
    ]
    lines += [f"{n} = [" + ", ".join(f'"{c}"' for c in cs) + "]" for n, cs in groups.items()]
    return "\n".join(lines) + "\n"


@dataclass
class Region:
    """One prefix on the cluster, its shard map and its shard processes."""

    nc: Client
    js: JetStreamContext
    urls: list[str]
    root: Path
    nodes: list[tuple[str, str]]
    groups: dict[str, list[str]]
    ttl_s: float
    interval_s: float = 15.0
    """The batches' nominal interval (silence is judged against it)."""
    subjects: Subjects = field(default_factory=lambda: Subjects(f"b{uuid4().hex[:8]}"))
    procs: dict[str, asyncio.subprocess.Process] = field(default_factory=dict)

    async def create(self) -> None:
        await ensure_streams_electing(  # a fresh cluster may not place R3 at once
            self.js, self.subjects, StreamSettings(replicas=3, lease_ttl_s=self.ttl_s)
        )

    async def start_shards(self, *, wait: bool = True) -> None:
        """Start one process per shard; ``wait``: until each holds its lease."""
        for shard in self.groups:
            instance = f"p{shard}"
            conf = self.root / f"{self.subjects.prefix}-{instance}.toml"
            conf.write_text(shard_toml(self.urls, self.subjects.prefix, instance, self.groups,
                                       shard, self.ttl_s))  # fmt: skip
            LOGS.append(conf.with_suffix(".log"))
            log = conf.with_suffix(".log").open("ab")
            self.procs[instance] = await asyncio.create_subprocess_exec(
                str(METALGUARD), "--log-level", "warning", "controller", "run", "--config",
                str(conf), stdout=log, stderr=asyncio.subprocess.STDOUT,
            )  # fmt: skip
            log.close()
            CHILDREN.append(self.procs[instance])
        if wait:
            await self.wait_owned()

    async def wait_owned(self) -> None:
        want = {s: f"p{s}" for s in self.groups}
        await until(lambda: self.holders(), lambda got: got == want, "every shard owned")

    async def holders(self) -> dict[str, str | None]:
        kv = await self.js.key_value(self.subjects.bucket("leases"))
        out: dict[str, str | None] = {}
        for shard in self.groups:
            try:
                entry = await kv.get(shard_key(REGION, shard))
                out[shard] = json.loads(entry.value or b"{}").get("holder")
            except KeyNotFoundError:
                out[shard] = None
        return out

    async def stop_shards(self) -> None:
        for proc in self.procs.values():
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:  # a clean stop writes the liveness not yet written: slow on a busy host
                await asyncio.wait_for(proc.wait(), LIMITS["stop_s"])
            except TimeoutError:
                progress(f"a shard process (pid {proc.pid}) did not stop in "
                         f"{LIMITS['stop_s']:.0f} s after SIGTERM: killed")  # fmt: skip
                print_log_tails()
                proc.kill()
                await proc.wait()
        self.procs.clear()

    def telemetry_durable(self, shard: str) -> str:
        settings = shard_settings(REGION, shard, tuple(self.groups[shard]), IngestSection())
        return durable_name(settings, StreamKind.TELEMETRY)

    async def delivered(self, shard: str) -> int:
        """The last stream sequence the shard's telemetry consumer delivered."""
        name = self.telemetry_durable(shard)
        info = await self.js.consumer_info(self.subjects.stream_telemetry, name)
        return int(info.delivered.stream_seq or 0) if info.delivered else 0

    async def backlog(self) -> int:
        """Batches not yet acknowledged by the shards' telemetry consumers."""
        total = 0
        for shard in self.groups:
            name = self.telemetry_durable(shard)
            info = await self.js.consumer_info(self.subjects.stream_telemetry, name)
            total += int(info.num_pending or 0) + int(info.num_ack_pending or 0)
        return total

    async def publish_faults(self, failing: set[str], seq: int) -> dict[str, float]:
        """One UE batch of each ``failing`` node at once (JetStream publishes, awaited
        together): the time each was published."""
        sent: dict[str, float] = {}

        async def one(handle: str) -> None:
            _, cluster, node = handle.split(".")
            data = encode(make_batch(cluster, node, seq, ue_dimm=3, interval_s=self.interval_s))
            subject = self.subjects.telemetry(REGION, cluster, node)
            sent[handle] = time.time()
            await self.js.publish(subject, data, headers={"Nats-Msg-Id": f"{handle}-f{seq}"})

        await asyncio.gather(*(one(h) for h in sorted(failing)))
        return sent

    async def publish_cycle(
        self, seq: int, failing: frozenset[str] = frozenset(), sent: dict[str, float] | None = None
    ) -> int:
        """One batch of every node (core publish, flushed): how many were sent; ``sent``
        gets the time each failing node's batch was published."""
        for i, (cluster, node) in enumerate(self.nodes):
            handle = f"{REGION}.{cluster}.{node}"
            batch = make_batch(cluster, node, seq, ue_dimm=3 if handle in failing else None,
                               interval_s=self.interval_s)  # fmt: skip
            if sent is not None and handle in failing:
                sent[handle] = time.time()
            await self.nc.publish(self.subjects.telemetry(REGION, cluster, node), encode(batch))
            if i % PUBLISH_CHUNK == 0:
                await self.nc.flush()
        await self.nc.flush()
        return len(self.nodes)


async def until(probe: Callable[[], Awaitable[T]], done: Callable[[T], bool], what: str,
                limit_s: float | None = None, every_s: float = 0.25) -> T:  # fmt: skip
    """Await ``probe()`` until ``done``; errors while the cluster re-elects are retried."""
    deadline = time.monotonic() + (LIMITS["wait_s"] if limit_s is None else limit_s)
    value: T | None = None
    while True:
        try:
            value = await probe()
            if done(value):
                progress(what)
                return value
        except (NatsError, TimeoutError):
            value = None
        if time.monotonic() >= deadline:
            raise RuntimeError(f"timed out waiting for {what}: {value!r}")
        await asyncio.sleep(every_s)


def cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) the processes have used so far."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def rss_kib(pids: list[int]) -> int:
    """The processes' resident memory together, KiB."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
    return total


@dataclass(frozen=True, slots=True)
class Drain:
    """The shards' drain: batches/s, and CPU seconds per batch of shards and servers."""

    rate: float
    shard_cpu_per_batch: float
    server_cpu_per_batch: float


async def drain_rate(region: Region, total: int, servers: list[int]) -> Drain:
    """Start the shards and time their drain: batches/s from their first acknowledgement
    until the backlog is empty (their start-up, the state's load from KV, excluded), with
    the CPU it took. NaN when the drain fell between two looks (too few batches)."""
    await region.start_shards(wait=False)
    shards = [p.pid for p in region.procs.values()]
    first: tuple[float, int, float, float] | None = None
    deadline = time.monotonic() + LIMITS["wait_s"]
    while True:
        try:
            left = await region.backlog()
        except (NatsError, TimeoutError):
            left = None
        now = time.monotonic()
        if left is not None and first is None and left < total:
            first = (now, left, cpu_s(shards), cpu_s(servers))
        if left == 0:
            break
        if now >= deadline:
            raise RuntimeError(f"timed out waiting for the shards' drain: {left} left")
        await asyncio.sleep(0.05)
    progress(f"drained {total} batches")
    await region.wait_owned()
    if first is None or now <= first[0] or first[1] == 0:
        return Drain(float("nan"), float("nan"), float("nan"))
    done = first[1]
    return Drain(
        done / (now - first[0]),
        (cpu_s(shards) - first[2]) / done,
        (cpu_s(servers) - first[3]) / done,
    )


RAW_QUIET_S = 30.0
"""How long the raw consumer waits for a next message before the bench fails."""


async def raw_rate(js: JetStreamContext, subjects: Subjects, n: int) -> float:
    """The baseline: one raw pull consumer (fetch 256, decode, ack) over ``n`` batches."""
    durable = f"raw{uuid4().hex[:6]}"
    await js.add_consumer(subjects.stream_telemetry,
                          ConsumerConfig(durable_name=durable, ack_policy=AckPolicy.EXPLICIT,
                                         max_ack_pending=4096))  # fmt: skip
    sub = await js.pull_subscribe_bind(durable, subjects.stream_telemetry)
    got, started = 0, time.perf_counter()
    quiet_since = time.monotonic()
    while got < n:
        try:
            msgs: list[Msg] = await sub.fetch(256, timeout=5)
        except (NatsError, TimeoutError):
            # an empty pull (a new R3 consumer's first can come back empty on a busy
            # host): give up only after RAW_QUIET_S without a message
            if time.monotonic() - quiet_since > RAW_QUIET_S:
                break
            continue
        quiet_since = time.monotonic()
        for m in msgs:
            decode(m.data)
            await m.ack()
        got += len(msgs)
    if got < n:
        raise RuntimeError(f"the raw consumer got {got} of {n} batches ({RAW_QUIET_S:.0f} s quiet)")
    rate = got / (time.perf_counter() - started)
    await sub.unsubscribe()
    await js.delete_consumer(subjects.stream_telemetry, durable)
    return rate


async def sustained(nc: Client, urls: list[str], root: Path, nodes: list[tuple[str, str]],
                    clusters: int, shards: int, cycles: int,
                    servers: list[int]) -> tuple[Drain, float]:  # fmt: skip
    """(the shards' drain, raw rate) over the same ``cycles`` cycles of known nodes."""
    js = nc.jetstream(timeout=30)
    region = Region(nc, js, urls, root, nodes, groups_of(clusters, shards), ttl_s=60.0)
    await region.create()
    await region.start_shards()
    for seq in (1, 2):
        await region.publish_cycle(seq)
    await until(region.backlog, lambda n: n == 0, "the warm-up taken in")
    await region.stop_shards()
    sent = 0
    for seq in range(3, 3 + cycles):
        sent += await region.publish_cycle(seq)
    total = await settled_backlog(region, sent)
    rate = await drain_rate(region, total, servers)
    raw = await raw_rate(js, region.subjects, total)
    await region.stop_shards()
    return rate, raw


STREAM_QUIET_S = 10.0
"""The stream holding fewer than were sent, unchanged this long: it took what it took."""


async def settled_backlog(region: Region, sent: int) -> int:
    """The batches the stream holds for the stopped shards once they are all in, or once
    the count stands still for STREAM_QUIET_S: the cycles are core publishes, and a
    loaded server may drop some (a CI run: 2,316 of 2,400), so the drain is timed over
    what the stream took, said when short."""
    last, since = -1, time.monotonic()
    deadline = time.monotonic() + LIMITS["wait_s"]
    while True:
        with contextlib.suppress(NatsError, TimeoutError):
            now = await region.backlog()
            if now == sent:
                progress("the batches in the stream")
                return now
            if now != last:
                last, since = now, time.monotonic()
            elif now > 0 and time.monotonic() - since >= STREAM_QUIET_S:
                progress(f"the stream took {now} of {sent} batches (core publishes dropped)")
                return now
        if time.monotonic() >= deadline:
            raise RuntimeError(f"timed out waiting for the batches in the stream: {last!r}")
        await asyncio.sleep(0.25)


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


async def isolations(js: JetStreamContext, subjects: Subjects) -> Counter[str]:
    """node.isolated events in the control stream, per node handle."""
    info = await js.stream_info(subjects.stream_control)
    out: Counter[str] = Counter()
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        with contextlib.suppress(NatsError):
            msg = await js.get_msg(subjects.stream_control, seq)
            event = decode(msg.data or b"", ControllerEvent)
            if event.kind == "node.isolated" and event.node is not None:
                out[event.node.handle] += 1
    return out


def pick_failing(nodes: list[tuple[str, str]], fraction: float, clusters: set[str] | None = None,
                 exclude: frozenset[str] = frozenset()) -> set[str]:  # fmt: skip
    """``fraction`` of the nodes (of ``clusters``, not in ``exclude``), the same share of
    every cluster, spread over it: a few per cluster, inside the rail's share."""
    by_cluster: dict[str, list[str]] = {}
    for c, n in nodes:
        handle = f"{REGION}.{c}.{n}"
        if (clusters is None or c in clusters) and handle not in exclude:
            by_cluster.setdefault(c, []).append(handle)
    step = max(1, round(1 / fraction))
    return {h for pool in by_cluster.values() for h in pool[::step]}


@dataclass
class Pacer:
    """Publishes every node's batch each ``interval_s`` (spread over the interval) with
    message ids, retried until acknowledged; ``failing`` nodes report an UE."""

    region: Region
    interval_s: float
    failing: set[str] = field(default_factory=set)
    seq: int = 10
    acked: int = 0
    longest_s: float = 0.0
    stop: bool = False
    started: float = field(default_factory=time.monotonic)

    def rate(self) -> float:
        """Batches acknowledged per second since the pacer began."""
        return self.acked / max(1e-9, time.monotonic() - self.started)

    async def run(self) -> None:
        js, nodes = self.region.js, self.region.nodes
        while not self.stop:
            self.seq += 1
            seq, started = self.seq, time.monotonic()  # one seq per cycle
            for i in range(0, len(nodes), PUBLISH_CHUNK):
                if self.stop:
                    break
                chunk = nodes[i : i + PUBLISH_CHUNK]
                await asyncio.gather(*(self._one(js, c, n, seq) for c, n in chunk))
                share = (i + len(chunk)) / len(nodes) * self.interval_s
                await asyncio.sleep(max(0.0, started + share - time.monotonic()))

    async def _one(self, js: JetStreamContext, cluster: str, node: str, seq: int) -> None:
        handle = f"{REGION}.{cluster}.{node}"
        failing = handle in self.failing
        batch = make_batch(cluster, node, seq, ue_dimm=3 if failing else None,
                           interval_s=self.interval_s)  # fmt: skip
        data, began = encode(batch), time.monotonic()
        subject = self.region.subjects.telemetry(REGION, cluster, node)
        while True:
            try:
                await js.publish(subject, data, timeout=5,
                                 headers={"Nats-Msg-Id": f"{handle}-{seq}"})  # fmt: skip
                break
            except (NatsError, TimeoutError):
                await asyncio.sleep(0.1)
        self.acked += 1
        self.longest_s = max(self.longest_s, time.monotonic() - began)


async def faults_and_kills(nc: Client, cluster: NatsCluster, root: Path,
                           nodes: list[tuple[str, str]], clusters: int, shards: int,
                           interval_s: float, ttl_s: float, warmup: int = 2) -> None:  # fmt: skip
    js = nc.jetstream(timeout=30)
    region = Region(nc, js, cluster.urls, root, nodes, groups_of(clusters, shards), ttl_s=ttl_s,
                    interval_s=interval_s)  # fmt: skip
    await region.create()
    await region.start_shards()
    pids = [p.pid for p in region.procs.values()]
    empty = rss_kib(pids)
    began = time.monotonic()
    for seq in range(1, 1 + warmup):
        await region.publish_cycle(seq)
    await until(region.backlog, lambda n: n == 0, "the warm-up taken in")
    took = time.monotonic() - began
    print(f"warm-up: {warmup} cycle(s) of {len(nodes):,} nodes taken in by {shards} shards in "
          f"{took:,.0f} s ({warmup * len(nodes) / took:,.0f} batches/s, the first contact "
          f"included: a record created in KV per node)")  # fmt: skip
    rss = rss_kib(pids)
    print(f"shards' memory after the warm-up: {rss / 1024:,.0f} MiB RSS in {shards} processes "
          f"({empty / 1024:,.0f} MiB before any node): {(rss - empty) / len(nodes):.2f} KiB "
          f"per node of the region")  # fmt: skip

    # (b) 1 % of the nodes fail at once, while the rest keep their pace
    arrivals: dict[str, float] = {}

    async def on_ctl(msg: Msg) -> None:
        event = decode(msg.data, ControllerEvent)
        if event.kind == "node.isolated" and event.node is not None:
            arrivals.setdefault(event.node.handle, time.time())

    sub = await nc.subscribe(f"{region.subjects.prefix}.ctl.>", cb=on_ctl)
    failing = pick_failing(nodes, 0.01)
    stored_before = await stream_count(js, region.subjects)
    pacer = Pacer(region, interval_s)
    task = asyncio.create_task(pacer.run())
    await asyncio.sleep(min(interval_s, 5.0))  # the fleet at its pace
    pacer.seq += 1  # the faults' seq: the pacer's next cycle is newer, its current older
    host0 = host_cpu()
    sent = await region.publish_faults(failing, pacer.seq)
    pacer.failing |= failing

    async def isolated() -> int:
        return len(arrivals)

    await until(isolated, lambda n: n >= len(failing), "every failing node isolated")
    busy = host_busy(host0, host_cpu())
    lat = [arrivals[h] - sent[h] for h in failing]  # each from its own batch's publish
    print(f"fault-to-isolation, {len(failing)} of {len(nodes)} nodes failing at once "
          f"(the others at {len(nodes) / interval_s:,.0f} batches/s offered, "
          f"{pacer.rate():,.0f}/s acknowledged), {shards} shards: "
          f"p50 {percentile(lat, 50):.2f} s, p99 {percentile(lat, 99):.2f} s, "
          f"max {max(lat):.2f} s (goal p99 <= 1 s at 100,000 nodes); the host's CPUs "
          f"{busy:.0%} busy meanwhile (servers, shards and this generator together)")  # fmt: skip

    # (c) a shard SIGKILLed mid-run, its nodes failing right after
    victim = "s0"
    proc = region.procs[f"p{victim}"]
    delivered_at_kill = await region.delivered(victim)
    killed = time.monotonic()
    proc.send_signal(signal.SIGKILL)
    await proc.wait()
    more = pick_failing(nodes, 0.01, set(region.groups[victim]), frozenset(failing))
    more = set(sorted(more)[: max(1, len(failing) // shards)])
    pacer.failing |= more
    await until(region.holders, lambda got: got.get(victim) not in (None, f"p{victim}"),
                "another shard to take s0", every_s=0.05)  # fmt: skip
    took = time.monotonic() - killed
    await until(lambda: region.delivered(victim), lambda n: n > delivered_at_kill,
                "s0's consumer delivering again", every_s=0.05)  # fmt: skip
    resumed = time.monotonic() - killed
    await until(lambda: isolations(js, region.subjects),
                lambda got: set(pacer.failing) <= set(got), "the new faults isolated")  # fmt: skip
    counted = await isolations(js, region.subjects)
    twice = {h: n for h, n in counted.items() if n != 1}
    once = "exactly once each" if not twice and set(counted) == pacer.failing else twice
    print(f"shard SIGKILL mid-run ({shards} shards, lease TTL {ttl_s:.0f} s): taken over after "
          f"{took:.2f} s (goal TTL + 1 s = {ttl_s + 1:.0f} s), its ingest resumed (state loaded "
          f"from KV) after {resumed:.2f} s; {len(pacer.failing)} faults "
          f"({len(more)} in the dead shard's clusters after its death), isolated "
          f"{once}")  # fmt: skip

    # (d) the telemetry stream's leader SIGKILLed mid-run
    info = await js.stream_info(region.subjects.stream_telemetry)
    leader = (info.cluster.leader if info.cluster else None) or "n1"
    index = int(leader[1:]) - 1
    before = pacer.longest_s = 0.0
    cluster.kill(index)
    await asyncio.sleep(min(interval_s, 10.0))  # the fleet keeps its pace through the loss
    pacer.stop = True
    await task
    published = pacer.acked + len(failing)
    in_stream = await until(lambda: stream_count(js, region.subjects),
                            lambda n: n is not None, "stream info")  # fmt: skip
    await until(region.backlog, lambda n: n == 0, "every shard drained")
    expected = stored_before + published
    print(f"NATS server {leader} (stream leader) SIGKILLed mid-run: longest wait for an ack "
          f"{pacer.longest_s:.2f} s (was {before:.2f}); stream holds {in_stream} of {expected} "
          f"batches published ({'nothing lost' if in_stream == expected else 'LOST'}), "
          f"every shard's consumer drained")  # fmt: skip
    await sub.unsubscribe()
    await region.stop_shards()
    await asyncio.to_thread(cluster.restart, index)


def host_cpu() -> tuple[int, int]:
    """(busy, total) CPU ticks of the host since boot (/proc/stat; (0, 0) elsewhere)."""
    try:
        line = Path("/proc/stat").read_text().split("\n")[0]
        fields = [int(v) for v in line.split()[1:9]]  # user .. steal (guest is in user)
    except (OSError, ValueError):
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def host_busy(before: tuple[int, int], after: tuple[int, int]) -> float:
    """The share of the host's CPU time that was busy between two :func:`host_cpu`."""
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total > 0 else float("nan")


async def stream_count(js: JetStreamContext, subjects: Subjects) -> int:
    return int((await js.stream_info(subjects.stream_telemetry)).state.messages)


async def measure(args: argparse.Namespace, root: Path) -> None:
    cluster = NatsCluster(3, base_dir=root)
    urls = await asyncio.to_thread(cluster.start)
    nc = await nats.connect(servers=urls, name="region-bench", reconnect_time_wait=0.2,
                            max_reconnect_attempts=-1)  # fmt: skip
    nodes = [(cluster_name(i % args.clusters), node_name(i)) for i in range(args.nodes)]
    counts = [int(s) for s in args.shards.split(",")]
    try:
        print(machine_note())
        target = args.nodes / args.interval_s
        print(f"region: {args.nodes} nodes in {args.clusters} clusters, one batch each "
              f"{args.interval_s:.0f} s = {target:,.0f} batches/s offered; the issue's size "
              f"is 100,000 nodes at 30 s = 3,333 batches/s "
              f"({args.nodes / 100_000:.1%} of it here)")  # fmt: skip
        base = None
        for shards in [] if args.no_sustained else counts:
            servers = [s.pid for s in cluster.servers if s.pid is not None]
            drain, raw = await sustained(nc, urls, root, nodes, args.clusters, shards,
                                         args.cycles, servers)  # fmt: skip
            rate = drain.rate
            if rate != rate:  # NaN: the drain fell between two looks
                print(f"sustained ingest, {shards} shard(s): not timed (the {args.cycles} "
                      f"cycle(s) drained between two looks: raise --cycles); raw consumer "
                      f"{raw:,.0f}/s")  # fmt: skip
                continue
            base = base or rate
            print(f"sustained ingest, {shards} shard(s): {rate:,.0f} batches/s "
                  f"(shards/raw {rate / raw:.2f}, raw consumer {raw:,.0f}/s; "
                  f"x{rate / base:.2f} of 1 shard; {rate / target:.2f}x the offered load; "
                  f"{rate * args.interval_s / shards:,.0f} nodes per shard at "
                  f"{args.interval_s:.0f} s)")  # fmt: skip
            per_core = 1 / drain.shard_cpu_per_batch if drain.shard_cpu_per_batch else 0.0
            server_core = 1 / drain.server_cpu_per_batch if drain.server_cpu_per_batch else 0.0
            print(f"  CPU: shards {drain.shard_cpu_per_batch * 1e3:.2f} ms/batch "
                  f"({per_core:,.0f} batches/s per core = {per_core * 30:,.0f} nodes per core "
                  f"at 30 s), 3 nats-servers {drain.server_cpu_per_batch * 1e3:.2f} ms/batch "
                  f"together ({server_core:,.0f} batches/s per core)")  # fmt: skip
        await faults_and_kills(nc, cluster, root, nodes, args.clusters, max(counts),
                               args.interval_s, args.lease_ttl_s, args.warmup_cycles)  # fmt: skip
        print(f"load average after: {os.getloadavg()[0]:.1f}")
    except BaseException:
        print_log_tails()
        raise
    finally:
        for proc in CHILDREN:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        await nc.close()
        await asyncio.to_thread(cluster.close)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    parser.add_argument("--nodes", type=int, default=100_000)
    parser.add_argument("--clusters", type=int, default=40)
    parser.add_argument("--cycles", type=int, default=2, help="cycles timed per shard count")
    parser.add_argument("--shards", default="1,2,4", help="shard counts measured")
    parser.add_argument("--interval-s", type=float, default=30.0)
    parser.add_argument("--lease-ttl-s", type=float, default=10.0)
    parser.add_argument("--warmup-cycles", type=int, default=2,
                        help="cycles of every node first (1: first contact)")  # fmt: skip
    parser.add_argument("--no-sustained", action="store_true",
                        help="skip (a): faults, the shard and the server kill only")  # fmt: skip
    args = parser.parse_args()
    if args.quick:
        args.nodes, args.clusters, args.cycles, args.shards = 200, 4, 10, "1,2"
        args.interval_s, args.lease_ttl_s = 2.0, 2.0
        LIMITS.update(wait_s=120.0, stop_s=60.0)
    with tempfile.TemporaryDirectory(prefix="mg-region-bench-") as tmp:
        asyncio.run(measure(args, Path(tmp)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
