"""The provisioning service's durable state: KV ``<P>_PROVISION`` (docs/provisioning.md).

One bucket, four kinds of key:

- ``inst.<instance id>``: the :class:`~metalguard.proto.provision.Instance`;
- ``node.<region>.<cluster>.<node>``: the node's :class:`NodeClaim` — which live instance
  holds it, its consecutive deploy failures, whether it is flagged.  A claim is taken
  with KV ``create()`` (no record yet) or a compare-and-set update of a free record, so of
  two requests for one node exactly one wins, also across controllers;
- ``vol.<name>``: the volume's :class:`VolumeEntry` (who uses it, who made it);
- ``image.<name>``: the base :class:`~metalguard.proto.provision.Image` as registered.

Every write is compare-and-set on the revision this store last saw for the key; a
conflict re-reads the key into the cache and raises :class:`ProvisionConflictError`, so
the caller decides again from the fresh value (a conflict with our own earlier write,
its reply lost, is a success).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Generic, TypeVar

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from metalguard.controller.provision.machine import NodeClaim, VolumeEntry
from metalguard.controller.state.kv_keys import latest_values
from metalguard.proto.provision import Image, Instance
from metalguard.proto.subjects import Subjects

log = logging.getLogger(__name__)

T = TypeVar("T", bound=msgspec.Struct)

INSTANCE_PREFIX = "inst."
NODE_PREFIX = "node."
VOLUME_PREFIX = "vol."
IMAGE_PREFIX = "image."


class ProvisionConflictError(Exception):
    """Another writer changed the key first (or created it); the cache holds its value."""

    def __init__(self, key: str) -> None:
        super().__init__(f"KV key {key!r} was changed by another writer")
        self.key = key


class _Table(Generic[T]):
    """The records of one key prefix, cached with their revisions."""

    def __init__(self, kv: KeyValue, prefix: str, kind: type[T]) -> None:
        self._kv = kv
        self.prefix = prefix
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(kind)
        self.items: dict[str, T] = {}
        self._revisions: dict[str, int] = {}

    def clear(self) -> None:
        self.items.clear()
        self._revisions.clear()

    async def refresh(self, name: str) -> T | None:
        """Re-read one record from the bucket (None: absent)."""
        key = self.prefix + name
        try:
            entry = await self._kv.get(key)
        except KeyNotFoundError:  # absent, or deleted (its marker reads absent)
            self.items.pop(name, None)
            self._revisions[name] = 0
            return None
        if entry.value is None:
            return None
        return self.take(name, entry.revision or 0, entry.value)

    def take(self, name: str, revision: int, data: bytes) -> T | None:
        """Keep a record as read from the bucket (None: undecodable, skipped)."""
        try:
            value = self._decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.error("KV %s%s: undecodable value skipped: %s", self.prefix, name, exc)
            return None
        self.items[name] = value
        self._revisions[name] = revision
        return value

    async def create(self, name: str, value: T) -> None:
        """Store a new record; ProvisionConflictError when the key holds one."""
        data = self._encoder.encode(value)
        try:
            rev = await self._kv.create(self.prefix + name, data)
        except KeyWrongLastSequenceError:
            await self.refresh(name)
            raise ProvisionConflictError(self.prefix + name) from None
        self.items[name] = value
        self._revisions[name] = rev

    async def put(self, name: str, value: T) -> None:
        """Replace (or create) a record if nobody changed it since we read it."""
        data = self._encoder.encode(value)
        last = self._revisions.get(name, 0)
        try:
            if last == 0 and name not in self.items:
                rev = await self._kv.create(self.prefix + name, data)
            else:
                rev = await self._kv.update(self.prefix + name, data, last=last)
        except KeyWrongLastSequenceError:
            current = await self.refresh(name)
            if current is not None and self._encoder.encode(current) == data:
                return  # our own write, its reply lost
            raise ProvisionConflictError(self.prefix + name) from None
        self.items[name] = value
        self._revisions[name] = rev

    async def delete(self, name: str) -> None:
        """Remove a record (compare-and-set on its revision; absent: nothing to do)."""
        if name not in self.items:
            return
        try:
            await self._kv.delete(self.prefix + name, last=self._revisions.get(name, 0))
        except KeyWrongLastSequenceError:
            await self.refresh(name)
            raise ProvisionConflictError(self.prefix + name) from None
        self.items.pop(name, None)
        self._revisions.pop(name, None)


class ProvisionStore:
    """Instances, node claims, volume entries and images over the bucket, cached."""

    def __init__(self, kv: KeyValue, js: JetStreamContext) -> None:
        self._kv = kv
        self._js = js
        self._instances = _Table(kv, INSTANCE_PREFIX, Instance)
        self._claims = _Table(kv, NODE_PREFIX, NodeClaim)
        self._volumes = _Table(kv, VOLUME_PREFIX, VolumeEntry)
        self._images = _Table(kv, IMAGE_PREFIX, Image)

    @classmethod
    async def open(cls, js: JetStreamContext, subjects: Subjects) -> ProvisionStore:
        """The store over ``<P>_PROVISION`` (which must exist), loaded."""
        store = cls(await js.key_value(subjects.bucket("provision")), js)
        await store.load()
        return store

    async def load(self) -> None:
        """Read the whole bucket into the cache (a restarted controller resumes here)."""
        tables = (self._instances, self._claims, self._volumes, self._images)
        for table in tables:
            table.clear()
        for latest in (await latest_values(self._js, self._kv)).values():  # kv_keys.py
            if latest.value is None:
                continue  # deleted: its marker reads absent
            for table in tables:
                if latest.key.startswith(table.prefix):
                    table.take(latest.key[len(table.prefix) :], latest.revision, latest.value)
                    break

    # --- views ---------------------------------------------------------------------------

    @property
    def instances(self) -> Mapping[str, Instance]:
        """Every instance, by id."""
        return self._instances.items

    @property
    def claims(self) -> Mapping[str, NodeClaim]:
        """Every node's claim record, by node handle."""
        return self._claims.items

    @property
    def volumes(self) -> Mapping[str, VolumeEntry]:
        """Every volume entry, by volume name."""
        return self._volumes.items

    @property
    def images(self) -> Mapping[str, Image]:
        """Every registered image, by name."""
        return self._images.items

    # --- instances -----------------------------------------------------------------------

    async def create_instance(self, inst: Instance) -> None:
        """Store a new instance; ProvisionConflictError when the id is taken."""
        await self._instances.create(inst.instance_id, inst)

    async def put_instance(self, inst: Instance) -> None:
        """Replace an instance's record (compare-and-set)."""
        await self._instances.put(inst.instance_id, inst)

    async def delete_instance(self, instance_id: str) -> None:
        """Forget an instance (a request rolled back before it was announced)."""
        await self._instances.delete(instance_id)

    async def refresh_instance(self, instance_id: str) -> Instance | None:
        """Re-read one instance."""
        return await self._instances.refresh(instance_id)

    # --- node claims ---------------------------------------------------------------------

    async def claim(self, node: str, instance_id: str, now: float) -> bool:
        """Take ``node`` for ``instance_id``: True when this call won it, False when it is
        held (or flagged), or another writer took it first."""
        current = self._claims.items.get(node)
        if current is None:
            current = await self._claims.refresh(node)
        if current is not None and (current.instance_id or current.flagged):
            return current.instance_id == instance_id
        base = current or NodeClaim(node=node)
        new = msgspec.structs.replace(base, instance_id=instance_id, updated_ts=now)
        try:
            await self._claims.put(node, new)
        except ProvisionConflictError:
            fresh = self._claims.items.get(node)
            return fresh is not None and fresh.instance_id == instance_id
        return True

    async def put_claim(self, claim: NodeClaim) -> None:
        """Replace a node's claim record (compare-and-set)."""
        await self._claims.put(claim.node, claim)

    async def refresh_claim(self, node: str) -> NodeClaim | None:
        """Re-read one node's claim."""
        return await self._claims.refresh(node)

    # --- volumes and images --------------------------------------------------------------

    async def put_volume(self, entry: VolumeEntry) -> None:
        """Write a volume's entry (compare-and-set)."""
        await self._volumes.put(entry.volume.name, entry)

    async def delete_volume(self, name: str) -> None:
        """Forget a deleted volume."""
        await self._volumes.delete(name)

    async def refresh_volume(self, name: str) -> VolumeEntry | None:
        """Re-read one volume entry."""
        return await self._volumes.refresh(name)

    async def put_image(self, image: Image) -> None:
        """Record a registered image."""
        await self._images.put(image.name, image)

    async def delete_image(self, name: str) -> None:
        """Forget a deleted image."""
        await self._images.delete(name)
