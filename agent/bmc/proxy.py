"""The bmc-proxy: one management host reads many BMCs and publishes for their nodes.

Every ``interval_s`` the proxy reads all its ``[[bmc]]`` targets, at most
``concurrency`` at a time, and publishes each reading as soon as it is in: a
TelemetryBatch on **the target node's** telemetry subject, ``out_of_band=True``, ``bmc``
holding the one reading (docs/bmc.md).  Out-of-band batches have their own ``seq``
series per node (the proxy's start time in ms, plus one per batch) and their own message
id (``REGION.CLUSTER.NODE:oob:SEQ``), so they never collide with the node's own batches
in the stream's duplicate window.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from metalguard.agent.backoff import Backoff, guarded_task
from metalguard.agent.bmc.commands import REMEDIABLE, BmcCommandService
from metalguard.agent.bmc.remediation import Remediator
from metalguard.agent.bmc.snmp import SnmpReader, ThreadedSnmpReader
from metalguard.agent.bmc.targets import BmcReader, BmcTarget, read_target
from metalguard.agent.config import AgentConfig
from metalguard.agent.publisher import Publisher, publisher_settings
from metalguard.agent.spool import Spool
from metalguard.proto.base import NodeIdentity
from metalguard.proto.subjects import Subjects
from metalguard.proto.telemetry import BmcReading, TelemetryBatch
from metalguard.runtime.deadlines import wait_event

log = logging.getLogger(__name__)

Publish = Callable[[TelemetryBatch], Awaitable[None]]
SPOOL_SUBDIR = "bmc-queue"


def oob_msg_id(batch: TelemetryBatch) -> str:
    """The JetStream message id of an out-of-band batch (apart from the node's own)."""
    return f"{batch.node.handle}:oob:{batch.seq}"


def reading_batch(
    target: BmcTarget,
    reading: BmcReading,
    *,
    seq: int,
    ts: float,
    started_ts: float,
    interval_s: float,
) -> TelemetryBatch:
    """The out-of-band batch that carries one target's reading (pure)."""
    region, cluster, node = target.region_cluster_node()
    return TelemetryBatch(
        node=NodeIdentity(region=region, cluster=cluster, node=node),
        seq=seq,
        ts=ts,
        started_ts=started_ts,
        interval_s=interval_s,
        bmc=(reading,),
        out_of_band=True,
    )


class OutOfBandPublisher(Publisher):
    """A Publisher whose out-of-band batches use :func:`oob_msg_id`."""

    async def publish_batch(self, batch: TelemetryBatch) -> None:
        """Queue a batch; an out-of-band one under its own message id."""
        if not batch.out_of_band:
            await super().publish_batch(batch)
            return
        self._queue_batch(batch, oob_msg_id(batch))


class TargetReader:
    """Reads any target: snmp through one shared engine, the others through
    :func:`read_target`; :meth:`close` releases the engine.

    ``threaded``: the SNMP engine runs on its own thread (the bmc-proxy), so that its
    CPU-bound decoding never holds up the caller's event loop.
    """

    def __init__(self, *, threaded: bool = False) -> None:
        self._threaded = threaded
        self._snmp: SnmpReader | ThreadedSnmpReader | None = None

    async def __call__(self, target: BmcTarget) -> BmcReading:
        """Read one target (never raises for the BMC's failure)."""
        if target.protocol != "snmp":
            return await read_target(target)
        if self._snmp is None:
            self._snmp = ThreadedSnmpReader() if self._threaded else SnmpReader()
        return await self._snmp(target)

    def close(self) -> None:
        """Release the SNMP engine, if one was made."""
        if self._snmp is not None:
            self._snmp.close()
            self._snmp = None


async def read_targets(targets: Iterable[BmcTarget], concurrency: int) -> list[BmcReading]:
    """Read every target once, at most ``concurrency`` at a time, in the given order."""
    limit = asyncio.Semaphore(concurrency)
    reader = TargetReader()

    async def one(target: BmcTarget) -> BmcReading:
        async with limit:
            return await reader(target)

    try:
        return list(await asyncio.gather(*(one(t) for t in targets)))
    finally:
        reader.close()


@dataclass(slots=True)
class ProxyStats:
    """Counters since the proxy started."""

    cycles: int = 0
    reads: int = 0
    unreachable: int = 0
    max_in_flight: int = 0
    last_cycle_s: float = 0.0


class BmcProxy:
    """Polls targets with bounded concurrency and publishes one batch per reading."""

    def __init__(
        self,
        targets: Iterable[BmcTarget],
        publish: Publish,
        *,
        interval_s: float = 30.0,
        concurrency: int = 32,
        reader: BmcReader | None = None,
        wall_clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        """``reader`` defaults to one shared SNMP engine for snmp targets and
        :func:`read_target` for the other protocols."""
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.targets = tuple(targets)
        self.interval_s = interval_s
        self.stats = ProxyStats()
        self._publish = publish
        self._limit = asyncio.Semaphore(concurrency)
        self._own_reader: TargetReader | None = None
        if reader is None:
            reader = self._own_reader = TargetReader(threaded=True)
        self._reader: BmcReader = reader
        self._wall = wall_clock
        self._mono = monotonic
        self._seq_base = int(wall_clock() * 1000)
        self._sent: dict[str, int] = {}
        self._in_flight = 0
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def set_targets(self, targets: Iterable[BmcTarget]) -> None:
        """Poll these targets from the next cycle on (config reload)."""
        self.targets = tuple(targets)

    def next_seq(self, node: str) -> int:
        """The next seq of ``node``'s out-of-band series."""
        sent = self._sent.get(node, 0) + 1
        self._sent[node] = sent
        return self._seq_base + sent

    async def _poll_target(self, target: BmcTarget) -> BmcReading:
        async with self._limit:
            self._in_flight += 1
            self.stats.max_in_flight = max(self.stats.max_in_flight, self._in_flight)
            started = self._wall()
            try:
                reading = await self._reader(target)
            except Exception as exc:  # a custom reader's bug: still a reading
                reading = BmcReading(
                    node=target.node,
                    source=target.protocol,
                    reachable=False,
                    message=f"{type(exc).__name__}: {exc}",
                )
            finally:
                self._in_flight -= 1
        self.stats.reads += 1
        self.stats.unreachable += not reading.reachable
        batch = reading_batch(
            target,
            reading,
            seq=self.next_seq(target.node),
            ts=self._wall(),
            started_ts=started,
            interval_s=self.interval_s,
        )
        await self._publish(batch)
        return reading

    async def poll_once(self) -> list[BmcReading]:
        """Read every target once (bounded concurrency), publishing each as it lands."""
        started = self._mono()
        readings = await asyncio.gather(*(self._poll_target(t) for t in self.targets))
        self.stats.cycles += 1
        self.stats.last_cycle_s = self._mono() - started
        return list(readings)

    async def run(self) -> None:
        """Poll every ``interval_s`` until :meth:`stop`."""
        while not self._stop.is_set():
            started = self._mono()
            await self.poll_once()
            log.debug("bmc-proxy: %d targets in %.2fs", len(self.targets), self.stats.last_cycle_s)
            left = self.interval_s - (self._mono() - started)
            await wait_event(self._stop, max(left, 0.0))

    def start(self) -> None:
        """Run in a guarded background task."""
        self._task = guarded_task(
            "bmc-proxy", self.run, backoff=Backoff(1.0, max(self.interval_s, 1.0))
        )

    def stop(self) -> None:
        """Stop after the current cycle."""
        self._stop.set()

    async def close(self) -> None:
        """Stop, cancel a cycle in progress, release the SNMP engine."""
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._own_reader is not None:
            await asyncio.to_thread(self._own_reader.close)  # joins the SNMP thread


REMEDIATION_LOG = "bmc-remediation.jsonl"
"""Under ``spool.dir``: the outcomes of BMC commands, so a restart never acts twice."""


def proxy_publisher(config: AgentConfig, name: str) -> OutOfBandPublisher:
    """The proxy's own publisher: its own connection and spool (``<spool.dir>/bmc-queue``)."""
    nats = config.nats
    spool = Spool(Path(config.spool.dir) / SPOOL_SUBDIR, max_bytes=config.spool.max_bytes)
    return OutOfBandPublisher(
        publisher_settings(nats, f"metalguard-bmc-proxy-{name}"),
        subjects=Subjects(nats.prefix),
        spool=spool,
    )


class ProxyService:
    """The bmc-proxy of ``agent run``: a BmcProxy and its publisher, started together."""

    def __init__(self, config: AgentConfig, name: str) -> None:
        self.publisher = proxy_publisher(config, name)
        self.proxy = BmcProxy(
            config.bmc,
            self.publisher.publish_batch,
            interval_s=config.bmc_proxy.interval_s,
            concurrency=config.bmc_proxy.concurrency,
        )
        self.commands: BmcCommandService | None = None
        if any(t.protocol in REMEDIABLE for t in config.bmc):
            store = Path(config.spool.dir) / REMEDIATION_LOG
            self.commands = BmcCommandService(
                config.bmc,
                Remediator(store=store),
                self.publisher.connection.settings,
                Subjects(config.nats.prefix),
            )
        self._commands_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Connect (in the background if NATS is down), start polling and, for Redfish
        and IPMI targets, answering the BMC remediation verbs (agent/bmc/commands.py)."""
        await self.publisher.start()
        self.proxy.start()
        if self.commands is not None:
            await self.commands.start()
            self._commands_task = asyncio.create_task(self.commands.run(), name="bmc-commands")

    def reload(self, config: AgentConfig) -> None:
        """Take the new ``[[bmc]]`` list (interval and concurrency need a restart)."""
        self.proxy.set_targets(config.bmc)

    async def close(self, flush_timeout: float) -> None:
        """Stop polling and answering, flush or spool what is queued, disconnect."""
        if self._commands_task is not None:
            self._commands_task.cancel()
            await asyncio.gather(self._commands_task, return_exceptions=True)
        if self.commands is not None:
            await self.commands.close()
        await self.proxy.close()
        await self.publisher.close(flush_timeout=flush_timeout)
