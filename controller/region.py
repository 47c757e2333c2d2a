"""The region controller: scores batches, runs the lifecycle, persists, announces.

The decisions are :mod:`controller.decide` (pure); this class is the thin I/O around it
(docs/controller.md). Each round, under its cluster's lock:

1. decide against the cached state (:class:`controller.state.NodeStore`);
2. write the round's events to the outbox, then the changed records and rail state
   (compare-and-set; a conflict drops the outbox entries, reloads and decides again);
3. publish each event on ``<p>.ctl.<region>.<kind>`` with ``Nats-Msg-Id = event_id``,
   and delete it from the outbox once the stream has acknowledged it.

An event whose publish fails stays in the outbox and is retried by :meth:`flush`
(at start, and on every silence tick), so a crash between persisting and publishing
neither loses nor duplicates it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from array import array
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, TypeVar

import msgspec
from nats.errors import Error as NatsError
from nats.js import JetStreamContext

from metalguard.controller.core.congestion import CongestionTracker, CongestionView
from metalguard.controller.core.decide import (
    NodeInput,
    Outcome,
    batch_input,
    batch_step,
    decide,
    decide_operator,
    decide_running,
    decide_silence,
    decide_stragglers,
    decide_suspects,
    event_input,
    slurm_job_count,
)
from metalguard.controller.core.handles import ClusterKey
from metalguard.controller.core.lifecycle import LifecycleConfig, OperatorAction, silence_due_ts
from metalguard.controller.core.out_of_band import BmcWord, with_bmc
from metalguard.controller.core.receiving import STALL_GAP_S, Intake, heard, stalled
from metalguard.controller.core.scoring.config import DEFAULT_SCORING, ScoringConfig
from metalguard.controller.core.scoring.engine import Assessment, NodeSignals, ScoringMemo, assess
from metalguard.controller.core.silence_watch import SilenceWatch
from metalguard.controller.core.topology import TopologyView, with_topology
from metalguard.controller.decision_metrics import DecisionMetrics
from metalguard.controller.ingest.consumer import REUSED_SECTIONS
from metalguard.controller.round_queue import QueuedInput, RoundFailedError, take_group
from metalguard.controller.state.store import NodeStore, StoreConflictError
from metalguard.controller.stopping import cancel_within
from metalguard.proto.base import NodeIdentity, Reason
from metalguard.proto.codec import encode
from metalguard.proto.events import SLURM_JOBS_KIND, ControllerEvent, NodeEvent
from metalguard.proto.nodes import NodeRecord
from metalguard.proto.subjects import Subjects
from metalguard.proto.telemetry import QosInterfaceStatus, TelemetryBatch
from metalguard.runtime.deadlines import wait_event

log = logging.getLogger(__name__)
_T = TypeVar("_T")

STOP_WAIT_S = 10.0
"""How long :meth:`RegionController.stop` waits for its cancelled silence task."""

SCORE_POINTS_KEPT = 240
"""Score points remembered per node (the node page's chart)."""
SCORE_POINT_EVERY_S = 60.0
"""A steady score gets a point this often; a changed score at once."""
CONFLICT_RETRIES = 3
"""Rounds decided again after a compare-and-set conflict before giving up."""


def score_points(points: array[float] | None) -> list[list[float]]:
    """``[[time, score], ...]`` of a flat time, score, ... array."""
    if not points:
        return []
    return [[points[i], points[i + 1]] for i in range(0, len(points), 2)]


class RegionController:
    """Implements :class:`controller.ingest_api.IngestHandler` for one region.

    ``clock`` gives the controller's time (silence checks, operator actions); batches and
    events use the ``received_ts`` ingest passes.  Scoring history (``NodeSignals``) is
    persisted beside the records whenever a counter value changes, so a restart keeps
    rates and growth (a storm node does not look clean to a fresh controller).
    """

    def __init__(
        self,
        js: JetStreamContext,
        store: NodeStore,
        subjects: Subjects,
        region: str,
        lifecycle: LifecycleConfig | None = None,
        scoring: ScoringConfig = DEFAULT_SCORING,
        *,
        clock: Callable[[], float] = time.time,
        publish_timeout_s: float = 5.0,
        metrics: DecisionMetrics | None = None,
        owns: Callable[[str, str, str], bool] | None = None,
        liveness_write_s: float = 10.0,
        leading: Callable[[], bool] = lambda: True,
        topology: TopologyView | None = None,
    ) -> None:
        self._js = js
        self.store = store
        self._subjects = subjects
        self.region = region
        self._cfg = lifecycle or LifecycleConfig()
        self._scoring = scoring
        self._clock = clock
        self._publish_timeout_s = publish_timeout_s
        self.metrics = metrics or DecisionMetrics()
        self._owns = owns
        """Which nodes this process handles (``[ingest]`` clusters / shard): silence is
        judged for those only; another process's nodes look silent from here."""
        self._liveness_write_s = liveness_write_s
        self._leading = leading
        """The HA gate (controller/leader.py): a follower decides nothing, writes nothing
        to KV and publishes nothing; it keeps only its in-memory scoring history."""
        self._liveness_written_ts = clock()
        self._started_ts: float | None = None
        self._bmc: dict[str, BmcWord] = {}
        """The newest out-of-band batch of each node, by handle."""
        self._qos: dict[str, tuple[QosInterfaceStatus, ...]] = {}
        """The QoS verdicts of each node's newest batch, by handle."""
        self.congestion = CongestionTracker()
        """Pause frames and RDMA transmit waits per cluster (``GET /v1/qos``): the fabric's
        congestion, kept beside the score, never in it."""
        self._scores: dict[str, array[float]] = {}
        """Recent score points of each node, for the node page (in memory): time, score,
        time, score... (a flat array of doubles: 16 bytes a point)."""
        self._signals: dict[str, NodeSignals] = {}
        self._memos: dict[str, ScoringMemo] = {}
        """Each node's scoring memo (reuse of unchanged sections' rule outputs)."""
        self._locks: dict[ClusterKey, asyncio.Lock] = {}
        self._queued: dict[ClusterKey, list[QueuedInput]] = {}
        """Inputs waiting for their cluster's next round (controller/round_queue.py)."""
        self._flush_lock = asyncio.Lock()
        self._in_flight: set[str] = set()
        """Event ids a round is publishing itself: the outbox flush leaves them to it (else a
        core subscriber could see one event twice; the control stream drops the copy anyway)."""
        self._watch = SilenceWatch()
        """The nodes by the time their silence may be due (check_silence looks at those)."""
        self._watched_records: object = None
        """The records mapping the watch was built from (a new one: rebuilt)."""
        self._intake = Intake()
        """Evidence of this process's own intake (docs/lifecycle.md, "Receiving time"):
        silence is judged over receiving time only."""
        self._gap_logged: float | None = None
        self._silence_task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self.topology = topology or TopologyView()
        """Each node's place and capacity, for the scheduler (docs/scheduler.md)."""

    # --- IngestHandler ------------------------------------------------------------------

    async def on_batch(self, batch: TelemetryBatch, received_ts: float) -> None:
        """Score a batch and take it into its node's lifecycle; an out-of-band batch (a
        bmc-proxy's) is kept for the node's next batch and its silence check instead."""
        rest = self.on_batch_now(batch, received_ts)
        if rest is not None:
            await rest()

    def on_batch_now(
        self, batch: TelemetryBatch, received_ts: float
    ) -> Callable[[], Awaitable[None]] | None:
        """:meth:`on_batch` up to its first I/O, without awaiting: None when that was all
        (a steady node's batch: scored, liveness cached), else what is left to await,
        before the node's next message (ingest calls this inline for a node with nothing
        queued, see controller/ingest.py)."""
        if not self._ours(batch.node):
            return None
        handle = batch.node.handle
        if batch.out_of_band:
            self._bmc[handle] = BmcWord(received_ts, batch)
            return None
        self.topology.observe(handle, batch)
        resolved = self.topology.topology(handle, batch.node)
        rack = resolved.rack  # the record's rack
        batch = with_bmc(batch, self._bmc.get(handle), received_ts)
        batch = with_topology(batch, resolved)  # the rules read the resolved topology
        self._qos[handle] = batch.qos
        self.congestion.observe(batch, received_ts)
        previous = self._signals.get(handle)
        # The history as loaded (at start, or by a reload on taking the lease) is taken
        # over from the store: held once. This process's own is newer, when it has one.
        loaded = self.store.signals.pop(handle, None) if self.store.signals else None
        if previous is None:
            previous = loaded
        memo = self._memos.get(handle)
        if memo is None:
            memo = self._memos[handle] = ScoringMemo(REUSED_SECTIONS)
        signals, assessment = assess(previous, batch, self._scoring, memo)
        self._signals[handle] = signals
        self._keep_score(handle, received_ts, assessment.score)
        persist = assessment.history_changed and self._leading()
        if not persist and self._steady_now(handle, batch, assessment, received_ts, rack):
            return None

        async def decided() -> None:
            if await self._steady(handle, batch, assessment, received_ts, rack):
                return
            item = batch_input(batch, assessment, received_ts, rack)
            await self._round_input(batch.node, lambda: item, received_ts)

        async def rest() -> None:
            if not persist:
                await decided()
                return
            # The history's write in flight with the decision's round (a round trip fewer
            # for a fault); the batch is acknowledged once both are written.
            results = await asyncio.gather(
                self.store.put_signals(handle, signals), decided(), return_exceptions=True
            )
            for result in results:
                if isinstance(result, BaseException):
                    raise result

        return rest

    def _steady_now(
        self,
        handle: str,
        batch: TelemetryBatch,
        assessment: Assessment,
        received_ts: float,
        rack: str,
    ) -> bool:
        """:meth:`_steady` when it needs no wait: the cluster's lock is free (taking and
        releasing it with no await between is not taking it at all)."""
        record = self.store.records.get(handle)
        after = batch_step(record, batch, assessment, received_ts, rack)
        if not isinstance(after, NodeRecord) or not self._leading():
            return False
        if self._lock((batch.node.region, batch.node.cluster)).locked():
            return False
        return self.store.put_liveness(after)

    async def _steady(
        self,
        handle: str,
        batch: TelemetryBatch,
        assessment: Assessment,
        received_ts: float,
        rack: str,
    ) -> bool:
        """Take in a steady healthy node's batch without a round (controller.decide.steady:
        only its liveness changes, written lazily); False when a round must decide."""
        if self._steady_now(handle, batch, assessment, received_ts, rack):
            return True
        record = self.store.records.get(handle)
        after = batch_step(record, batch, assessment, received_ts, rack)
        if not isinstance(after, NodeRecord) or not self._leading():
            return False
        async with self._lock((batch.node.region, batch.node.cluster)):
            if self.store.records.get(handle) is not record:
                return False  # changed while waiting for the lock: decide in full
            await self.store.put_record(after)
        return True

    async def on_node_event(self, event: NodeEvent, received_ts: float) -> None:
        """Act on a fatal NodeEvent at once, as a fatal assessment; take the Slurm bridge's
        ``slurm_jobs`` in as the node's count of Slurm jobs (other kinds: ignored)."""
        if not self._ours(event.node):
            return
        if event.kind == SLURM_JOBS_KIND:
            await self.report_slurm_jobs(event, received_ts)
            return

        def make() -> NodeInput | None:
            return event_input(event, self.store.records.get(event.node.handle), received_ts)

        await self._round_input(event.node, make, received_ts)

    def on_intake(self, pending: int | None) -> None:
        """Ingest's word that its intake is live now (a fetch brought messages, or the
        broker answered a consumer probe), with the telemetry consumer's count of messages
        still pending (None: not known). See :mod:`controller.core.receiving`."""
        ts = self._clock()
        before = self._intake
        after = self._intake = heard(before, ts, pending)
        if after.stalled_since is not None and before.stalled_since is None:
            log.warning(
                "intake back after %.1f s stalled; silence is judged again once the "
                "backlog is in (%s pending)",
                ts - after.stalled_since,
                "?" if pending is None else pending,
            )
        elif after.stalls and after.stalls[-1:] != before.stalls[-1:]:
            start, end = after.stalls[-1]
            log.warning(
                "intake live again: %.1f s stalled (backlog included), not counted as any "
                "node's silence",
                end - start,
            )

    @property
    def intake(self) -> Intake:
        """What this process knows of its own intake: stalls, backlog (read-only)."""
        return self._intake

    def recent_signals(self, handle: str) -> NodeSignals | None:
        """A node's scoring history: counter samples behind its rates (for the API)."""
        return self._signals.get(handle) or self.store.signals.get(handle)

    def _keep_score(self, handle: str, ts: float, score: float) -> None:
        """Remember the score for the node page's chart: a point when it changes, else
        one every SCORE_POINT_EVERY_S (so a steady node costs a few points)."""
        points = self._scores.get(handle)
        if points is None:
            self._scores[handle] = array("d", (ts, score))
            return
        if points[-1] == score and ts - points[-2] < SCORE_POINT_EVERY_S:
            return
        points.append(ts)
        points.append(score)
        if len(points) > 2 * SCORE_POINTS_KEPT:
            del points[:2]

    def congestion_view(self) -> CongestionView:
        """Each cluster's congestion now (docs/qos.md, "Congestion per cluster")."""
        return self.congestion.view(self._clock())

    def warm_datasets(self, handle: str) -> frozenset[str]:
        """The datasets warm on the node as of its newest batch (for the API)."""
        return self.topology.warm_datasets(handle)

    def recent_readings(self, handle: str) -> dict[str, Any]:
        """What the node page shows beside the record: the QoS verdicts of the node's
        newest batch and its BMC's newest out-of-band word (empty when none)."""
        out: dict[str, Any] = {
            "qos": [msgspec.to_builtins(q) for q in self._qos.get(handle, ())],
            "scores": score_points(self._scores.get(handle)),
        }
        word = self._bmc.get(handle)
        if word is not None:
            out["bmc"] = {
                "received_ts": word.received_ts,
                "power_on": word.power_on,
                "health": word.health,
                "readings": msgspec.to_builtins(word.batch.bmc),
            }
        return out

    # --- operators and time ---------------------------------------------------------------

    async def operator_action(
        self, handle: str, action: OperatorAction, reason: str, who: str
    ) -> tuple[ControllerEvent, ...]:
        """An operator's cordon, uncordon or maintenance; the events it announced."""
        received = self._clock()
        record = self.store.records.get(handle)
        if record is None:
            raise KeyError(f"unknown node {handle!r}")

        def round_() -> Outcome:
            current = self.store.records[handle]
            return decide_operator(current, action, reason, who, self._clock(), self._cfg)

        return await self._round(record.node, round_, received)

    async def report_running(self, counts: Mapping[str, int]) -> tuple[ControllerEvent, ...]:
        """The job manager's count of unfinished job members per node (by handle): one
        round per cluster, under its lock (a SUB_HEALTHY node whose last job ended enters
        MAINTENANCE); the events announced. Nodes the store does not know are skipped."""
        records = self.store.records
        changed = {
            h: n
            for h, n in counts.items()
            if (r := records.get(h)) is not None and r.running_jobs != n
        }
        return await self._rounds_by_cluster(
            changed, lambda g: decide_running(self.store.records, g, self._clock(), self._cfg)
        )

    async def report_slurm_jobs(
        self, event: NodeEvent, received_ts: float
    ) -> tuple[ControllerEvent, ...]:
        """The Slurm bridge's count of a node's active Slurm jobs (a ``slurm_jobs``
        NodeEvent): a round under the node's cluster lock, as :meth:`report_running` (a
        SUB_HEALTHY node whose last job ended enters MAINTENANCE); the events announced.
        A node the store does not know is skipped; a count that is not an integer >= 0 is
        logged and dropped (the bridge sends the node's count again when it changes)."""
        handle = event.node.handle
        count = slurm_job_count(event)
        if count is None:
            log.warning(
                "ignoring %s event %s of %s: its 'running' attribute is %r, not a count of "
                "jobs (an integer >= 0)",
                event.kind,
                event.event_id,
                handle,
                event.attributes.get("running"),
            )
            return ()
        record = self.store.records.get(handle)
        if record is None or record.slurm_jobs == count:
            return ()
        tag = f"e{event.event_id}"

        def decide_group(group: dict[str, int]) -> Outcome:
            records = self.store.records
            return decide_running(records, group, received_ts, self._cfg, source="slurm", tag=tag)

        return await self._rounds_by_cluster({handle: count}, decide_group)

    async def report_suspects(
        self, suspects: Mapping[str, tuple[str, ...]], until: float
    ) -> tuple[ControllerEvent, ...]:
        """The job manager's blame (node handle → the jobs whose failures point at it):
        one round per cluster; a HEALTHY node becomes SUB_HEALTHY until ``until``."""
        return await self._rounds_by_cluster(
            suspects,
            lambda g: decide_suspects(self.store.records, g, until, self._clock(), self._cfg),
        )

    async def report_stragglers(
        self, stragglers: Mapping[str, Reason], until: float
    ) -> tuple[ControllerEvent, ...]:
        """The job manager's straggler marks (node handle → the evidence): one round per
        cluster; a HEALTHY node becomes SUB_HEALTHY until ``until``."""
        return await self._rounds_by_cluster(
            stragglers,
            lambda g: decide_stragglers(self.store.records, g, until, self._clock(), self._cfg),
        )

    async def _rounds_by_cluster(
        self, inputs: Mapping[str, _T], decide_group: Callable[[dict[str, _T]], Outcome]
    ) -> tuple[ControllerEvent, ...]:
        """One round per cluster of the known nodes among ``inputs`` (by handle), each
        deciding its group under the cluster's lock; the events announced."""
        received = self._clock()
        by_cluster: dict[ClusterKey, dict[str, _T]] = {}
        for handle, value in inputs.items():
            record = self.store.records.get(handle)
            if record is not None:
                key = (record.node.region, record.node.cluster)
                by_cluster.setdefault(key, {})[handle] = value
        announced: list[ControllerEvent] = []
        for group in by_cluster.values():
            node = self.store.records[next(iter(group))].node
            announced += await self._round(node, functools.partial(decide_group, group), received)
        return tuple(announced)

    async def check_silence(self) -> tuple[ControllerEvent, ...]:
        """One pass: every silent in-service node becomes UNREACHABLE. Only the nodes
        whose silence may be due are looked at (controller/core/silence_watch.py)."""
        announced: list[ControllerEvent] = []
        received = self._clock()
        self._watch_changes()
        due = self._watch.pop_due(received)
        try:
            candidates = {h: r for h in due if (r := self.store.records.get(h)) is not None}
            silent = self._decide_silence(candidates, received)
            for handle in silent.records:
                node = self.store.records[handle].node

                def round_(h: str = handle) -> Outcome:
                    record = self.store.records.get(h)
                    return self._decide_silence({h: record} if record else {}, self._clock())

                announced += await self._round(node, round_, received)
        finally:
            self._rewatch(due, received)
        return tuple(announced)

    def _watch_changes(self) -> None:
        """Take the store's changed records into the silence watch (all of them when the
        store's records were replaced: a reload, or the API's index installed)."""
        store = self.store
        if store.records is not self._watched_records:
            self._watched_records = store.records
            self._watch = SilenceWatch()
            store.take_changed()  # all of them are watched now
            self._rewatch(store.records, None)
            return
        self._rewatch(store.take_changed(), None)

    def _rewatch(self, handles: Iterable[str], now: float | None) -> None:
        self._watch.rewatch(handles, self.store.records, self._silence_due, now)

    def _silence_due(self, record: NodeRecord) -> float | None:
        """When this node's silence may be due (None: never, or not this process's)."""
        node = record.node
        if self._owns is not None and not self._owns(node.region, node.cluster, node.node):
            return None
        return silence_due_ts(record, self._cfg, self._started_ts)

    # --- lifetime -------------------------------------------------------------------------

    async def start(self, silence_interval_s: float | None = None) -> None:
        """Publish what a previous run left in the outbox; start the silence checks
        (silence is counted from now at the earliest)."""
        if self._started_ts is None:
            self._started_ts = self._clock()
        await self.flush()
        if silence_interval_s is not None and self._silence_task is None:
            self._stop.clear()
            self._silence_task = asyncio.create_task(
                self._silence_loop(silence_interval_s), name="region-silence"
            )

    async def stop(self) -> None:
        """Stop the silence checks and write the liveness not yet written (idempotent)."""
        self._stop.set()
        task, self._silence_task = self._silence_task, None
        if task is not None:
            await cancel_within([task], STOP_WAIT_S, "region controller stop")
        try:
            await self.flush_liveness()
        except NatsError as exc:
            log.warning("liveness of %d nodes not written: %s", len(self.store.unwritten), exc)

    async def flush_liveness(self) -> int:
        """Write the records whose last batch changed only their liveness (last seen, seq),
        each under its cluster's lock; how many were written."""
        if not self._leading():
            return 0
        by_cluster: dict[ClusterKey, list[str]] = {}
        for handle in self.store.unwritten:
            record = self.store.records.get(handle)
            if record is not None:
                by_cluster.setdefault((record.node.region, record.node.cluster), []).append(handle)
        written = 0
        for key, handles in sorted(by_cluster.items()):
            async with self._lock(key):
                written += await self.store.flush_liveness(handles)
        return written

    async def flush(self) -> int:
        """Publish every pending event in the outbox; how many remain pending."""
        if not self._leading():
            return len(self.store.outbox)
        async with self._flush_lock:
            for event in sorted(self.store.outbox.values(), key=lambda e: (e.ts, e.event_id)):
                if event.event_id not in self._in_flight:  # its round publishes it
                    await self._publish(event)
            return len(self.store.outbox)

    # --- internals ------------------------------------------------------------------------

    def _ours(self, node: NodeIdentity) -> bool:
        if node.region == self.region:
            return True
        log.warning("ignoring %s: not in region %s", node.handle, self.region)
        return False

    async def _round_input(
        self, node: NodeIdentity, make: Callable[[], NodeInput | None], received_ts: float
    ) -> None:
        """Decide one node's input in its cluster's next round (controller/round_queue.py:
        the inputs queued for a cluster are decided, persisted and published together by
        whichever of their callers gets the cluster's lock first)."""
        if not self._leading():
            return
        key = (node.region, node.cluster)
        queue = self._queued.setdefault(key, [])
        mine = QueuedInput(node.handle, make, received_ts)
        queue.append(mine)
        owned: set[str] = set()
        published: list[str] = []
        try:
            async with self._lock(key):
                if not mine.settled:
                    group = take_group(queue)
                    self.metrics.observe_round(len(group))
                    try:
                        _, published = await self._commit(
                            lambda: self._decide_group(key, group), _received(group), owned
                        )
                    except BaseException as exc:  # this caller raises the round's own error
                        for entry in group:
                            if entry is not mine:
                                entry.error = RoundFailedError(f"the round of {len(group)} failed")
                                entry.error.__cause__ = exc
                        raise
                    finally:
                        for entry in group:
                            entry.settled = True
            await self.store.remove_all_pending(published)  # out of the lock (see _round)
        finally:
            self._in_flight -= owned
            if not mine.settled and mine in queue:
                queue.remove(mine)  # cancelled while waiting
        if mine.error is not None:
            raise mine.error

    def _decide_group(self, key: ClusterKey, group: list[QueuedInput]) -> Outcome:
        inputs = [item for entry in group if (item := entry.make()) is not None]
        if not inputs:
            return Outcome()
        sizes = {key: self.store.cluster_size(*key)}
        now = max(entry.received_ts for entry in group)
        return decide(self.store.records, self.store.rails, inputs, now, self._cfg, sizes)

    async def _round(
        self, node: NodeIdentity, round_: Callable[[], Outcome], received_ts: float
    ) -> tuple[ControllerEvent, ...]:
        """Decide, persist, publish, under the cluster's lock; the events announced
        (each one's latency from ``received_ts`` observed once the stream has it)."""
        if not self._leading():
            return ()
        owned: set[str] = set()
        try:
            async with self._lock((node.region, node.cluster)):
                outcome, published = await self._commit(round_, lambda _: received_ts, owned)
            # Out of the lock: the cluster's next round need not wait for these deletes
            # (an entry left by a crash here is published again at start, a duplicate
            # the control stream drops).
            await self.store.remove_all_pending(published)
        finally:
            self._in_flight -= owned
        return outcome.events

    async def _commit(
        self,
        round_: Callable[[], Outcome],
        received_of: Callable[[ControllerEvent], float],
        owned: set[str],
    ) -> tuple[Outcome, list[str]]:
        """Decide, persist, publish (the caller holds the cluster's lock); the outcome and
        the ids of the events published. ``owned`` collects the ids this round publishes
        itself (:attr:`_in_flight`, which the caller clears once they are deleted)."""
        for attempt in range(CONFLICT_RETRIES + 1):
            outcome = round_()
            ids = {event.event_id for event in outcome.events}
            owned |= ids
            self._in_flight |= ids
            try:
                await self._persist(outcome)
            except StoreConflictError as exc:
                await self.store.remove_all_pending(ids)
                self._in_flight -= ids
                owned -= ids
                if attempt == CONFLICT_RETRIES:
                    raise
                log.warning("%s; deciding again", exc)
                continue
            return outcome, await self._publish_all(outcome.events, received_of)
        raise AssertionError("unreachable")

    def _decide_silence(self, records: Mapping[str, NodeRecord], now: float) -> Outcome:
        if self._owns is not None:
            owns = self._owns
            records = {
                h: r for h, r in records.items() if owns(r.node.region, r.node.cluster, r.node.node)
            }
        fresh = {h: w for h, w in self._bmc.items() if h in records and w.fresh(now)}
        power = {h: on for h, w in fresh.items() if (on := w.power_on) is not None}
        stalls = stalled(self._intake, now)
        self._log_gap(now)
        return decide_silence(
            records,
            now,
            self._cfg,
            watching_since=self._started_ts,
            bmc_power_on=power,
            bmc_health={h: w.health for h, w in fresh.items() if w.health},
            stalls=stalls,
        )

    def _log_gap(self, now: float) -> None:
        """Say once per gap that the intake has gone quiet (no silence judged over it)."""
        last = self._intake.heard_ts
        if last is None or self._intake.catching_up or self._gap_logged == last:
            return
        if now - last > STALL_GAP_S:
            self._gap_logged = last
            log.warning(
                "no intake for %.1f s (broker or connection stalled?): that time does not "
                "count as any node's silence",
                now - last,
            )

    def _lock(self, key: ClusterKey) -> asyncio.Lock:
        return self._locks.setdefault(key, asyncio.Lock())

    async def _persist(self, outcome: Outcome) -> None:
        """The outbox first (every event promised before the state that implies it), then
        the records, in flight together, then the rails: a rail counts isolations only
        once every record that makes them is written (docs/controller.md)."""
        await self.store.add_pending(outcome.events)
        await self.store.put_records(outcome.records.values())
        for state in outcome.rails.values():
            await self.store.put_rail(state)

    async def _publish_all(
        self, events: tuple[ControllerEvent, ...], received_of: Callable[[ControllerEvent], float]
    ) -> list[str]:
        """Publish a round's events together (in order on the one connection), each
        one's latency observed; the ids the stream acknowledged."""
        if not events:
            return []
        sent = await asyncio.gather(*(self._publish(event, drop=False) for event in events))
        now = self._clock()
        published: list[str] = []
        for event, ok in zip(events, sent, strict=True):
            if ok:
                self.metrics.observe(event.kind, now - received_of(event))
                published.append(event.event_id)
        return published

    async def _publish(self, event: ControllerEvent, *, drop: bool = True) -> bool:
        """Publish one event with its id as message id; once acked, drop it from the
        outbox (unless ``drop`` is false: the caller does). Whether it was published now."""
        if event.event_id not in self.store.outbox:
            return False
        subject = self._subjects.control(event.region, event.kind)
        try:
            await self._js.publish(
                subject,
                encode(event),
                timeout=self._publish_timeout_s,
                headers={"Nats-Msg-Id": event.event_id},
            )
        except (NatsError, TimeoutError) as exc:
            log.warning("publish of %s failed, kept in the outbox: %s", event.event_id, exc)
            return False
        log.info("%s %s", event.kind, event.event_id)
        if drop:
            await self.store.remove_pending(event.event_id)
        return True

    async def _silence_loop(self, interval_s: float) -> None:
        while not self._stop.is_set():
            await wait_event(self._stop, interval_s)
            if self._stop.is_set():
                return
            if not self._leading():
                self._started_ts = None  # a new leader counts silence from its takeover
                continue
            if self._started_ts is None:
                self._started_ts = self._clock()
            try:
                await self.flush()
                await self.check_silence()
                if self._clock() - self._liveness_written_ts >= self._liveness_write_s:
                    self._liveness_written_ts = self._clock()
                    await self.flush_liveness()
            except (NatsError, StoreConflictError) as exc:
                log.error("silence check failed, retried next tick: %s", exc)
            except Exception:  # a bug must not end the checks silently
                log.exception("silence check failed, retried next tick")


def _received(group: list[QueuedInput]) -> Callable[[ControllerEvent], float]:
    """An event's receiving time: its node's input's, else (a cluster's alert) the
    round's earliest."""
    by_handle = {entry.handle: entry.received_ts for entry in group}
    first = min(by_handle.values())

    def received(event: ControllerEvent) -> float:
        node = event.node
        return by_handle.get(node.handle, first) if node is not None else first

    return received
