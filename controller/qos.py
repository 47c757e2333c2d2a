"""The declared flow-control profiles (docs/qos.md) in KV ``<P>_QOS``, versioned.

Keys are ``<cluster>`` (the cluster's profile) and ``<cluster>.<node>`` (one node's
override); each value is a :class:`~proto.qos.QosProfile` encoded with proto/codec.py, the
form the agents decode.  A write must carry a ``version`` greater than the stored one
(:func:`version_problem`, pure); the bucket keeps the last revisions as history.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NoKeysError
from nats.js.kv import KeyValue

from metalguard.proto.codec import CodecError, decode, encode
from metalguard.proto.qos import QosProfile
from metalguard.proto.subjects import Subjects, check_token

log = logging.getLogger(__name__)

BUCKET = "qos"
"""``Subjects.bucket(BUCKET)`` is ``<P>_QOS``."""


class VersionConflictError(Exception):
    """The profile's version is not newer than the stored one (or the key changed)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class StoredProfile:
    """A profile as stored: its key and KV revision."""

    key: str
    revision: int
    profile: QosProfile


def profile_key(cluster: str, node: str | None = None) -> str:
    """``<cluster>`` or ``<cluster>.<node>``; ValueError for a name that cannot be a key."""
    key = check_token(cluster, "cluster")
    return key if node is None else f"{key}.{check_token(node, 'node')}"


def version_problem(current: QosProfile | None, new: QosProfile) -> str | None:
    """Why ``new`` may not replace ``current`` (its version is not greater), or None."""
    if current is None or new.version > current.version:
        return None
    return (
        f"version {new.version} is not newer than the stored version {current.version}; "
        f"a changed profile needs a version above {current.version}"
    )


class QosStore:
    """Reads and versioned writes of the profiles in one ``<P>_QOS`` bucket."""

    def __init__(self, kv: KeyValue) -> None:
        self._kv = kv

    @classmethod
    async def open(cls, js: JetStreamContext, subjects: Subjects) -> QosStore:
        """The store over the bucket ``ensure_streams`` created for ``subjects``."""
        return cls(await js.key_value(subjects.bucket(BUCKET)))

    async def get(self, cluster: str, node: str | None = None) -> StoredProfile | None:
        """The profile at the key, or None; CodecError if the stored value is unreadable."""
        key = profile_key(cluster, node)
        entry = await self._entry(key)
        if entry is None:
            return None
        value, revision = entry
        return StoredProfile(key, revision, decode(value, QosProfile))

    async def effective(self, cluster: str, node: str) -> StoredProfile | None:
        """What the node applies: its override, else the cluster's profile, else None."""
        return await self.get(cluster, node) or await self.get(cluster)

    async def history(self, cluster: str, node: str | None = None) -> list[StoredProfile]:
        """The kept revisions of the key, oldest first (deletions and bad values skipped)."""
        key = profile_key(cluster, node)
        try:
            entries = await self._kv.history(key)
        except (KeyNotFoundError, NoKeysError):
            return []
        kept = []
        for e in entries:
            if e.operation is not None or e.value is None or e.revision is None:
                continue
            try:
                kept.append(StoredProfile(key, e.revision, decode(e.value, QosProfile)))
            except CodecError:
                continue
        return kept

    async def put(
        self, cluster: str, node: str | None, profile: QosProfile
    ) -> tuple[StoredProfile, StoredProfile | None]:
        """Store ``profile`` if its version is newer: (the new entry, the one replaced).

        VersionConflictError for a stale or equal version, or when another writer changed the
        key in between (compare-and-set on the revision read).
        """
        key = profile_key(cluster, node)
        entry = await self._entry(key)
        previous: StoredProfile | None = None
        if entry is not None:
            value, revision = entry
            try:
                previous = StoredProfile(key, revision, decode(value, QosProfile))
            except CodecError as exc:  # an unreadable value may be replaced
                log.warning("QoS key %s holds an unreadable profile (%s): replacing it", key, exc)
        problem = version_problem(previous.profile if previous else None, profile)
        if problem is not None:
            raise VersionConflictError(problem)
        data = encode(profile)
        try:
            if entry is None:
                revision = await self._kv.create(key, data)
            else:
                revision = await self._kv.update(key, data, last=entry[1])
        except KeyWrongLastSequenceError:
            raise VersionConflictError(f"{key} changed while it was written; retry") from None
        return StoredProfile(key, revision, profile), previous

    async def _entry(self, key: str) -> tuple[bytes, int] | None:
        try:
            entry = await self._kv.get(key)
        except KeyNotFoundError:
            return None
        if entry.value is None or entry.revision is None or entry.operation is not None:
            return None
        return entry.value, entry.revision
