"""A region on a 3-server NATS cluster (JetStream R3) with controller shards, each owning
its clusters by a lease: ``controller setup --replicas 3`` against the cluster; a shard
process SIGKILLed, its clusters taken over by another, every injected fault isolated
exactly once; a NATS server killed, no batch lost (docs/scaling.md)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from functools import partial
from pathlib import Path
from uuid import uuid4

import nats
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext

from metalguard.controller.broker.cluster import NatsCluster
from metalguard.proto.subjects import Subjects
from tests.support.harness.ha_leases import TTL_S
from tests.support.harness.region_cluster import (
    REGION,
    Fleet,
    ShardProc,
    backlog,
    holder,
    isolations,
    run_setup,
    settled,
    shard_config,
    short_leases_r3,
    start_shard,
    stream_messages,
)
from tests.support.waiting import wait_for_value

DEADLINE_S = 30.0
GROUPS = {"s0": ["c0"], "s1": ["c1"]}
NODES = [(c, f"n{i}") for c in ("c0", "c1") for i in range(4)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[NatsCluster]:
    """Three clustered nats-servers on loopback (one per test module)."""
    with NatsCluster(3) as c:
        yield c


@pytest.fixture
async def region(cluster: NatsCluster) -> AsyncIterator[tuple[Client, Subjects]]:
    """A client on the cluster and this test's prefix, set up with ``controller setup
    --replicas 3`` (the CLI, as an operator runs it) and leases of TTL_S."""
    subjects = Subjects(f"t{uuid4().hex[:8]}")
    code, output = await run_setup(cluster.urls, subjects.prefix, replicas=3)
    assert code == 0, output
    nc = await nats.connect(servers=cluster.urls, connect_timeout=2, reconnect_time_wait=0.2)
    try:
        await short_leases_r3(nc.jetstream(timeout=5), subjects)
        yield nc, subjects
    finally:
        await nc.close()


@pytest.fixture
async def fleet(region: tuple[Client, Subjects]) -> AsyncIterator[Fleet]:
    nc, subjects = region
    f = Fleet(nc.jetstream(timeout=5), subjects, NODES)
    task = asyncio.create_task(f.run())
    try:
        yield f
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def start_shards(
    tmp_path: Path, cluster: NatsCluster, subjects: Subjects, homes: dict[str, list[str]]
) -> dict[str, ShardProc]:
    """Start the shard processes one after another, each holding its home shards before the
    next starts; only the last takes over others' shards.  (Started together, a loaded
    machine could start one so late that another, past its takeover_after_s, took its home
    shard first: a takeover the test did not ask for.)"""
    procs: dict[str, ShardProc] = {}
    nc = await nats.connect(servers=cluster.urls, connect_timeout=2)
    try:
        js = nc.jetstream(timeout=5)
        for i, (instance, home) in enumerate(homes.items()):
            last = i == len(homes) - 1
            config = tmp_path / f"{instance}.toml"
            config.write_text(
                shard_config(cluster.urls, subjects.prefix, instance, GROUPS, home, takeover=last)
            )
            procs[instance] = await start_shard(config, instance)
            await wait_holders(js, subjects, dict.fromkeys(home, instance))
    except BaseException:
        for proc in procs.values():
            await proc.stop()
        raise
    finally:
        await nc.close()
    return procs


async def test_setup_replicas_3_makes_r3_streams_and_buckets(
    region: tuple[Client, Subjects],
) -> None:
    nc, subjects = region
    js = nc.jetstream(timeout=5)
    for name in (subjects.stream_telemetry, subjects.stream_control, subjects.stream_events):
        info = await js.stream_info(name)
        assert info.config.num_replicas == 3
        assert info.cluster is not None
        assert len(info.cluster.replicas or []) == 2
    for bucket in ("nodes", "leases"):
        status = await (await js.key_value(subjects.bucket(bucket))).status()
        assert status.stream_info.config.num_replicas == 3


async def wait_holders(js: JetStreamContext, subjects: Subjects, owners: dict[str, str]) -> None:
    """Wait until each shard's lease is held by its expected owner."""

    async def holders() -> dict[str, str | None]:
        return {s: await settled(holder(js, subjects, s), None) for s in owners}

    await wait_for_value(holders, lambda got: got == owners, DEADLINE_S, f"owners {owners}")


async def settled_backlog(
    js: JetStreamContext, subjects: Subjects, shard: str, clusters: list[str]
) -> int:
    return await settled(backlog(js, subjects, shard, clusters), -1)


async def wait_isolated(nc: Client, subjects: Subjects, handles: set[str], what: str) -> None:
    js = nc.jetstream(timeout=5)
    await wait_for_value(
        lambda: settled(isolations(js, subjects), Counter()),
        lambda got: handles <= set(got),
        DEADLINE_S,
        what,
    )


async def test_killed_shard_is_taken_over_and_each_fault_isolated_once(
    tmp_path: Path, cluster: NatsCluster, region: tuple[Client, Subjects], fleet: Fleet
) -> None:
    nc, subjects = region
    js = nc.jetstream(timeout=5)
    procs = await start_shards(tmp_path, cluster, subjects, {"a": ["s0"], "b": ["s1"]})
    try:
        await wait_holders(js, subjects, {"s0": "a", "s1": "b"})
        # a fault in each shard while both owners live
        fleet.failing |= {f"{REGION}.c0.n1", f"{REGION}.c1.n1"}
        await wait_isolated(nc, subjects, set(fleet.failing), "both shards isolate n1")

        # a dies (SIGKILL); a fault in its cluster right after
        killed = time.monotonic()
        procs["a"].kill()
        await procs["a"].proc.wait()
        fleet.failing.add(f"{REGION}.c0.n2")
        await wait_for_value(
            lambda: holder(js, subjects, "s0"), lambda got: got == "b", DEADLINE_S, "b takes s0"
        )
        took = time.monotonic() - killed
        print(f"shard s0 taken over {took:.2f}s after its owner's SIGKILL (lease TTL {TTL_S}s)")
        await wait_isolated(nc, subjects, set(fleet.failing), "b isolates c0.n2")
        fleet.failing.add(f"{REGION}.c1.n3")  # and one in b's own shard
        await wait_isolated(nc, subjects, set(fleet.failing), "b isolates c1.n3")

        # more rounds of the failing nodes' batches: nothing is decided again
        for _ in range(4):
            await asyncio.wait_for(fleet.rounds.wait(), DEADLINE_S)
        got = await isolations(js, subjects)
        assert dict(got) == dict.fromkeys(fleet.failing, 1), got
    finally:
        for proc in procs.values():
            await proc.stop()
        for proc in procs.values():
            print(f"--- {proc.instance}:\n" + proc.log.read_text()[-3000:])


async def test_killed_nats_server_loses_no_batch(
    tmp_path: Path, cluster: NatsCluster, region: tuple[Client, Subjects], fleet: Fleet
) -> None:
    nc, subjects = region
    js = nc.jetstream(timeout=5)
    procs = await start_shards(tmp_path, cluster, subjects, {"a": ["s0"], "b": ["s1"]})
    victim = 2
    try:
        await wait_holders(js, subjects, {"s0": "a", "s1": "b"})
        await asyncio.wait_for(fleet.rounds.wait(), DEADLINE_S)
        info = await js.stream_info(subjects.stream_telemetry)
        assert info.cluster is not None
        names = [f"n{i + 1}" for i in range(3)]
        victim = names.index(info.cluster.leader or "n1")  # the stream's leader
        cluster.kill(victim)
        fleet.failing.add(f"{REGION}.c1.n2")  # a fault while the stream re-elects
        await wait_isolated(nc, subjects, set(fleet.failing), "c1.n2 isolated, one server down")
        for _ in range(3):
            await asyncio.wait_for(fleet.rounds.wait(), DEADLINE_S)
        # the fleet pauses: the stream holds each acknowledged batch once, and each
        # shard's consumer has taken in every one of them
        fleet.paused = True
        published = fleet.acked
        print(
            f"{published} batches acknowledged, {fleet.retries} publishes retried, "
            f"longest wait for an ack {fleet.longest_publish_s:.2f}s (the stream's re-election)"
        )
        await wait_for_value(
            lambda: settled(stream_messages(js, subjects), -1),
            lambda n: n == published,
            DEADLINE_S,
            "every acknowledged batch in the stream, once",
        )
        for shard, clusters in GROUPS.items():
            await wait_for_value(
                partial(settled_backlog, js, subjects, shard, clusters),
                lambda n: n == 0,
                DEADLINE_S,
                f"{shard}'s owner to take in every batch",
            )
        for proc in procs.values():
            assert proc.proc.returncode is None
        got = await settled(isolations(js, subjects), Counter())
        assert dict(got) == dict.fromkeys(fleet.failing, 1), got
    finally:
        for proc in procs.values():
            await proc.stop()
        if not cluster.servers[victim].running:
            cluster.restart(victim)
        for proc in procs.values():
            print(f"--- {proc.instance}:\n" + proc.log.read_text()[-3000:])
