"""Controller ingest throughput and fault-to-isolation latency, on a local nats-server.

Starts its own nats-server (loopback, temp dir) and measures, in one run:

(a) Throughput. N realistic TelemetryBatches (healthy nodes over several clusters) are
    published into the telemetry stream first, then consumed:

    - baseline: a raw nats-py pull consumer in this process (fetch 256, ``proto.codec.decode``,
      ack): messages per second;
    - one controller process (``Ingest`` + ``RegionController`` + ``NodeStore``: real scoring,
      lifecycle, rail and KV writes) on its own durable over the same messages: batches per
      second from its start until the consumer has nothing pending or unacknowledged;
    - two controller processes over a fresh fill of the same batches, each owning half of
      the clusters (``IngestSettings(clusters=...)``: rail state is per cluster, so a
      cluster has one owner): the combined rate;
    - steady state: the same measurements (raw, one process, two processes) over batches
      of nodes the controllers already know: each controller first takes in two warm-up
      cycles of every node (records and histories created in KV), stops its ingest, and
      is timed over the next N batches (seq 3 on) from a new ``Ingest`` on the same
      durable. A production controller sees each node for weeks; the first shape counts
      each node's first two batches, a fifth of its batches.

(b) Latency. F x P simulated nodes (F clusters of P) each send one healthy batch, and once
    one controller process knows them all, ``failing`` nodes (the same number in every
    cluster, inside the rail's 10 %) publish a batch with a new uncorrectable ECC error at
    once. A core subscription on ``<p>.ctl.>`` takes the arrival time of each
    ``node.isolated``; the latency of a node is arrival minus the time its batch was
    published.

The controller processes are children of this script (``--worker``, hidden): started and
loaded first, then told to go, so their start-up is not measured.

Usage: python bench/ingest_bench.py [--quick] [--batches N] [--nodes N] [--clusters N]
       [--lat-clusters F] [--lat-per-cluster P] [--lat-failing K]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import cProfile
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from metalguard.controller.broker.server import NatsServer, find_nats_server
from metalguard.controller.core.scoring.config import DEFAULT_SCORING
from metalguard.controller.ingest.consumer import Ingest
from metalguard.controller.ingest.settings import IngestSettings, StreamKind, durable_name, tune_gc
from metalguard.controller.region import RegionController
from metalguard.controller.state.store import NodeStore
from metalguard.controller.state.streams import ensure_streams
from metalguard.proto.base import NodeIdentity
from metalguard.proto.codec import decode, encode
from metalguard.proto.events import ControllerEvent
from metalguard.proto.subjects import Subjects
from metalguard.proto.telemetry import (
    AerCounters,
    CollectorRun,
    EdacController,
    EdacDimm,
    Fan,
    HwmonChip,
    PcieDevice,
    TelemetryBatch,
    Temperature,
)

REGION = "r1"
PUBLISH_CHUNK = 500
"""Publishes in flight at once while filling the stream."""
ISOLATION_GOAL_S = 1.0
RATIO_GOAL = 0.7
PROFILE_ENV = "MG_INGEST_BENCH_PROFILE"
"""A folder: each controller process profiles itself (cProfile) from "go" on, into it."""
PARTS = ("first-contact", "steady", "latency", "memory")
"""What ``--only`` can name: the throughput shapes, the latency, the memory per node."""

AER_COR = ("RxErr", "BadTLP", "BadDLLP", "Rollover", "Timeout", "NonFatalErr", "CorrIntErr")
AER_UNCOR = ("DLP", "SDES", "TLP", "FCP", "CmpltTO", "CmpltAbrt", "UnxCmplt", "RxOF", "MalfTLP")


# --- the batches ------------------------------------------------------------------------


def cluster_name(i: int) -> str:
    return f"c{i:02d}"


def node_name(i: int) -> str:
    return f"n{i:05d}"


def make_batch(
    cluster: str, node: str, seq: int, ue_dimm: int | None = None, interval_s: float = 15.0
) -> TelemetryBatch:
    """A healthy node's cycle: 2 EDAC controllers x 4 DIMMs, 4 PCIe functions with AER
    counter dicts, one hwmon chip with 4 fans and 4 temperatures (jittering with ``seq``,
    as real sensors do), 4 collector runs.
    ``ue_dimm``: that DIMM (0-7) reports one uncorrectable ECC error."""
    edac = tuple(
        EdacController(
            mc=mc,
            ce_count=2,
            ue_count=1 if ue_dimm is not None and ue_dimm // 4 == mc else 0,
            ce_noinfo_count=0,
            ue_noinfo_count=0,
            dimms=tuple(
                EdacDimm(
                    name=f"dimm{d}",
                    label=f"CPU_SrcID#{mc}_MC#{mc}_Chan#{d // 2}_DIMM#{d % 2}",
                    ce_count=1 if d < 2 else 0,
                    ue_count=1 if ue_dimm == mc * 4 + d else 0,
                )
                for d in range(4)
            ),
        )
        for mc in range(2)
    )
    cor = {name: 0 for name in AER_COR} | {"TOTAL_ERR_COR": 0}
    pcie = tuple(
        PcieDevice(
            address=f"0000:{0x17 + 0x10 * i:02x}:00.0",
            pci_class="0x030200" if i < 2 else "0x020700",
            vendor="0x10de" if i < 2 else "0x15b3",
            device="0x2330" if i < 2 else "0x1021",
            current_link_speed_gts=32.0,
            max_link_speed_gts=32.0,
            current_link_width=16,
            max_link_width=16,
            aer=AerCounters(
                correctable=cor,
                fatal={name: 0 for name in AER_UNCOR} | {"TOTAL_ERR_FATAL": 0},
                nonfatal={name: 0 for name in AER_UNCOR} | {"TOTAL_ERR_NONFATAL": 0},
            ),
        )
        for i in range(4)
    )
    hwmon = (
        HwmonChip(
            chip="platform_nct6775_656",
            name="nct6798",
            fans=tuple(
                Fan(sensor=f"fan{i}", rpm=4200.0 + 10 * i + (seq * 7 + i) % 50, min_rpm=600.0)
                for i in range(4)
            ),
            temps=tuple(
                Temperature(
                    sensor=f"temp{i}",
                    celsius=45.0 + i + 0.5 * ((seq + i) % 3),
                    crit_celsius=95.0,
                    max_celsius=85.0,
                )
                for i in range(4)
            ),
        ),
    )
    collectors = tuple(
        CollectorRun(collector=c, duration_s=0.002 + 0.0001 * (seq % 5), success=True)
        for c in ("edac", "pcie", "hwmon", "smart")
    )
    now = time.time()
    return TelemetryBatch(
        node=NodeIdentity(region=REGION, cluster=cluster, node=node),
        seq=seq,
        ts=now,
        interval_s=interval_s,
        started_ts=now - 0.01,
        edac=edac,
        pcie=pcie,
        hwmon=hwmon,
        collectors=collectors,
    )


def fleet_batches(
    subjects: Subjects, count: int, nodes: int, clusters: int
) -> list[tuple[str, bytes]]:
    """``count`` encoded batches, round robin over ``nodes`` nodes spread over ``clusters``
    (each node's ``seq`` and ``ts`` grow with its cycles)."""
    names = [(cluster_name(i % clusters), node_name(i)) for i in range(nodes)]
    out = []
    for k in range(count):
        cluster, node = names[k % nodes]
        batch = make_batch(cluster, node, seq=1 + k // nodes)
        out.append((subjects.telemetry(REGION, cluster, node), encode(batch)))
    return out


async def fill(js: JetStreamContext, batches: list[tuple[str, bytes]]) -> float:
    """Publish ``batches`` (pipelined, PUBLISH_CHUNK in flight); msgs/s."""
    started = time.perf_counter()
    for i in range(0, len(batches), PUBLISH_CHUNK):
        chunk = batches[i : i + PUBLISH_CHUNK]
        await asyncio.gather(*(js.publish(s, d, timeout=30) for s, d in chunk))
    return len(batches) / (time.perf_counter() - started)


# --- the controller process (--worker) --------------------------------------------------


async def worker(url: str, prefix: str, clusters: tuple[str, ...]) -> None:
    """A controller process, wired as ``metalguard controller run`` wires it: load, say
    ready; then each "go" starts a new ingest on the durable and "pause" stops it (says
    "paused"); at stdin EOF stop and print the last go's counts and CPU."""
    nc = await nats.connect(url, name="ingest-bench-worker")
    js = nc.jetstream(timeout=10)
    subjects = Subjects(prefix)
    store = await NodeStore.open(js, subjects)
    region = RegionController(js, store, subjects, REGION)
    await region.start()
    tune_gc()  # as controller/service.py does once the state is loaded
    settings = IngestSettings(region=REGION, clusters=clusters)
    ingest = Ingest(js, subjects, settings, region)
    loop = asyncio.get_running_loop()
    profile_dir = os.environ.get(PROFILE_ENV)
    profiler = cProfile.Profile() if profile_dir else None
    print("ready", flush=True)
    cpu0 = time.process_time()
    running = False
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        if line.strip() == "go" and not running:
            ingest = Ingest(js, subjects, settings, region)
            cpu0 = time.process_time()
            if profiler is not None:
                profiler.enable()
            await ingest.start()
            running = True
        elif line.strip() == "pause" and running:
            await ingest.stop()
            running = False
            print("paused", flush=True)
    if running:
        await ingest.stop()
    if profiler is not None and profile_dir:
        profiler.disable()
        profiler.dump_stats(Path(profile_dir) / f"worker-{prefix}-{os.getpid()}.pstats")
    await region.stop()
    stats = ingest.stats()
    cpu = time.process_time() - cpu0
    counts = {"ingested": stats.total("ingested"), "errors": stats.total("handler_errors")}
    grades = collections.Counter(r.grade for r in store.records.values())
    print(
        json.dumps(counts | {"cpu_ms": round(cpu * 1000), "grades": dict(sorted(grades.items()))})
    )
    await nc.close()


@dataclass
class Worker:
    """A controller child process and the durable it consumes telemetry with."""

    proc: subprocess.Popen[str]
    durable: str

    @classmethod
    def spawn(cls, url: str, prefix: str, clusters: tuple[str, ...]) -> Worker:
        cmd = [sys.executable, __file__, "--worker", "--url", url, "--prefix", prefix]
        if clusters:
            cmd += ["--own", ",".join(clusters)]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        settings = IngestSettings(region=REGION, clusters=clusters)
        return cls(proc, durable_name(settings, StreamKind.TELEMETRY))

    async def ready(self) -> None:
        assert self.proc.stdout is not None
        line = await asyncio.to_thread(self.proc.stdout.readline)
        if line.strip() != "ready":
            raise RuntimeError(f"controller worker did not start (said {line!r})")

    def go(self) -> None:
        self._say("go")

    async def pause(self) -> None:
        """Stop its ingest (the durable keeps its position) and wait until it has."""
        assert self.proc.stdout is not None
        self._say("pause")
        line = await asyncio.to_thread(self.proc.stdout.readline)
        if line.strip() != "paused":
            raise RuntimeError(f"controller worker did not pause (said {line!r})")

    def _say(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{command}\n")
        self.proc.stdin.flush()

    async def finish(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.close()
        out = await asyncio.to_thread(self.proc.stdout.read)
        await asyncio.to_thread(self.proc.wait, 30)
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        return json.loads(lines[-1]) if lines else {}

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


async def drained(js: JetStreamContext, stream: str, durables: list[str]) -> bool:
    """Whether every durable has nothing pending and nothing unacknowledged."""
    for durable in durables:
        try:
            info = await js.consumer_info(stream, durable)
        except NotFoundError:
            return False  # not created yet
        if info.num_pending or info.num_ack_pending:
            return False
    return True


async def run_workers(
    js: JetStreamContext,
    url: str,
    subjects: Subjects,
    owners: list[tuple[str, ...]],
    n: int,
    warm_up: list[tuple[str, bytes]] | None = None,
    timed: list[tuple[str, bytes]] | None = None,
) -> tuple[float, list[dict[str, Any]]]:
    """Start one controller per cluster set, go, wait until all is acked; (batches/s, stats).

    With ``warm_up``: publish it, let the controllers take it in, pause them, publish
    ``timed`` (``n`` batches) and time only that (steady state: every node known)."""
    workers = [Worker.spawn(url, subjects.prefix, own) for own in owners]
    durables = [w.durable for w in workers]
    try:
        await asyncio.gather(*(w.ready() for w in workers))
        if warm_up is not None:
            await fill(js, warm_up)
            for w in workers:
                w.go()
            await wait_drained(js, subjects.stream_telemetry, durables)
            await asyncio.gather(*(w.pause() for w in workers))
            await fill(js, timed or [])
        started = time.perf_counter()
        for w in workers:
            w.go()
        await wait_drained(js, subjects.stream_telemetry, durables)
        rate = n / (time.perf_counter() - started)
        return rate, [await w.finish() for w in workers]
    finally:
        for w in workers:
            w.kill()


async def wait_drained(js: JetStreamContext, stream: str, durables: list[str]) -> None:
    deadline = time.monotonic() + 600
    while not await drained(js, stream, durables):
        if time.monotonic() > deadline:
            raise RuntimeError("the controllers did not drain the stream in 600 s")
        await asyncio.sleep(0.05)


# --- (a) throughput ---------------------------------------------------------------------


async def raw_consume(
    js: JetStreamContext, subjects: Subjects, n: int, durable: str = "raw"
) -> tuple[float, float]:
    """The baseline: pull 256 at a time, decode, ack, until ``n`` messages; (msgs/s, CPU
    ms of this process per message)."""
    sub = await js.pull_subscribe(
        subjects.all_of("tel"), durable=durable, stream=subjects.stream_telemetry
    )
    got = 0
    started = time.perf_counter()
    cpu0 = time.process_time()
    while got < n:
        try:
            msgs = await sub.fetch(batch=256, timeout=2)
        except nats.errors.TimeoutError:
            raise RuntimeError(f"raw consumer got {got} of {n} messages") from None
        for msg in msgs:
            decode(msg.data, TelemetryBatch)
            await msg.ack()
        got += len(msgs)
    rate = n / (time.perf_counter() - started)
    cpu_ms = (time.process_time() - cpu0) * 1000 / n
    await sub.unsubscribe()
    return rate, cpu_ms


async def throughput(nc: Client, url: str, n: int, nodes: int, clusters: int) -> None:
    js = nc.jetstream(timeout=30)
    subjects = Subjects("iba")
    await ensure_streams(js, subjects)
    batches = fleet_batches(subjects, n, nodes, clusters)
    size = sum(len(d) for _, d in batches) / n
    fill_rate = await fill(js, batches)
    print(f"\n(a) throughput: {n:,} batches from {nodes:,} nodes in {clusters} clusters, "
          f"{size:,.0f} bytes each (stream filled at {fill_rate:,.0f} msgs/s)")  # fmt: skip
    # The baseline before and after the controller (interleaved: the machine's load moves
    # between phases); the ratio is against their mean.
    raw_before, cpu_before = await raw_consume(js, subjects, n)
    one, stats1 = await run_workers(js, url, subjects, [()], n)
    raw_after, cpu_after = await raw_consume(js, subjects, n, durable="raw-after")
    raw, raw_cpu = (raw_before + raw_after) / 2, (cpu_before + cpu_after) / 2
    print(f"raw consumer before / after the 1-process controller: {raw_before:,.0f} / "
          f"{raw_after:,.0f} msgs/s (the ratio is against their mean)")  # fmt: skip

    subjects2 = Subjects("ibb")
    await ensure_streams(js, subjects2)
    await fill(js, fleet_batches(subjects2, n, nodes, clusters))
    names = [cluster_name(i) for i in range(clusters)]
    two, stats2 = await run_workers(js, url, subjects2, [tuple(names[0::2]), tuple(names[1::2])], n)

    report("", raw, one, two, stats1 + stats2, raw_cpu)


async def steady(nc: Client, url: str, n: int, nodes: int, clusters: int) -> None:
    """Steady state: the controllers know every node (two warm-up cycles) before "go"."""
    js = nc.jetstream(timeout=30)
    names = [cluster_name(i) for i in range(clusters)]
    warm = 2 * nodes
    owners = [tuple(names[0::2]), tuple(names[1::2])]
    rates: list[float] = []
    stats: list[dict[str, Any]] = []
    shapes: list[tuple[str, list[tuple[str, ...]]]] = [("ibs", [()]), ("ibt", owners)]
    for prefix, own in shapes:
        subjects3 = Subjects(prefix)
        await ensure_streams(js, subjects3)
        batches3 = fleet_batches(subjects3, warm + n, nodes, clusters)
        rate, st = await run_workers(js, url, subjects3, own, n, batches3[:warm], batches3[warm:])
        rates.append(rate)
        stats += st
    subjects4 = Subjects("ibr")  # the raw consumer over the same (seq 3 on) batches
    await ensure_streams(js, subjects4)
    await fill(js, fleet_batches(subjects4, warm + n, nodes, clusters)[warm:])
    raw_steady, raw_steady_cpu = await raw_consume(js, subjects4, n)
    print(f"\n(a) steady state: the same {n:,} batches (each node's cycles 3 on) to controllers "
          f"that took in {warm:,} warm-up batches (2 per node) before \"go\"")  # fmt: skip
    report("steady ", raw_steady, rates[0], rates[1], stats, raw_steady_cpu)


def report(
    label: str, raw: float, one: float, two: float, stats: list[dict[str, Any]], raw_cpu: float
) -> None:
    """The throughput table of one shape (``label``: "" or "steady ", starts its lines)."""
    what = ("nodes known", "nodes known") if label else ("score, decide, KV", "clusters split")
    rows = {
        "raw nats-py pull + decode + ack": raw,
        f"1 controller process ({what[0]})": one,
        f"2 controller processes ({what[1]})": two,
    }
    print(f"{'consumer':<44} {'msgs/s':>9} {'vs raw':>7}")
    for name, rate in rows.items():
        print(f"{name:<44} {rate:>9,.0f} {rate / raw:>6.2f}x")
    verdict = "met" if one / raw >= RATIO_GOAL else "missed"
    print(f"{label}controller/raw = {one / raw:.2f} (goal >= {RATIO_GOAL}: {verdict}); "
          f"2 processes / 1 = {two / one:.2f}")  # fmt: skip
    handled = [s.get("ingested", 0) for s in stats]
    errors = sum(s.get("errors", 0) for s in stats)
    print(f"{label}handled per process: {handled} (handler errors: {errors})")
    cpu = [s.get("cpu_ms", 0) / max(1, s.get("ingested", 0)) for s in stats]
    print(f"{label}controller CPU per batch: 1 process {cpu[0]:.2f} ms; "
          f"2 processes {cpu[1]:.2f} / {cpu[2]:.2f} ms; raw consumer {raw_cpu:.2f} ms")  # fmt: skip


# --- (b) fault-to-isolation latency ------------------------------------------------------


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered) + 0.5) - 1))]


async def latency(nc: Client, url: str, clusters: int, per_cluster: int, failing: int) -> None:
    js = nc.jetstream(timeout=30)
    subjects = Subjects("ibl")
    await ensure_streams(js, subjects)
    nodes = clusters * per_cluster
    bad = failing * clusters
    print(f"\n(b) fault to isolation: {nodes:,} nodes ({clusters} clusters x {per_cluster}), "
          f"{bad} fail at once ({failing} per cluster; rail limit "
          f"{max(1, per_cluster // 10)} per cluster)")  # fmt: skip
    await fill(js, fleet_batches(subjects, nodes, nodes, clusters))
    arrived: dict[str, float] = {}
    kinds: collections.Counter[str] = collections.Counter()
    all_arrived = asyncio.Event()

    async def on_msg(msg: Msg) -> None:
        now = time.monotonic()
        event = decode(msg.data, ControllerEvent)
        kinds[event.kind] += 1
        if event.kind == "node.isolated" and event.node is not None:
            arrived.setdefault(event.node.node, now)
            if len(arrived) >= bad:
                all_arrived.set()

    sub = await nc.subscribe(subjects.all_of("ctl"), cb=on_msg)
    w = Worker.spawn(url, subjects.prefix, ())
    try:
        await w.ready()
        started = time.perf_counter()
        w.go()
        deadline = time.monotonic() + 300
        while not await drained(js, subjects.stream_telemetry, [w.durable]):
            if time.monotonic() > deadline:
                raise RuntimeError("the controller did not take in the healthy batches in 300 s")
            await asyncio.sleep(0.1)
        warm = time.perf_counter() - started
        print(f"all {nodes:,} nodes known and HEALTHY after {warm:.1f} s ({nodes / warm:,.0f} "
              "batches/s, each a first batch: record and history created in KV)")  # fmt: skip
        await asyncio.sleep(0.5)
        victims = [
            (cluster_name(i % clusters), node_name(i))
            for i in range(nodes)
            if i // clusters < failing
        ]
        encoded = [
            (subjects.telemetry(REGION, c, n), encode(make_batch(c, n, seq=2, ue_dimm=5)))
            for c, n in victims
        ]
        published: dict[str, float] = {}

        async def publish(subject: str, data: bytes, node: str) -> None:
            published[node] = time.monotonic()
            await js.publish(subject, data, timeout=30)

        burst0 = time.monotonic()
        await asyncio.gather(
            *(publish(s, d, n) for (s, d), (_, n) in zip(encoded, victims, strict=True))
        )
        burst = time.monotonic() - burst0
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(all_arrived.wait(), 30)
        await asyncio.sleep(0.2)
        stats = await w.finish()
    finally:
        w.kill()
        await sub.unsubscribe()
    lat = [arrived[n] - published[n] for _, n in victims if n in arrived]
    within = sum(1 for v in lat if v <= ISOLATION_GOAL_S)
    print(f"the {bad} failing batches were published (acked by JetStream) in {burst:.2f} s")
    print(f"{'isolated':>9} {'p50 s':>7} {'p90 s':>7} {'p99 s':>7} {'max s':>7} {'<=1 s':>7}")
    if lat:
        print(f"{len(lat):>5}/{bad:<3} {percentile(lat, 50):>7.3f} {percentile(lat, 90):>7.3f} "
              f"{percentile(lat, 99):>7.3f} {max(lat):>7.3f} {within:>7}")  # fmt: skip
        verdict = "met" if len(lat) == bad and percentile(lat, 99) <= ISOLATION_GOAL_S else "missed"
        mean = statistics.fmean(lat)
        print(f"p99 fault-to-isolation = {percentile(lat, 99):.3f} s (goal <= "
              f"{ISOLATION_GOAL_S:g} s: {verdict}); mean {mean:.3f} s")  # fmt: skip
    else:
        print(f"    0/{bad} no node.isolated arrived within 30 s")
    print(f"controller handled {stats.get('ingested', '?')} messages, "
          f"{stats.get('errors', '?')} handler errors; grades at the end: "
          f"{stats.get('grades', '?')}")  # fmt: skip
    print(f"control events seen: {dict(sorted(kinds.items()))}")


# --- (c) memory per node ----------------------------------------------------------------

MEMORY_GOAL_KIB = 8.0
FLEETS = {
    "": "one hardware model",
    "edac": "each node's own EDAC counts",
    "all": "own EDAC counts, PCIe addrs",
}
MEMORY_CYCLES = 2
"""Batches per node before the memory is measured: the first (record and history made)
and the next (the steady path's first: liveness cached, sections and rule outputs reused)."""


class _StubKV:
    """Just enough of a KV bucket for NodeStore's writes (no server, no I/O)."""

    def __init__(self) -> None:
        self.revision = 0

    async def create(self, key: str, value: bytes) -> int:
        self.revision += 1
        return self.revision

    async def update(self, key: str, value: bytes, last: int | None = None) -> int:
        return await self.create(key, value)

    async def put(self, key: str, value: bytes) -> int:
        return await self.create(key, value)

    async def delete(self, key: str) -> None:
        return None


@dataclass(frozen=True)
class _StubMsg:
    subject: str
    data: bytes


def rss_bytes() -> int:
    """This process's resident set size now (Linux: /proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def deep_size(root: object, seen: set[int]) -> int:
    """Bytes of ``root`` and everything it holds that ``seen`` does not have yet (added
    to it): shared objects are counted once, in the first part that reaches them."""
    total = 0
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, type) or callable(obj):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        if isinstance(obj, dict):
            stack += obj.keys()
            stack += obj.values()
        elif isinstance(obj, list | tuple | set | frozenset | collections.deque):
            stack += obj
        elif hasattr(obj, "__struct_fields__"):
            stack += (getattr(obj, f) for f in obj.__struct_fields__)
        else:
            for cls in type(obj).__mro__:
                for slot in getattr(cls, "__slots__", ()):
                    if hasattr(obj, slot):
                        stack.append(getattr(obj, slot))
            if hasattr(obj, "__dict__"):
                stack.append(vars(obj))
    return total


def memory_worker(nodes: int, clusters: int, distinct: str, breakdown: bool) -> None:
    """Feed ``nodes`` nodes' first MEMORY_CYCLES batches through ingest's decoding and
    the region controller (KV stubbed), in this process; print the RSS it grew by."""
    asyncio.run(_memory_worker(nodes, clusters, distinct, breakdown))


async def _memory_worker(nodes: int, clusters: int, distinct: str, breakdown: bool) -> None:
    js: Any = None  # healthy nodes publish nothing
    subjects = Subjects("ibm")
    store = NodeStore(_StubKV(), js)  # type: ignore[arg-type]
    region = RegionController(js, store, subjects, REGION)
    ingest = Ingest(js, subjects, IngestSettings(region=REGION), region)
    route = ingest._routes[0]  # telemetry: what the fetch loop does with each message
    templates = [make_batch(cluster_name(0), node_name(0), seq=c) for c in range(1, 3)]
    gc.collect()
    before = rss_bytes()
    started = time.perf_counter()
    for template in templates:
        for i in range(nodes):
            cluster, node = cluster_name(i % clusters), node_name(i)
            batch = msgspec.structs.replace(
                template, node=NodeIdentity(region=REGION, cluster=cluster, node=node)
            )
            if distinct:  # this node's own EDAC counts (and PCIe addresses)
                edac = tuple(msgspec.structs.replace(mc, ce_count=i) for mc in batch.edac)
                batch = msgspec.structs.replace(batch, edac=edac)
            if distinct == "all":
                pcie = tuple(
                    msgspec.structs.replace(d, address=f"{i:04x}:{d.address[5:]}")
                    for d in batch.pcie
                )
                batch = msgspec.structs.replace(batch, pcie=pcie)
            msg = _StubMsg(subjects.telemetry(REGION, cluster, node), encode(batch))
            verdict = ingest._classify(route, msg)  # type: ignore[arg-type]
            assert isinstance(verdict, tuple), verdict
            assert isinstance(verdict[1], TelemetryBatch)
            rest = region.on_batch_now(verdict[1], time.time())
            if rest is not None:
                await rest()
    elapsed = time.perf_counter() - started
    gc.collect()
    grown = rss_bytes() - before
    out: dict[str, Any] = {"rss": grown, "batch_ms": elapsed * 1000 / (nodes * len(templates))}
    if breakdown:
        seen: set[int] = set()
        deep_size(DEFAULT_SCORING, seen)  # shared by all, not per node
        parts = {
            "decoder": (ingest._batches, ingest._parsed),
            "records": (store.records, store._revisions, store._unwritten, store._sizes),
            "history": (region._signals, store.signals),
            "memo": region._memos,
            "scores": region._scores,
            "other": (region._qos, region._bmc, region.topology, region.congestion),
        }
        out["parts"] = {name: deep_size(part, seen) for name, part in parts.items()}
    print(json.dumps(out))


async def memory(counts: list[int], clusters: int) -> None:
    """(c): the controller's memory per node at each of ``counts`` nodes, one child
    process each (a fresh heap), for a fleet of one hardware model and, at the first
    count, for one whose every node has its own EDAC counts, then its own EDAC counts and
    PCIe addresses (every section distinct: nothing shared)."""
    print(f"\n(c) memory per node: each node's first {MEMORY_CYCLES} batches through ingest's "
          "decoding and one region controller, in one process (KV stubbed: the state kept, "
          "not the I/O); RSS grown / nodes")  # fmt: skip
    print(f"{'nodes':>9} {'fleet':<30} {'RSS grown':>10} {'KiB/node':>9} {'ms/batch':>9}")
    shapes = [(n, "") for n in counts] + [(counts[0], "edac"), (counts[0], "all")]
    worst = 0.0
    for n, distinct in shapes:
        cmd = [sys.executable, __file__, "--memory-worker", str(n), "--clusters", "20"]
        cmd += ["--distinct", distinct] if distinct else []
        cmd += ["--breakdown"] if n == counts[0] else []
        done = await asyncio.to_thread(
            subprocess.run, cmd, capture_output=True, text=True, timeout=900, check=True
        )
        got = json.loads(done.stdout.strip().splitlines()[-1])
        per_node = got["rss"] / 1024 / n
        if not distinct:
            worst = max(worst, per_node)
        fleet = FLEETS[distinct]
        print(f"{n:>9,} {fleet:<30} {got['rss'] / 2**20:>6.1f} MiB {per_node:>9.2f} "
              f"{got['batch_ms']:>9.3f}")  # fmt: skip
        if "parts" in got:
            parts = ", ".join(f"{k} {v / 1024 / n:.2f}" for k, v in got["parts"].items())
            print(f"{'':>9} objects held, KiB/node: {parts}")
    verdict = "met" if worst <= MEMORY_GOAL_KIB else "missed"
    print(f"controller memory per node = {worst:.2f} KiB at most, one hardware model (goal "
          f"<= {MEMORY_GOAL_KIB:g} KiB: {verdict})")  # fmt: skip


# --- main ---------------------------------------------------------------------------------


def machine_note() -> str:
    try:
        version = subprocess.run(
            [find_nats_server(), "--version"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError, RuntimeError):
        version = "nats-server ?"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"machine: {os.cpu_count()} vCPU {platform.machine()}, Python "
            f"{platform.python_version()}, {version}, load average {load:.1f}; nats-server, "
            f"this script and the controller process(es) share these CPUs")  # fmt: skip


async def measure(args: argparse.Namespace, root: Path) -> None:
    server = NatsServer(store_dir=root / "js")
    url = await asyncio.to_thread(server.start)
    nc = await nats.connect(url, name="ingest-bench")
    try:
        print(machine_note())
        if args.quick:
            print("quick mode: tiny sizes (smoke test), figures not meaningful")
        parts = set(args.only.split(","))
        if "first-contact" in parts:
            await throughput(nc, url, args.batches, args.nodes, args.clusters)
        if "steady" in parts:
            await steady(nc, url, args.batches, args.nodes, args.clusters)
        if "latency" in parts:
            await latency(nc, url, args.lat_clusters, args.lat_per_cluster, args.lat_failing)
        if "memory" in parts:
            await memory([int(n) for n in args.memory_nodes.split(",")], args.clusters)
    finally:
        await nc.close()
        await asyncio.to_thread(server.close)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a few seconds (smoke)")
    parser.add_argument("--batches", type=int, default=20_000)
    parser.add_argument("--nodes", type=int, default=2_000)
    parser.add_argument("--clusters", type=int, default=8)
    parser.add_argument("--lat-clusters", type=int, default=20)
    parser.add_argument("--lat-per-cluster", type=int, default=500)
    parser.add_argument("--lat-failing", type=int, default=25)
    parser.add_argument(
        "--only",
        default=",".join(PARTS),
        help=f"comma-separated parts to run, of {','.join(PARTS)} (default: all)",
    )
    parser.add_argument(
        "--memory-nodes", default="10000,100000", help="node counts of the memory part"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--memory-worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--distinct", default="", help=argparse.SUPPRESS)
    parser.add_argument("--breakdown", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    parser.add_argument("--own", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_worker is not None:
        memory_worker(args.memory_worker, args.clusters, args.distinct, args.breakdown)
        return 0
    if args.worker:
        own = tuple(c for c in args.own.split(",") if c)
        asyncio.run(worker(args.url, args.prefix, own))
        return 0
    if args.quick:
        args.batches, args.nodes, args.clusters = 400, 40, 4
        args.lat_clusters, args.lat_per_cluster, args.lat_failing = 4, 50, 5
        args.memory_nodes = "200,400"
    with tempfile.TemporaryDirectory(prefix="mg-ingest-bench-") as tmp:
        asyncio.run(measure(args, Path(tmp)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
