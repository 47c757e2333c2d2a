"""Loading a controller's state from KV: one ordered consumer against a get per key.

A controller loads ``<P>_NODES`` at start, and a shard process at each takeover (the
dead owner's records, rails, scoring histories and outbox: docs/scaling.md).  This bench
fills the bucket of a 3-server cluster (R3, as in a sharded region: controller/broker/
cluster.py) with ``--nodes`` records and their scoring histories, then times, in one run
and interleaved ``--repeat`` times:

- ``per key``: the baseline, one ``kv.get`` per key (how ``NodeStore.load`` read before);
- ``whole``: ``NodeStore.load`` (controller/state/kv_keys.py ``latest_values``: one
  ordered consumer delivering the last message per key);
- ``shard``: ``NodeStore.open`` with one shard's clusters (a quarter of them), what a
  takeover reads.

Prints the medians and ``per key/whole``, the ratio to the baseline.

Usage: python bench/store_load_bench.py [--nodes 20000] [--clusters 40] [--repeat 3]
       [--single] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Awaitable

import msgspec
import nats
from ingest_bench import REGION, cluster_name, machine_note, node_name
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from metalguard.controller.broker.cluster import NatsCluster
from metalguard.controller.broker.server import NatsServer
from metalguard.controller.core.scoring.signals import CounterHistory, NodeSignals
from metalguard.controller.state.kv_keys import bucket_keys
from metalguard.controller.state.store import SIGNALS_PREFIX, NodeStore
from metalguard.controller.state.streams import StreamSettings, ensure_streams
from metalguard.proto.base import NodeIdentity
from metalguard.proto.codec import encode
from metalguard.proto.nodes import NodeRecord
from metalguard.proto.subjects import Subjects

WRITES_AT_ONCE = 256


def history(i: int) -> NodeSignals:
    """A node's scoring history of the ingest bench's shape (EDAC and AER counters)."""
    keys = [f"edac.mc{m}.dimm{d}.ce" for m in range(2) for d in range(4)]
    keys += [f"aer.0000:{b:02x}:00.0.{k}" for b in range(4) for k in ("cor", "nonfatal")]
    return NodeSignals(
        updated_ts=1.7e9 + i,
        counters={k: CounterHistory(samples=((1.7e9, 0), (1.7e9 + 30, i % 3))) for k in keys},
    )


async def fill(js: JetStreamContext, kv: KeyValue, nodes: int, clusters: int) -> None:
    """``nodes`` records and histories, written ``WRITES_AT_ONCE`` at a time."""
    pending = []
    for i in range(nodes):
        node = NodeIdentity(region=REGION, cluster=cluster_name(i % clusters), node=node_name(i))
        record = NodeRecord(node=node, grade="HEALTHY", last_seq=2, last_seen_ts=1.7e9 + 30)
        pending.append(kv.put(node.handle, encode(record)))
        pending.append(kv.put(SIGNALS_PREFIX + node.handle, msgspec.msgpack.encode(history(i))))
        if len(pending) >= WRITES_AT_ONCE:
            await asyncio.gather(*pending)
            pending.clear()
    await asyncio.gather(*pending)


async def per_key(js: JetStreamContext, kv: KeyValue) -> int:
    """The baseline: every key read with its own get."""
    count = 0
    for key in await bucket_keys(js, kv):
        await kv.get(key)
        count += 1
    return count


async def whole(js: JetStreamContext, kv: KeyValue) -> int:
    """``NodeStore.load`` of the whole bucket: how many values it holds then."""
    store = NodeStore(kv, js)
    await store.load()
    return len(store.records) + len(store.signals)


async def shard_share(
    js: JetStreamContext, subjects: Subjects, clusters: list[tuple[str, str]]
) -> int:
    """A takeover's load: the records of ``clusters`` only."""
    return len((await NodeStore.open(js, subjects, clusters)).records)


async def timed(times: list[float], step: Awaitable[int]) -> int:
    """Await ``step``, adding its seconds to ``times``; its result."""
    began = time.perf_counter()
    result = await step
    times.append(time.perf_counter() - began)
    return result


async def measure(url: str | list[str], args: argparse.Namespace) -> None:
    nc = await nats.connect(servers=url)
    js = nc.jetstream(timeout=30)
    subjects = Subjects("loadbench")
    await ensure_streams(js, subjects, StreamSettings(replicas=1 if args.single else 3))
    kv = await js.key_value(subjects.bucket("nodes"))
    began = time.perf_counter()
    await fill(js, kv, args.nodes, args.clusters)
    where = "1 server" if args.single else "R3"
    print(f"bucket: {args.nodes:,} records + {args.nodes:,} scoring histories written in "
          f"{time.perf_counter() - began:.1f} s ({where})")  # fmt: skip
    shard = [(REGION, cluster_name(c)) for c in range(0, args.clusters, 4)]
    times: dict[str, list[float]] = {"per key": [], "whole": [], "shard": []}
    in_shard = sum(1 for i in range(args.nodes) if i % args.clusters % 4 == 0)
    keys = 0
    for _ in range(args.repeat):  # interleaved: the machine's noise hits each alike
        keys = await timed(times["per key"], per_key(js, kv))
        if await timed(times["whole"], whole(js, kv)) != 2 * args.nodes:
            raise SystemExit("the ordered consumer's load missed values")
        if await timed(times["shard"], shard_share(js, subjects, shard)) != in_shard:
            raise SystemExit("the shard's load is not its clusters' records")
    median = {k: statistics.median(v) for k, v in times.items()}
    print(f"per key (baseline): {median['per key']:.2f} s for {keys:,} keys "
          f"({keys / median['per key']:,.0f} keys/s)")  # fmt: skip
    ratio = median["per key"] / median["whole"]
    print(f"whole bucket, one ordered consumer: {median['whole']:.2f} s "
          f"({keys / median['whole']:,.0f} keys/s); per key/whole {ratio:.1f}x")  # fmt: skip
    print(f"a shard's share ({len(shard)} of {args.clusters} clusters): {median['shard']:.2f} s; "
          f"per key/shard {median['per key'] / median['shard']:.1f}x")  # fmt: skip
    await nc.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=20_000)
    parser.add_argument("--clusters", type=int, default=40)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--single", action="store_true", help="one server, R1")
    parser.add_argument("--quick", action="store_true", help="1,000 nodes, one repeat")
    args = parser.parse_args()
    if args.quick:
        args.nodes, args.repeat = 1_000, 1
    print(machine_note())
    print(f"load average {os.getloadavg()[0]:.1f}")
    if args.single:
        with NatsServer() as server:
            asyncio.run(measure(server.url, args))
    else:
        with NatsCluster(3) as cluster:
            asyncio.run(measure(cluster.urls, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
