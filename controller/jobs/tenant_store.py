"""The tenants' quotas: KV ``<P>_TENANTS``, key = tenant name, value = :class:`TenantQuota`.

Seeded from the controller config's ``[[tenants]]`` (a tenant the bucket does not hold
yet); ``PUT /v1/tenants/NAME`` (``metalguard tenants set``) writes it, compare-and-set on
the revision read, so a quota set through the API survives restarts and wins over the
config (docs/scheduler.md, "Tenant quotas").
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from metalguard.controller.state.kv_keys import latest_values
from metalguard.proto.codec import CodecError, decode, encode
from metalguard.proto.subjects import Subjects, check_token
from metalguard.proto.tenants import TenantQuota

log = logging.getLogger(__name__)

BUCKET = "tenants"
"""``Subjects.bucket(BUCKET)`` is ``<P>_TENANTS``."""


class TenantConflictError(Exception):
    """Another writer changed the tenant's quota between the read and the write."""


class TenantStore:
    """A cache of every tenant's quota over the bucket, written compare-and-set."""

    def __init__(self, kv: KeyValue, js: JetStreamContext) -> None:
        self._kv = kv
        self._js = js
        self._quotas: dict[str, TenantQuota] = {}
        self._revisions: dict[str, int] = {}

    @classmethod
    async def open(cls, js: JetStreamContext, subjects: Subjects) -> TenantStore:
        """The store over the bucket (``ensure_streams`` creates it), loaded."""
        store = cls(await js.key_value(subjects.bucket(BUCKET)), js)
        await store.load()
        return store

    @property
    def quotas(self) -> Mapping[str, TenantQuota]:
        """Every tenant's quota, by name."""
        return self._quotas

    async def load(self) -> None:
        """Read the whole bucket into the cache (an unreadable value is logged, skipped)."""
        self._quotas.clear()
        self._revisions.clear()
        for latest in (await latest_values(self._js, self._kv)).values():
            if latest.value is None:
                continue  # deleted
            self._revisions[latest.key] = latest.revision
            try:
                self._quotas[latest.key] = decode(latest.value, TenantQuota)
            except CodecError as exc:
                log.error("tenant quota %s is unreadable (%s): ignored", latest.key, exc)

    async def seed(self, quotas: Iterable[TenantQuota]) -> list[str]:
        """Store each configured quota whose tenant the bucket does not hold; the names
        stored (one the API set is kept: it is newer than the config)."""
        stored = []
        for quota in quotas:
            if quota.name in self._quotas:
                continue
            try:
                await self.put(quota)
            except TenantConflictError:
                continue  # another controller seeded it first
            stored.append(quota.name)
        return stored

    async def put(self, quota: TenantQuota) -> TenantQuota:
        """Store ``quota`` (compare-and-set on the revision this store last saw);
        TenantConflictError when another writer changed it first (the cache is then
        re-read), ValueError for a name that cannot be a key."""
        key = check_token(quota.name, "tenant")
        revision = self._revisions.get(key)
        try:
            if revision is None:
                new = await self._kv.create(key, encode(quota))
            else:
                new = await self._kv.update(key, encode(quota), last=revision)
        except KeyWrongLastSequenceError:
            await self._reread(key)
            raise TenantConflictError(f"tenant {key!r} changed while it was written") from None
        self._quotas[key] = quota
        self._revisions[key] = new
        return quota

    async def _reread(self, key: str) -> None:
        try:
            entry = await self._kv.get(key)
        except KeyNotFoundError:
            self._quotas.pop(key, None)
            self._revisions.pop(key, None)
            return
        if entry.value is None or entry.revision is None:
            return
        try:
            self._quotas[key] = decode(entry.value, TenantQuota)
            self._revisions[key] = entry.revision
        except CodecError:
            self._revisions[key] = entry.revision


def by_name(quotas: Iterable[TenantQuota]) -> dict[str, TenantQuota]:
    """``{name: quota}``."""
    return {q.name: q for q in quotas}
