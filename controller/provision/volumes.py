"""Tenant volumes: copy-on-write qcow2 overlays under ``<data_dir>/volumes/``.

- ``<name>.qcow2``: ``qemu-img create -f qcow2 -b ../images/<image>.qcow2 -F qcow2``:
  a few hundred kilobytes when made; it grows only by what the tenant writes, and the
  base is only ever read through it (the base file is never opened for writing);
- ``<name>.json``: its :class:`~metalguard.proto.provision.Volume` record (tenant,
  image, created_ts), written last (atomically); ``size_bytes`` is read from the disk
  (allocated blocks) whenever volumes are listed.
- ``.tmp-*``: an overlay being made (removed on failure and at :meth:`VolumeStore.cleanup`).
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec

from metalguard.controller.provision import qemuimg
from metalguard.controller.provision.images import (
    TMP_PREFIX,
    ImageRegistry,
    remove_leftovers,
    write_json_atomic,
)
from metalguard.controller.provision.tool import StorageError, run_tool
from metalguard.proto.provision import Volume

log = logging.getLogger(__name__)


def allocated_bytes(path: Path) -> int:
    """Bytes ``path`` takes on its file system (allocated blocks, not its apparent size)."""
    return path.stat().st_blocks * 512


class VolumeStore:
    """Create, delete and list tenant overlays over the images of ``images``."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        images: ImageRegistry,
        *,
        tool_timeout_s: float = 120.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.dir = Path(data_dir) / "volumes"
        self._images = images
        self._timeout = tool_timeout_s
        self._clock = clock
        self._busy: set[str] = set()
        self._creating: dict[str, str] = {}
        """Volume -> image of the overlays being made (their records come last)."""

    def path(self, name: str) -> Path:
        """The overlay file of volume ``name`` (whether or not it exists)."""
        qemuimg.check_name("volume", name, qemuimg.VOLUME_NAME)
        return self.dir / f"{name}.qcow2"

    def _meta(self, name: str) -> Path:
        return self.dir / f"{name}.json"

    def ensure_dirs(self) -> None:
        """Create the volumes directory (and its parents)."""
        self.dir.mkdir(parents=True, exist_ok=True)

    def get(self, name: str) -> Volume | None:
        """Volume ``name`` with its current size on disk, or None."""
        if not isinstance(name, str) or not qemuimg.VOLUME_NAME.match(name):
            return None
        try:
            vol = msgspec.json.decode(self._meta(name).read_bytes(), type=Volume)
            size = allocated_bytes(self.path(name))
        except FileNotFoundError:
            return None
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.error("volume %s: unreadable record: %s", name, exc)
            return None
        return msgspec.structs.replace(vol, size_bytes=size)

    def list(self) -> list[Volume]:
        """Every volume, by name."""
        if not self.dir.is_dir():
            return []
        out = []
        for meta in sorted(self.dir.glob("*.json")):
            if meta.name.startswith(TMP_PREFIX):
                continue
            vol = self.get(meta.stem)
            if vol is not None:
                out.append(vol)
        return out

    def users_of(self, image: str) -> builtins.list[str]:
        """The volumes over ``image`` (those being made included)."""
        made = {v.name for v in self.list() if v.image == image}
        return sorted(made | {v for v, i in self._creating.items() if i == image})

    @contextlib.contextmanager
    def _claim(self, name: str) -> Iterator[None]:
        if name in self._busy:
            raise StorageError(f"volume {name!r} is being changed by another request", "conflict")
        self._busy.add(name)
        try:
            yield
        finally:
            self._busy.discard(name)

    async def create(self, name: str, tenant: str, image: str) -> Volume:
        """A new overlay ``name`` of ``tenant`` over base ``image`` (copy-on-write).

        StorageError: "invalid" (a bad name), "not_found" (no such image), "conflict"
        (the volume exists), "failed" (qemu-img failed; nothing is left behind).
        """
        try:
            qemuimg.check_name("volume", name, qemuimg.VOLUME_NAME)
            qemuimg.check_name("tenant", tenant, qemuimg.TENANT_NAME)
        except ValueError as exc:
            raise StorageError(str(exc), "invalid") from None
        if self._images.get(image) is None:
            raise StorageError(f"no image {image!r}", "not_found")
        if self._meta(name).exists() or self.path(name).exists():
            raise StorageError(f"volume {name!r} exists already", "conflict")
        with self._claim(name):
            self._creating[name] = image
            self.ensure_dirs()
            tmp = self.dir / f"{TMP_PREFIX}{name}.{secrets.token_hex(4)}.qcow2"
            backing = f"../{self._images.dir.name}/{self._images.path(image).name}"
            try:
                await run_tool(
                    qemuimg.overlay_argv(backing, str(tmp)),
                    self._timeout,
                    f"volume {name!r}: creating the overlay over image {image!r}",
                )
                final = self.path(name)
                os.replace(tmp, final)
                vol = Volume(name=name, tenant=tenant, image=image, created_ts=self._clock())
                try:
                    write_json_atomic(self._meta(name), vol)
                except BaseException:
                    final.unlink(missing_ok=True)
                    raise
            finally:
                tmp.unlink(missing_ok=True)
                self._creating.pop(name, None)
        log.info("volume %s created for %s over %s", name, tenant, image)
        return msgspec.structs.replace(vol, size_bytes=allocated_bytes(final))

    def delete(self, name: str, missing_ok: bool = False) -> None:
        """Delete volume ``name`` (its data is gone); "not_found" unless ``missing_ok``."""
        if self.get(name) is None and not self.path(name).exists():
            if missing_ok:
                return
            raise StorageError(f"no volume {name!r}", "not_found")
        with self._claim(name):
            self._meta(name).unlink(missing_ok=True)
            self.path(name).unlink(missing_ok=True)
        log.info("volume %s deleted", name)

    def cleanup(self) -> builtins.list[str]:
        """Remove leftovers of interrupted creates and deletes (an overlay without its
        record, a record without its overlay: :func:`remove_leftovers`)."""
        return remove_leftovers(self.dir, "volumes")
