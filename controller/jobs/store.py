"""The jobs' durable state: KV ``<P>_JOBS``, key = job id, value = :class:`JobStatus`
(which carries the submitted :class:`Job`).

Writes are compare-and-set on the revision this store last saw, like
:class:`controller.state.NodeStore`: a conflict re-reads the key and raises
:class:`JobConflictError`, so the caller decides again from the fresh value.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from metalguard.controller.state.kv_keys import bucket_keys
from metalguard.proto.codec import CodecError, decode, encode
from metalguard.proto.jobs import JobStatus
from metalguard.proto.subjects import Subjects

log = logging.getLogger(__name__)


class JobConflictError(Exception):
    """Another writer changed the job first; the cache now holds its value."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"job {job_id!r} was changed by another writer")
        self.job_id = job_id


class JobExistsError(Exception):
    """A job with that id was already submitted."""


class JobStore:
    """A cache of every job's status over the bucket, written compare-and-set."""

    def __init__(self, kv: KeyValue) -> None:
        self._kv = kv
        self._jobs: dict[str, JobStatus] = {}
        self._revisions: dict[str, int] = {}

    @classmethod
    async def open(cls, js: JetStreamContext, subjects: Subjects) -> JobStore:
        """The store over the bucket (which must exist), loaded."""
        store = cls(await js.key_value(subjects.bucket("jobs")))
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
        for key in await bucket_keys(self._kv):  # not kv.keys(): it can miss (kv_keys.py)
            await self._refresh(key)

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
        try:
            status = decode(entry.value, JobStatus)
        except CodecError as exc:
            log.error("MG_JOBS %s: undecodable value skipped: %s", key, exc)
            return
        self._jobs[key] = status
        self._revisions[key] = entry.revision or 0
