"""The jobs' durable state: KV ``<P>_JOBS``, key = job id, value = :class:`JobStatus`
(which carries the submitted :class:`Job`); and the jobs' outbox, key
``_outbox.<sha1 of event id>``, value = a :class:`ControllerEvent` decided and about to be
written with its status, not yet acknowledged by ``<P>_CONTROL`` (deleted once it is;
published again by a restarted manager: the deterministic event id deduplicates).

Writes are compare-and-set on the revision this store last saw, like
:class:`controller.state.NodeStore`: a conflict re-reads the key and raises
:class:`JobConflictError`, so the caller decides again from the fresh value.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Mapping

from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from metalguard.controller.state.kv_keys import latest_values
from metalguard.proto.codec import CodecError, decode, encode
from metalguard.proto.events import ControllerEvent
from metalguard.proto.jobs import JobStatus
from metalguard.proto.subjects import Subjects

log = logging.getLogger(__name__)

OUTBOX_PREFIX = "_outbox."


def outbox_key(event_id: str) -> str:
    """The key of a pending job event (event ids may hold characters keys may not)."""
    return OUTBOX_PREFIX + hashlib.sha1(event_id.encode(), usedforsecurity=False).hexdigest()


class JobConflictError(Exception):
    """Another writer changed the job first; the cache now holds its value."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"job {job_id!r} was changed by another writer")
        self.job_id = job_id


class JobExistsError(Exception):
    """A job with that id was already submitted."""


class JobStore:
    """A cache of every job's status over the bucket, written compare-and-set, and of
    the job events still in the outbox. ``js`` is the JetStream context of the bucket
    (its key listing asks the stream, :mod:`metalguard.controller.state.kv_keys`)."""

    def __init__(self, kv: KeyValue, js: JetStreamContext) -> None:
        self._kv = kv
        self._js = js
        self._jobs: dict[str, JobStatus] = {}
        self._revisions: dict[str, int] = {}
        self.outbox: dict[str, ControllerEvent] = {}
        """Pending job events by event id (written, not yet acknowledged by the stream)."""

    @classmethod
    async def open(cls, js: JetStreamContext, subjects: Subjects) -> JobStore:
        """The store over the bucket (which must exist), loaded."""
        store = cls(await js.key_value(subjects.bucket("jobs")), js)
        await store.load()
        return store

    @property
    def jobs(self) -> Mapping[str, JobStatus]:
        """Every job's status, by id."""
        return self._jobs

    async def load(self) -> None:
        """Read the whole bucket into the cache (a restarted controller resumes here)."""
        self._jobs.clear()
        self._revisions.clear()
        self.outbox.clear()
        for latest in (await latest_values(self._js, self._kv)).values():  # kv_keys.py
            if latest.value is None:
                continue  # deleted (a published event, a job gone to another region)
            if latest.key.startswith(OUTBOX_PREFIX):
                self._take_pending(latest.key, latest.value)
            else:
                self._take(latest.key, latest.revision, latest.value)

    async def add_pending(self, events: Iterable[ControllerEvent]) -> None:
        """Keep ``events`` in the outbox until :meth:`remove_pending` (plain puts, made
        before the status that announces them is written)."""
        for event in events:
            await self._kv.put(outbox_key(event.event_id), encode(event))
            self.outbox[event.event_id] = event

    async def remove_pending(self, event_id: str) -> None:
        """Drop a published (or abandoned) event from the outbox."""
        await self._kv.delete(outbox_key(event_id))
        self.outbox.pop(event_id, None)

    def _take_pending(self, key: str, data: bytes) -> None:
        try:
            event = decode(data, ControllerEvent)
        except CodecError as exc:
            log.error("MG_JOBS %s: undecodable pending event skipped: %s", key, exc)
            return
        self.outbox[event.event_id] = event

    async def create(self, status: JobStatus) -> None:
        """Store a new job; JobExistsError when its id is taken."""
        try:
            rev = await self._kv.create(status.job_id, encode(status))
        except KeyWrongLastSequenceError:
            await self._refresh(status.job_id)
            raise JobExistsError(status.job_id) from None
        self._jobs[status.job_id] = status
        self._revisions[status.job_id] = rev

    async def put(self, status: JobStatus) -> None:
        """Replace a job's status if nobody changed it since we read it."""
        key = status.job_id
        data = encode(status)
        try:
            rev = await self._kv.update(key, data, last=self._revisions.get(key, 0))
        except KeyWrongLastSequenceError:
            if await self._holds(key, data):
                return
            raise JobConflictError(key) from None
        self._jobs[key] = status
        self._revisions[key] = rev

    async def delete(self, job_id: str) -> None:
        """Remove a job that went to another region (compare-and-set on its revision)."""
        try:
            await self._kv.delete(job_id, last=self._revisions.get(job_id, 0))
        except KeyWrongLastSequenceError:
            raise JobConflictError(job_id) from None
        self._jobs.pop(job_id, None)
        self._revisions.pop(job_id, None)

    async def refresh(self, job_id: str) -> JobStatus | None:
        """Re-read one job from the bucket."""
        await self._refresh(job_id)
        return self._jobs.get(job_id)

    async def _holds(self, key: str, data: bytes) -> bool:
        """After a conflict: re-read; True when the stored value is ours (a lost reply)."""
        await self._refresh(key)
        current = self._jobs.get(key)
        return current is not None and encode(current) == data

    async def _refresh(self, key: str) -> None:
        try:
            entry = await self._kv.get(key)
        except KeyNotFoundError:
            self._jobs.pop(key, None)
            self._revisions.pop(key, None)
            return
        if entry.value is None:
            return
        self._take(key, entry.revision or 0, entry.value)

    def _take(self, key: str, revision: int, data: bytes) -> None:
        try:
            status = decode(data, JobStatus)
        except CodecError as exc:
            log.error("MG_JOBS %s: undecodable value skipped: %s", key, exc)
            return
        self._jobs[key] = status
        self._revisions[key] = revision
