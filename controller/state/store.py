"""The region controller's durable state: KV ``<P>_NODES`` (docs/controller.md).

One bucket holds three kinds of value, told apart by their message type (not the key):

- ``<region>.<cluster>.<node>`` (the node handle): its :class:`NodeRecord`;
- ``_rail.<region>.<cluster>``: that cluster's :class:`RailState`;
- ``_outbox.<sha1 of event id>``: a :class:`ControllerEvent` decided and persisted but not
  yet acknowledged by the ``<P>_CONTROL`` stream (deleted once it is);
- ``_signals.<handle>``: the node's scoring history (:class:`NodeSignals`, msgpack), written
  when a counter value changes, so a restarted controller keeps its rates and growth.

Writes are compare-and-set on the revision this store last saw for the key. A conflict
(another writer got there first) re-reads that key into the cache and raises
:class:`StoreConflictError`, so the caller recomputes its decision from the fresh value;
a conflict with our own earlier write (its reply lost in a timeout) is a success.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import Counter
from collections.abc import Coroutine, Iterable
from typing import Any

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from metalguard.controller.core.handles import ClusterKey
from metalguard.controller.core.scoring.signals import NodeSignals
from metalguard.controller.state.kv_keys import latest_values
from metalguard.proto.codec import CodecError, decode, encode
from metalguard.proto.events import ControllerEvent
from metalguard.proto.nodes import NodeRecord, RailState
from metalguard.proto.subjects import Subjects

log = logging.getLogger(__name__)
_signals_decoder = msgspec.msgpack.Decoder(NodeSignals)
_signals_encoder = msgspec.msgpack.Encoder()

RAIL_PREFIX = "_rail."
OUTBOX_PREFIX = "_outbox."
SIGNALS_PREFIX = "_signals."


class StoreConflictError(Exception):
    """A compare-and-set write lost to another writer; the cache now holds its value."""

    def __init__(self, key: str) -> None:
        super().__init__(f"KV key {key!r} was changed by another writer")
        self.key = key


LIVENESS_FIELDS = frozenset(
    {"last_seen_ts", "last_sent_ts", "last_seq", "interval_s", "updated_ts"}
)
"""NodeRecord fields that a steady node's every batch moves; written lazily."""
_DECISION_FIELDS = tuple(f for f in NodeRecord.__struct_fields__ if f not in LIVENESS_FIELDS)


def only_liveness_differs(before: NodeRecord, after: NodeRecord) -> bool:
    """Whether ``after`` is ``before`` with at most its liveness fields changed."""
    return all(getattr(before, f) == getattr(after, f) for f in _DECISION_FIELDS)


def rail_key(region: str, cluster: str) -> str:
    """The key of a cluster's RailState."""
    return f"{RAIL_PREFIX}{region}.{cluster}"


def outbox_key(event_id: str) -> str:
    """The key of a pending event (event ids may hold characters keys may not)."""
    return OUTBOX_PREFIX + hashlib.sha1(event_id.encode(), usedforsecurity=False).hexdigest()


def load_patterns(clusters: Iterable[ClusterKey] | None) -> tuple[str, ...]:
    """The bucket's key patterns holding ``clusters``' state (None: every key)."""
    if clusters is None:
        return (">",)
    patterns = [f"{OUTBOX_PREFIX}>"]
    for region, cluster in sorted(set(clusters)):
        patterns += [
            f"{region}.{cluster}.>",
            f"{SIGNALS_PREFIX}{region}.{cluster}.>",
            rail_key(region, cluster),
        ]
    return tuple(patterns)


class NodeStore:
    """NodeRecords, RailStates and pending events, cached, with their KV revisions."""

    def __init__(
        self, kv: KeyValue, js: JetStreamContext, clusters: Iterable[ClusterKey] | None = None
    ) -> None:
        self._kv = kv
        self._js = js
        self._clusters = None if clusters is None else tuple(clusters)
        self._scope = load_patterns(self._clusters)
        """The key patterns :meth:`load` reads: the whole bucket, or a shard's clusters."""
        self._revisions: dict[str, int] = {}
        self.records: dict[str, NodeRecord] = {}
        """By node handle."""
        self.rails: dict[ClusterKey, RailState] = {}
        self.outbox: dict[str, ControllerEvent] = {}
        """Pending events by event id."""
        self._sizes: Counter[ClusterKey] = Counter()
        self.signals: dict[str, NodeSignals] = {}
        """Scoring history by node handle, as loaded from KV: the controller takes a
        node's out (``pop``) at its first batch and keeps it itself from then on, so a
        node's history is held once."""
        self._unwritten: set[str] = set()
        """Handles whose cached record is newer than KV in liveness fields only."""
        self._changed: set[str] = set()
        """Handles whose record was added, removed or changed in more than its liveness
        since :meth:`take_changed`."""

    @classmethod
    async def open(
        cls,
        js: JetStreamContext,
        subjects: Subjects,
        clusters: Iterable[ClusterKey] | None = None,
    ) -> NodeStore:
        """The store over ``subjects.bucket("nodes")`` (which must exist), loaded: the
        whole bucket, or with ``clusters`` (a shard's) only their records, rails and
        scoring histories (and every pending event: the caller keeps its own)."""
        store = cls(await js.key_value(subjects.bucket("nodes")), js, clusters)
        await store.load()
        return store

    async def reload(self) -> None:
        """Replace the whole cache with what KV holds now (a controller taking the lease),
        in place: whoever holds this store sees the new state, and readers never see a
        half-loaded one (the fresh state is read aside, then taken over at once)."""
        fresh = NodeStore(self._kv, self._js, self._clusters)
        await fresh.load()
        self._revisions, self.records, self.rails = fresh._revisions, fresh.records, fresh.rails
        self.outbox, self._sizes, self.signals = fresh.outbox, fresh._sizes, fresh.signals
        self._unwritten, self._changed = fresh._unwritten, fresh._changed

    async def load(self) -> None:
        """Read every key of the bucket into the cache (at start, at a takeover): one
        ordered consumer over the bucket, not a get per key (kv_keys.py)."""
        for latest in (await latest_values(self._js, self._kv, self._scope)).values():
            if latest.value is None and not self._holds_key(latest.key):
                continue  # a delete marker (a published event's outbox entry): nothing held
            self._apply(latest.key, latest.revision, latest.value)
        log.info(
            "loaded %d node records, %d rail states, %d pending events",
            len(self.records),
            len(self.rails),
            len(self.outbox),
        )

    def _holds_key(self, key: str) -> bool:
        if key.startswith(SIGNALS_PREFIX):
            return key[len(SIGNALS_PREFIX) :] in self.signals
        return key in self._revisions or key in self.records

    def cluster_size(self, region: str, cluster: str) -> int:
        """How many nodes the store knows in a cluster (the rail's cluster size)."""
        return self._sizes[(region, cluster)]

    async def put_record(self, record: NodeRecord) -> None:
        """Write a node's record (compare-and-set); StoreConflictError on a lost race.

        A record that differs from the cached one only in its liveness fields
        (:data:`LIVENESS_FIELDS`: a steady node's next batch) is only cached and written
        by :meth:`flush_liveness`, which the controller calls every few seconds.
        """
        key = record.node.handle
        cached = self.records.get(key)
        if cached is not None and key in self._revisions and only_liveness_differs(cached, record):
            self._unwritten.add(key)
            self.records[key] = record
            return
        await self._write(key, encode(record))
        self._unwritten.discard(key)
        self._keep(key, record)

    def put_liveness(self, record: NodeRecord) -> bool:
        """Cache ``record`` to be written by :meth:`flush_liveness`, without comparing it
        with the cached one: the caller promises it differs only in liveness fields
        (``controller.decide.steady``'s output). False, and nothing done, when the node
        has no record written yet: then use :meth:`put_record`."""
        key = record.node.handle
        if key not in self.records or key not in self._revisions:
            return False
        self._unwritten.add(key)
        self.records[key] = record
        return True

    def take_changed(self) -> set[str]:
        """The handles whose record was added, removed or changed in more than its liveness
        since the last call (the controller's silence watch takes them); the set restarts
        empty."""
        changed, self._changed = self._changed, set()
        return changed

    @property
    def unwritten(self) -> frozenset[str]:
        """The handles whose record has liveness not yet written."""
        return frozenset(self._unwritten)

    async def flush_liveness(self, handles: Iterable[str]) -> int:
        """Write those of ``handles`` whose liveness is newer than KV; how many were
        written. A lost race (another writer) re-reads that key instead: its value wins."""
        written = 0
        for key in sorted(self._unwritten.intersection(handles)):
            self._unwritten.discard(key)
            record = self.records.get(key)
            if record is None:
                continue
            try:
                await self._write(key, encode(record))
            except StoreConflictError:
                continue
            written += 1
        return written

    def _keep(self, key: str, record: NodeRecord) -> None:
        if key not in self.records:
            self._sizes[(record.node.region, record.node.cluster)] += 1
        self.records[key] = record
        self._changed.add(key)

    async def put_rail(self, state: RailState) -> None:
        """Write a cluster's rail state (compare-and-set); StoreConflictError on a lost race."""
        await self._write(rail_key(state.region, state.cluster), encode(state))
        self.rails[(state.region, state.cluster)] = state

    async def put_signals(self, handle: str, signals: NodeSignals) -> None:
        """Persist a node's scoring history (plain put: the controller is its one writer,
        and keeps it: it is not cached here)."""
        await self._kv.put(SIGNALS_PREFIX + handle, _signals_encoder.encode(signals))

    async def put_records(self, records: Iterable[NodeRecord]) -> None:
        """:meth:`put_record` for several nodes at once (the writes in flight together);
        every write is awaited, then the first failure, if any, is raised (a
        :class:`StoreConflictError` before any other)."""
        await _all(self.put_record(record) for record in records)

    async def add_pending(self, events: Iterable[ControllerEvent]) -> None:
        """Keep ``events`` in the outbox until :meth:`remove_pending` (plain puts, in
        flight together)."""

        async def put(event: ControllerEvent) -> None:
            key = outbox_key(event.event_id)
            self._revisions[key] = await self._kv.put(key, encode(event))
            self.outbox[event.event_id] = event

        await _all(put(event) for event in events)

    async def remove_pending(self, event_id: str) -> None:
        """Drop a published event from the outbox."""
        key = outbox_key(event_id)
        await self._kv.delete(key)
        self._revisions.pop(key, None)
        self.outbox.pop(event_id, None)

    async def remove_all_pending(self, event_ids: Iterable[str]) -> None:
        """:meth:`remove_pending` for several events at once (the deletes in flight
        together; the first failure raised once all are done)."""
        await _all(self.remove_pending(event_id) for event_id in event_ids)

    async def _write(self, key: str, value: bytes) -> None:
        """Create the key, or update it from the last revision seen."""
        last = self._revisions.get(key)
        try:
            if last is None:
                revision = await self._kv.create(key, value)
            else:
                revision = await self._kv.update(key, value, last=last)
        except KeyWrongLastSequenceError:
            if await self._holds(key, value):
                return  # our earlier write landed though its reply was lost
            await self._refresh(key)
            raise StoreConflictError(key) from None
        self._revisions[key] = revision

    async def _holds(self, key: str, value: bytes) -> bool:
        """Whether the key's latest value is ``value`` (then its revision is taken)."""
        try:
            entry = await self._kv.get(key)
        except KeyNotFoundError:
            return False
        if entry.value != value or entry.revision is None:
            return False
        self._revisions[key] = entry.revision
        return True

    async def _refresh(self, key: str) -> None:
        """Re-read one key into the cache (gone or undecodable: dropped from it)."""
        try:
            entry = await self._kv.get(key)
        except KeyNotFoundError:
            self._apply(key, 0, None)
            return
        self._apply(key, entry.revision or 0, entry.value)

    def _apply(self, key: str, revision: int, data: bytes | None) -> None:
        """Take a key's value as read from KV (None or no revision: gone)."""
        self._revisions.pop(key, None)
        self._unwritten.discard(key)
        if data is None or not revision:
            self._forget(key)
            return
        if key.startswith(SIGNALS_PREFIX):  # plain puts: no revision kept
            try:
                self.signals[key[len(SIGNALS_PREFIX) :]] = _signals_decoder.decode(data)
            except msgspec.DecodeError as exc:
                log.error("KV key %r holds undecodable scoring history, ignored: %s", key, exc)
            return
        self._revisions[key] = revision
        try:
            value = decode(data)
        except CodecError as exc:
            log.error("KV key %r holds an undecodable value, ignored: %s", key, exc)
            return
        match value:
            case NodeRecord():
                self._keep(key, value)
            case RailState():
                self.rails[(value.region, value.cluster)] = value
            case ControllerEvent():
                self.outbox[value.event_id] = value
            case _:
                log.error("KV key %r holds a %s, ignored", key, type(value).__name__)

    def _forget(self, key: str) -> None:
        if key.startswith(SIGNALS_PREFIX):
            self.signals.pop(key[len(SIGNALS_PREFIX) :], None)
        gone = self.records.pop(key, None)
        if gone is not None:
            self._sizes[(gone.node.region, gone.node.cluster)] -= 1
            self._changed.add(key)
        if key.startswith(RAIL_PREFIX):
            self.rails = {k: v for k, v in self.rails.items() if rail_key(*k) != key}
        if key.startswith(OUTBOX_PREFIX):
            self.outbox = {k: v for k, v in self.outbox.items() if outbox_key(k) != key}


async def _all(writes: Iterable[Coroutine[Any, Any, None]]) -> None:
    """Await ``writes`` together; once every one is done, raise the first failure (a
    :class:`StoreConflictError` first: the caller decides again), if any."""
    pending = list(writes)
    if len(pending) == 1:
        await pending[0]
        return
    results = await asyncio.gather(*pending, return_exceptions=True)
    failures = [r for r in results if isinstance(r, BaseException)]
    for failure in failures:
        if isinstance(failure, StoreConflictError):
            raise failure
    if failures:
        raise failures[0]
