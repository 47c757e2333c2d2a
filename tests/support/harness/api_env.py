"""A real RegionController over the session nats-server, under a private prefix, for the
HTTP API and operator CLI tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import msgspec
from nats.aio.client import Client
from nats.js import JetStreamContext

from metalguard.controller.api.sse import NatsEventSource
from metalguard.controller.ingest.metrics import IngestMetrics
from metalguard.controller.region import RegionController
from metalguard.controller.state.store import NodeStore
from metalguard.proto.base import NodeIdentity
from metalguard.proto.subjects import Subjects
from metalguard.proto.telemetry import TelemetryBatch
from tests.support.clock import T0, ManualClock
from tests.support.scoring_helpers import dimm_mc

INTERVAL = 5.0
READ_TOKEN = "read-token-1"
ADMIN_TOKEN = "admin-token-1"


@dataclass
class ApiEnv:
    js: JetStreamContext
    subjects: Subjects
    controller: RegionController
    clock: ManualClock
    source: NatsEventSource
    metrics: IngestMetrics

    async def feed(self, *batches: TelemetryBatch) -> None:
        """Take batches in as ingest would, the clock following their time stamps."""
        for b in batches:
            self.clock.now = b.ts + 0.1
            await self.controller.on_batch(b, self.clock.now)

    async def set_rack(self, handle: str, rack: str) -> None:
        """Give a node a rack (the agent does not report racks yet)."""
        record = self.controller.store.records[handle]
        await self.controller.store.put_record(msgspec.structs.replace(record, rack=rack))


def batch(cluster: str, name: str, seq: int, ue: int = 0) -> TelemetryBatch:
    """A batch of ``r1.<cluster>.<name>`` at ``T0 + seq * INTERVAL`` with mc0's UE count."""
    return TelemetryBatch(
        node=NodeIdentity(region="r1", cluster=cluster, node=name),
        seq=seq,
        ts=T0 + seq * INTERVAL,
        interval_s=INTERVAL,
        edac=(dimm_mc(ue=ue),),
    )


FLEET = [batch("c1", n, 1) for n in ("n1", "n2", "n3")] + [batch("c2", "n1", 1)]
"""r1.c1.{n1,n2,n3} and r1.c2.n1: the bare name ``n1`` is ambiguous."""
FATAL = batch("c1", "n3", 2, ue=1)
"""Isolates r1.c1.n3 (uncorrectable ECC)."""


@asynccontextmanager
async def api_env(nc: Client, subjects: Subjects) -> AsyncIterator[ApiEnv]:
    """A controller for r1 over a private prefix's streams (the ``subjects`` fixture)."""
    js = nc.jetstream(timeout=5)
    clock = ManualClock()
    store = await NodeStore.open(js, subjects)
    controller = RegionController(js, store, subjects, "r1", clock=clock)
    await controller.start()
    try:
        yield ApiEnv(
            js,
            subjects,
            controller,
            clock,
            NatsEventSource(nc, subjects, "r1"),
            IngestMetrics(controller.metrics.registry),
        )
    finally:
        await controller.stop()
