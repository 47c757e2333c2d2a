"""What an instance holds besides its record: a node's claim, a volume (and its entry),
an export — taken and given back for the provisioning service, each undo safe to repeat
(a rollback, a resume).  Failures are :class:`ProvisionError` with the status the API
answers; clean-up steps that must not stop the others are :meth:`Resources.best_effort`
(logged: the next resume repairs what they left)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from msgspec.structs import replace
from nats.errors import Error as NatsError

from metalguard.controller.provision import machine
from metalguard.controller.provision.announce import Announcer
from metalguard.controller.provision.errors import ProvisionError, storage_error
from metalguard.controller.provision.machine import Emit, VolumeEntry
from metalguard.controller.provision.storage import StorageError, VolumeBackend
from metalguard.controller.provision.store import ProvisionConflictError, ProvisionStore

log = logging.getLogger(__name__)


class Resources:
    """Claims (``store``), volumes and exports (``storage``) of the service's instances."""

    def __init__(
        self,
        store: ProvisionStore,
        storage: VolumeBackend,
        announcer: Announcer,
        max_failures: Callable[[], int],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.storage = storage
        self._announcer = announcer
        self._max_failures = max_failures
        self._clock = clock

    async def claim_first(self, candidates: list[str], instance_id: str, named: str) -> str:
        """Claim the first of ``candidates`` this call wins (409 when none: ``named``, the
        node the request named, is said to be taken)."""
        for node in candidates:
            if await self.kv(self.store.claim(node, instance_id, self._clock())):
                return node
        if named:
            raise ProvisionError(409, f"{named} was taken by another request")
        raise ProvisionError(409, "no node available (taken by other requests)")

    async def free(self, node: str, instance_id: str, *, failed: bool = False) -> None:
        """Give ``node`` up if ``instance_id`` holds it; a failed deploy counts (and may
        flag the node)."""
        for _ in range(3):
            claim = self.store.claims.get(node)
            if claim is None or claim.instance_id != instance_id:
                return
            now = self._clock()
            flagged: Emit | None = None
            if failed:
                new, flagged = machine.claim_failed(claim, self._max_failures(), now)
            else:
                new = replace(claim, instance_id="", updated_ts=now)
            try:
                await self.store.put_claim(new)
            except ProvisionConflictError:
                continue  # re-read: still ours?
            except NatsError as exc:
                log.warning("node %s: claim of %s not freed yet: %s", node, instance_id, exc)
                return
            if flagged is not None:
                await self._announcer.announce([flagged])
            return

    def named_volume(self, name: str, tenant: str, image: str) -> VolumeEntry | None:
        """The entry of an existing volume a request names (None: it names none)."""
        if not name:
            return None
        entry = self.store.volumes.get(name)
        if entry is None:
            raise ProvisionError(404, f"no volume {name!r}")
        if entry.volume.tenant != tenant:
            raise ProvisionError(409, f"volume {name!r} is not tenant {tenant}'s")
        if entry.volume.image != image:
            raise ProvisionError(
                409, f"volume {name!r} is over image {entry.volume.image}, not {image}"
            )
        if entry.used_by:
            raise ProvisionError(409, f"volume {name!r} is in use by instance {entry.used_by}")
        return entry

    async def fresh_volume_name(self, tenant: str, instance_id: str) -> str:
        """A free volume name for a new volume: ``<tenant>-<instance>`` (``-2``, ... when
        taken)."""
        taken = set(self.store.volumes)
        with contextlib.suppress(StorageError):
            taken |= {v.name for v in await self.storage.list_volumes()}
        base = f"{tenant}-{instance_id}"[:120]
        name, n = base, 1
        while name in taken:
            n += 1
            name = f"{base}-{n}"
        return name

    async def create_volume(self, name: str, tenant: str, image: str, instance_id: str) -> None:
        """A new volume for ``instance_id`` and its entry (used by it, made for it)."""
        try:
            volume = await self.storage.create_volume(name, tenant, image)
        except StorageError as exc:
            raise storage_error(exc, f"volume {name}") from None
        entry = VolumeEntry(volume=volume, used_by=instance_id, created_by=instance_id)
        try:
            await self.store.put_volume(entry)
        except (ProvisionConflictError, NatsError) as exc:
            with contextlib.suppress(StorageError):
                await self.storage.delete_volume(name)
            raise ProvisionError(503, f"volume {name}: not recorded: {exc}") from None

    async def use_volume(self, entry: VolumeEntry, instance_id: str) -> None:
        """An existing (free) volume becomes ``instance_id``'s root."""
        try:
            await self.store.put_volume(replace(entry, used_by=instance_id))
        except ProvisionConflictError:
            raise ProvisionError(
                409, f"volume {entry.volume.name!r} was taken by another request"
            ) from None
        except NatsError as exc:
            raise ProvisionError(503, f"KV unavailable: {exc}") from None

    async def drop_volume(self, name: str, instance_id: str) -> None:
        """Undo :meth:`create_volume`/:meth:`use_volume` of a failed step: a volume made
        for ``instance_id`` that never booted is deleted, another one is freed."""
        entry = self.store.volumes.get(name)
        if entry is None or entry.used_by not in ("", instance_id):
            return
        if machine.delete_on_failure(entry, instance_id):
            try:
                await self.storage.delete_volume(name)
            except StorageError as exc:
                if exc.kind != "not_found":  # gone already: only its entry is left
                    log.warning("volume %s not deleted: %s", name, exc)
                    await self.best_effort(
                        self.store.put_volume(replace(entry, used_by="")), "volume entry"
                    )
                    return
            await self.best_effort(self.store.delete_volume(name), "volume entry")
        else:
            await self.release_volume(name, instance_id)

    async def release_volume(self, name: str, instance_id: str) -> None:
        """The volume is no longer ``instance_id``'s root: kept, free, for its tenant."""
        entry = self.store.volumes.get(name)
        if entry is not None and entry.used_by == instance_id:
            await self.best_effort(self.store.put_volume(replace(entry, used_by="")), "volume")

    async def export(self, volume: str, export: str) -> None:
        """Serve ``volume`` as the NBD export ``export``."""
        try:
            await self.storage.export(volume, export)
        except StorageError as exc:
            raise storage_error(exc, f"export of volume {volume}") from None

    async def unexport(self, export: str, *, strict: bool = False) -> None:
        """Stop serving ``export`` (idempotent); a failure raises only when ``strict``."""
        if not export:
            return
        try:
            await self.storage.unexport(export)
        except StorageError as exc:
            if strict:
                raise storage_error(exc, "removing an export") from None
            log.warning(
                "export %s... not removed (the next resume removes it): %s", export[:6], exc
            )

    async def best_effort(self, work: Awaitable[Any], what: str) -> None:
        """A clean-up step that must not stop the others (its failure is logged; the next
        resume repairs what it left)."""
        try:
            await work
        except (ProvisionError, ProvisionConflictError, NatsError, StorageError) as exc:
            log.warning("%s not updated: %s", what, exc)

    async def kv(self, work: Awaitable[Any]) -> Any:
        """``work`` (a KV operation); 503 when NATS is away."""
        try:
            return await work
        except NatsError as exc:
            raise ProvisionError(503, f"KV unavailable: {exc}") from None
