"""The provisioning service's storage: images, tenant volumes and their NBD exports.

:class:`QemuStorage` implements :class:`VolumeBackend` with qemu-img (copy-on-write
qcow2 overlays, :mod:`volumes`) and one qemu-storage-daemon behind the NBD gate, which
never lists the export names (:mod:`exports`, :mod:`nbdgate`); its
``images`` is the :class:`ImageRegistry` (:mod:`images`).  Everything lives under one
``data_dir`` on the storage host::

    <data_dir>/images/<name>.qcow2   base images (0444, only ever read)
    <data_dir>/images/<name>.json    their Image records (the storage's source of truth)
    <data_dir>/volumes/<name>.qcow2  tenant overlays over a base
    <data_dir>/volumes/<name>.json   their Volume records (tenant, image)
    <data_dir>/run/                  the daemons' sockets, pid files, the gate's address, log

The service keeps copies of the Image/Volume records in its KV for the API; the files
here decide what exists.  Every failure is a :class:`StorageError` (``kind`` ->
``status``: 400 invalid, 404 not_found, 409 conflict, 502 failed).

An export is named by the instance's secret (``Instance.export``: 16-128 of
``[A-Za-z0-9_.-]``) and is writable; what a node attaches is :class:`ExportInfo`
(``nbd_host``/``nbd_port`` as the nodes reach the server, which may differ from where it
listens).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from metalguard.controller.provision import nbdplan
from metalguard.controller.provision.exports import ExportServer
from metalguard.controller.provision.images import ImageRegistry
from metalguard.controller.provision.tool import StorageError
from metalguard.controller.provision.volumes import VolumeStore
from metalguard.proto.provision import Volume

__all__ = [
    "ExportInfo",
    "ImageRegistry",
    "QemuStorage",
    "StorageError",
    "VolumeBackend",
]


@dataclass(frozen=True)
class ExportInfo:
    """What a node attaches: ``nbd://host:port/name`` (``nbdroot=host,port,name``)."""

    host: str
    port: int
    name: str


class VolumeBackend(Protocol):
    """Tenant volumes and their exports, as the ProvisionService uses them."""

    async def create_volume(self, name: str, tenant: str, image: str) -> Volume:
        """A new copy-on-write volume of ``tenant`` over base ``image``."""
        ...

    async def delete_volume(self, name: str) -> None:
        """Delete volume ``name`` and its data (refused while it is exported)."""
        ...

    async def list_volumes(self) -> list[Volume]:
        """Every volume, with its size on disk."""
        ...

    async def export(self, volume: str, export_name: str) -> ExportInfo:
        """Serve ``volume`` over NBD as ``export_name`` (writable); where to attach it."""
        ...

    async def unexport(self, export_name: str) -> None:
        """Stop serving ``export_name`` (idempotent)."""
        ...

    async def list_exports(self) -> list[str]:
        """The export names served now."""
        ...


class QemuStorage:
    """VolumeBackend over qemu-img and one qemu-storage-daemon, under ``data_dir``.

    ``listen_host:listen_port`` is where the NBD server listens; ``nbd_host:nbd_port``
    (default: the same) is the address handed to nodes.  Call :meth:`start` (with the
    exports the live instances want: export name -> volume name) before exporting, and
    :meth:`close` at the end (the daemon keeps running unless ``stop_daemon``).
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        listen_host: str = "127.0.0.1",
        listen_port: int = 10809,
        nbd_host: str = "",
        nbd_port: int = 0,
        tool_timeout_s: float = 600.0,
        clock: Callable[[], float] = time.time,
        on_restart: Callable[[str], None] | None = None,
        daemon_binary: str = "qemu-storage-daemon",
    ) -> None:
        self.data_dir = Path(data_dir).absolute()
        self.nbd_host = nbd_host or listen_host
        self.nbd_port = nbd_port or listen_port
        self.images = ImageRegistry(
            self.data_dir,
            in_use=lambda image: self.volumes.users_of(image),
            tool_timeout_s=tool_timeout_s,
            clock=clock,
        )
        self.volumes = VolumeStore(
            self.data_dir, self.images, tool_timeout_s=tool_timeout_s, clock=clock
        )
        self.server = ExportServer(
            self.data_dir / "run",
            listen_host,
            listen_port,
            binary=daemon_binary,
            on_restart=on_restart,
        )

    # lifecycle ---------------------------------------------------------------------

    async def start(self, wanted: Mapping[str, str] = {}) -> list[str]:
        """Create the directories, remove leftovers of interrupted operations, adopt or
        start the export daemon and serve exactly ``wanted`` (export name -> volume
        name); the exports it removed or could not restore (logged), by name.

        A wanted export whose volume does not exist (or whose name is invalid) is not
        served (and reported).  StorageError when a daemon cannot be started (the port
        taken, the binary missing) or a running one does not answer (then call
        :meth:`close`: the supervisor is not running).  Only the region's leader may
        call it: the daemon takes one QMP connection.
        """
        self.images.ensure_dirs()
        self.volumes.ensure_dirs()
        self.images.cleanup()
        self.volumes.cleanup()
        paths, missing = self._paths(wanted)
        result = await self.server.start(paths)
        removed = [nbdplan.name_of_id(eid) or eid for eid in result.remove_exports]
        lost = [n for n in paths if n not in self.server.wanted]
        return sorted({*removed, *missing, *lost} - set(self.server.wanted))

    async def reconcile(self, wanted: Mapping[str, str]) -> list[str]:
        """Serve exactly ``wanted`` (export name -> volume name) from now on: a new
        leader's view of its instances.  The exports removed or not restorable."""
        paths, missing = self._paths(wanted)
        result = await self.server.reconcile(paths)
        removed = [nbdplan.name_of_id(eid) or eid for eid in result.remove_exports]
        return sorted({*removed, *missing} - set(self.server.wanted))

    async def close(self, stop_daemon: bool = False) -> None:
        """Stop supervising the daemon; ``stop_daemon`` ends it too (tests, uninstall)."""
        await self.server.close(stop_daemon=stop_daemon)

    def _paths(self, wanted: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
        paths: dict[str, str] = {}
        missing: list[str] = []
        for export_name, volume in wanted.items():
            if not nbdplan.EXPORT_NAME.match(export_name) or self.volumes.get(volume) is None:
                missing.append(export_name)
            else:
                paths[export_name] = str(self.volumes.path(volume))
        return paths, missing

    # volumes -----------------------------------------------------------------------

    async def create_volume(self, name: str, tenant: str, image: str) -> Volume:
        """A new overlay ``name`` of ``tenant`` over base ``image`` (kilobytes on disk).

        StorageError: invalid name (400), no such image (404), the volume exists (409),
        qemu-img failed (502).
        """
        return await self.volumes.create(name, tenant, image)

    async def delete_volume(self, name: str, missing_ok: bool = False) -> None:
        """Delete volume ``name``: 404 if absent (unless ``missing_ok``), 409 while it is
        exported (unexport it first)."""
        if self.volumes.get(name) is not None:
            path = str(self.volumes.path(name))
            if path in self.server.wanted.values():
                raise StorageError(f"volume {name!r} is exported: unexport it first", "conflict")
        self.volumes.delete(name, missing_ok=missing_ok)

    async def list_volumes(self) -> list[Volume]:
        """Every volume with its size on disk, by name."""
        return self.volumes.list()

    async def get_volume(self, name: str) -> Volume | None:
        """Volume ``name`` with its size on disk, or None."""
        return self.volumes.get(name)

    # exports -----------------------------------------------------------------------

    async def export(self, volume: str, export_name: str) -> ExportInfo:
        """Serve ``volume`` as the writable NBD export ``export_name``.

        Idempotent for the same pair.  StorageError: a bad export name (400), no such
        volume (404), the name or the volume exported already otherwise (409), the
        daemon refused or is down (502).
        """
        if self.volumes.get(volume) is None:
            raise StorageError(f"no volume {volume!r}", "not_found")
        await self.server.add(export_name, str(self.volumes.path(volume)))
        return ExportInfo(self.nbd_host, self.nbd_port, export_name)

    async def unexport(self, export_name: str) -> None:
        """Stop serving ``export_name``: a node still attached is cut off; idempotent."""
        await self.server.remove(export_name)

    async def list_exports(self) -> list[str]:
        """The export names the daemon serves now."""
        return await self.server.names()

    def exported_volumes(self) -> dict[str, str]:
        """Export name -> volume name, as wanted now (no daemon round trip)."""
        return {n: Path(p).stem for n, p in self.server.wanted.items()}
