"""One shard in one process: its lease, and while held its controller and ingest.

On taking the lease (:class:`controller.leader.Leadership`'s ``on_elected``, before its
gate opens) the runner loads the state from KV into a store of its own (the previous
owner's decisions) and builds the shard's :class:`RegionController`, gated on the lease
as the HA leader's is.  Once the gate is open it starts the shard's ingest (durable
consumers shared by every owner, so the new one resumes at the acknowledged position;
what the dead owner had fetched but not acknowledged is redelivered by JetStream after
``ack_wait_s``) and publishes what the outbox holds for the shard's clusters.  When the
gate closes (the lease lost or not renewed) ingest stops and the controller with it; a
batch arriving meanwhile is refused (nak'ed, redelivered to the next owner), never
acknowledged undecided.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from nats.errors import Error as NatsError
from nats.js import JetStreamContext

from metalguard.controller.ingest.consumer import Ingest, IngestSettings
from metalguard.controller.leader import Leadership, Lease
from metalguard.controller.region import RegionController
from metalguard.controller.shards.plan import owns_event
from metalguard.controller.state.store import NodeStore
from metalguard.proto.events import NodeEvent
from metalguard.proto.subjects import Subjects
from metalguard.proto.telemetry import TelemetryBatch
from metalguard.runtime.deadlines import wait_event

log = logging.getLogger(__name__)

SYNC_RETRY_S = 1.0
"""After a failed start (or stop) of a shard's ingest, the next try."""

MakeController = Callable[[NodeStore, Callable[[], bool]], RegionController]
"""Builds a shard's controller over its store, gated on the given ``leading``."""


class NotOwnerError(RuntimeError):
    """A message reached a shard whose lease this process no longer holds."""


class GatedHandler:
    """The controller as ingest's handler, refusing work once the lease is gone (ingest
    then naks the message: the next owner decides it)."""

    def __init__(self, controller: RegionController, leading: Callable[[], bool]) -> None:
        self._controller = controller
        self._leading = leading

    def _check(self) -> None:
        if not self._leading():
            raise NotOwnerError("shard lease not held")

    async def on_batch(self, batch: TelemetryBatch, received_ts: float) -> None:
        self._check()
        await self._controller.on_batch(batch, received_ts)

    def on_batch_now(
        self, batch: TelemetryBatch, received_ts: float
    ) -> Callable[[], Awaitable[None]] | None:
        self._check()
        return self._controller.on_batch_now(batch, received_ts)

    async def on_node_event(self, event: NodeEvent, received_ts: float) -> None:
        self._check()
        await self._controller.on_node_event(event, received_ts)

    def on_intake(self, pending: int | None) -> None:
        self._controller.on_intake(pending)


class ShardRunner:
    """A shard's lease, and its controller and ingest while this process holds it."""

    def __init__(
        self,
        js: JetStreamContext,
        subjects: Subjects,
        name: str,
        clusters: tuple[str, ...],
        lease: Lease,
        make_controller: MakeController,
        settings: IngestSettings,
        *,
        silence_interval_s: float | None = 1.0,
        start_after_s: float = 0.0,
    ) -> None:
        self._js = js
        self._subjects = subjects
        self.name = name
        self.clusters = frozenset(clusters)
        self._make_controller = make_controller
        self.settings = settings
        self._silence_interval_s = silence_interval_s
        self._start_after_s = start_after_s
        self.leadership = Leadership(lease, on_elected=self._elected)
        self.controller: RegionController | None = None
        self.ingest: Ingest | None = None
        self._task: asyncio.Task[None] | None = None
        self.takeovers = 0
        """How many times this process started the shard's ingest."""

    @property
    def owning(self) -> bool:
        """Whether this process owns the shard now (lease held, ingest running)."""
        return self.ingest is not None and self.leadership.leading()

    async def start(self) -> None:
        """Keep the lease in the background (after ``start_after_s``: a shard of another
        process's home waits for its owner to take it first)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"shard:{self.name}")

    async def stop(self, release: bool = True) -> None:
        """:meth:`quiesce`, then (``release``) give the lease up: another process takes
        the shard at its next poll."""
        await self.quiesce()
        if release:
            await self.release()

    async def quiesce(self) -> None:
        """Stop competing for the lease and stop ingest and the controller (queued work
        finishes); the lease, if held, is kept until :meth:`release` or its TTL. A process
        stopping quiesces every shard first, so it does not take back, on one runner, a
        shard it has just released on another."""
        task, self._task = self._task, None
        if task is not None:
            while not task.done():  # again if an inner await swallowed the cancel
                task.cancel()
                await asyncio.wait({task}, timeout=1.0)
            with contextlib.suppress(asyncio.CancelledError, Exception):
                task.result()
        if self.leadership.leading():  # the gate open while queued work finishes
            await self._halt()
            await self.leadership.stop(release=False)
        else:
            await self.leadership.stop(release=False)
            await self._halt()

    async def release(self) -> None:
        """Give the lease up if it is held (delete the key: no wait for the TTL)."""
        if self.leadership.lease is not None:
            await self.leadership.lease.release()

    async def _run(self) -> None:
        if self._start_after_s > 0:
            await asyncio.sleep(self._start_after_s)
        await self.leadership.start()
        while True:
            changed = self.leadership.changed
            try:
                await self._sync()
            except (NatsError, TimeoutError) as exc:  # e.g. JetStream re-electing
                log.error("shard %s: %s; retried in %.1f s", self.name, exc, SYNC_RETRY_S)
            except Exception:  # a bug must not leave the shard owned and idle silently
                log.exception("shard %s: starting or stopping ingest failed", self.name)
            else:
                await changed.wait()
                continue
            await wait_event(changed, SYNC_RETRY_S)

    async def _sync(self) -> None:
        """Start ingest once the gate is open; stop it once it is closed."""
        if self.leadership.leading() and self.ingest is None and self.controller is not None:
            handler = GatedHandler(self.controller, self.leadership.leading)
            # a registry of its own each time: a start that failed (JetStream re-electing)
            # is tried again with a new Ingest, whose metrics must not collide
            ingest = Ingest(self._js, self._subjects, self.settings, handler)
            await ingest.start()
            self.ingest = ingest
            self.takeovers += 1
            log.info("shard %s owned: clusters %s", self.name, ", ".join(sorted(self.clusters)))
            await self.controller.flush()
        elif not self.leadership.leading() and self.ingest is not None:
            log.warning("shard %s lost: stopping its ingest", self.name)
            await self._halt()

    async def _elected(self) -> None:
        """The lease is taken: load the previous owner's state of the shard's clusters,
        build the controller. The load can outlast the lease's TTL (a large region): the
        lease is renewed meanwhile."""
        await self._halt()
        keeper = asyncio.create_task(self._keep_lease(), name=f"shard-load:{self.name}")
        try:
            owned = [(self.settings.region, c) for c in sorted(self.clusters)]
            store = await NodeStore.open(self._js, self._subjects, owned)  # its share only
        finally:
            keeper.cancel()
            await asyncio.wait({keeper})  # (a cancel of ours, meanwhile, is not swallowed)
        store.outbox = {k: e for k, e in store.outbox.items() if owns_event(e, self.clusters)}
        controller = self._make_controller(store, self.leadership.leading)
        await controller.start(silence_interval_s=self._silence_interval_s)
        self.controller = controller

    async def _keep_lease(self) -> None:
        """Renew the lease every ``renew_s`` (while the Leadership's own loop waits for
        :meth:`_elected`, so the two never step at once)."""
        lease = self.leadership.lease
        assert lease is not None
        while True:
            await asyncio.sleep(lease.timing.renew_s)
            await lease.step()

    async def _halt(self) -> None:
        ingest, self.ingest = self.ingest, None
        controller, self.controller = self.controller, None
        if ingest is not None:
            await ingest.stop()
        if controller is not None:
            await controller.stop()
