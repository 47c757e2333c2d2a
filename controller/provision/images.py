"""The region's base image registry: files under ``<data_dir>/images/``.

Layout (the storage host's file system is the registry's source of truth):

- ``<name>.qcow2``: the base image, always a standalone qcow2 (an uploaded raw file is
  converted), mode 0444: it is only ever opened read-only, as the backing file of the
  tenants' overlays (:mod:`volumes`);
- ``<name>.json``: its :class:`~metalguard.proto.provision.Image` record (msgspec JSON),
  written last (atomically): an image exists once its JSON does.  The service's KV keeps
  a copy for the API (``image.<name>``); this file is what the storage trusts.
- ``.tmp-*``: work files of a build or an upload in progress, removed when it fails and
  at :meth:`ImageRegistry.cleanup` (start-up): a crash leaves nothing half-made behind.

An image is built from a directory (``mke2fs -t ext4 -d DIR`` into a sparse raw file,
then ``qemu-img convert -O qcow2``) or from an uploaded file (qcow2 or raw, sniffed by
its magic, never probed by qemu-img, checked with ``qemu-img info``/``check``).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import hashlib
import logging
import os
import secrets
import stat
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import msgspec

from metalguard.controller.provision import qemuimg
from metalguard.controller.provision.tool import StorageError, ToolError, run_tool
from metalguard.proto.provision import Image

log = logging.getLogger(__name__)

TMP_PREFIX = ".tmp-"


def _hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _seal(path: Path) -> tuple[str, int]:
    """Make a finished image read-only and durable: its sha256 and its size in bytes."""
    path.chmod(0o444)
    digest = _hash_file(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return digest, path.stat().st_size


def _source_dir(name: str, src: Path) -> Path:
    """``src`` if it is an absolute path of a directory, else StorageError ("invalid")."""
    if not src.is_absolute():
        raise StorageError(f"image {name!r}: directory {str(src)!r} is not absolute", "invalid")
    if not src.is_dir():
        raise StorageError(
            f"image {name!r}: directory {str(src)!r} does not exist on the storage host",
            "invalid",
        )
    return src


def _source_head(name: str, src: Path) -> bytes:
    """The first bytes of the regular file ``src`` (its magic), else StorageError."""
    try:
        if not stat.S_ISREG(src.stat().st_mode):  # a FIFO or a device: never opened
            raise StorageError(f"image {name!r}: {str(src)!r} is not a regular file", "invalid")
        with src.open("rb") as f:
            return f.read(4)
    except OSError as exc:
        raise StorageError(f"image {name!r}: cannot read {str(src)!r}: {exc}", "invalid") from None


def _file_size(path: Path) -> int:
    return path.stat().st_size


def _sparse_file(path: Path, size: int) -> None:
    with path.open("wb") as f:
        f.truncate(size)


def write_json_atomic(path: Path, record: msgspec.Struct) -> None:
    """Write ``record`` as JSON to ``path`` through a temp file and a rename (fsynced)."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{secrets.token_hex(4)}")
    try:
        with tmp.open("wb") as f:
            f.write(msgspec.json.encode(record))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def remove_tmp_files(directory: Path) -> list[str]:
    """Remove the ``.tmp-*`` work files left in ``directory``; their names."""
    removed: list[str] = []
    for p in sorted(directory.glob(TMP_PREFIX + "*")):
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
            removed.append(p.name)
    return removed


def directory_allowed(directory: str | os.PathLike[str], roots: Iterable[str]) -> bool:
    """Whether ``directory`` (symlinks resolved) lies below one of ``roots``; any
    directory when ``roots`` is empty (``[provision] image_source_dirs``)."""
    wanted = [os.path.realpath(r) for r in roots]
    if not wanted:
        return True
    real = os.path.realpath(directory)
    return any(real == root or real.startswith(root.rstrip("/") + "/") for root in wanted)


def remove_leftovers(directory: Path, what: str) -> list[str]:
    """Remove what an interrupted add or delete left in ``directory`` (a registry of
    ``<name>.qcow2`` files, each committed by its ``<name>.json`` record): work files, a
    qcow2 without its record, a record without its qcow2; their names."""
    if not directory.is_dir():
        return []
    removed = remove_tmp_files(directory)
    for qcow in sorted(directory.glob("*.qcow2")):
        if not qcow.with_suffix(".json").exists():
            qcow.unlink(missing_ok=True)
            removed.append(qcow.name)
    for meta in sorted(directory.glob("*.json")):
        if not meta.with_suffix(".qcow2").exists():  # a record whose file is gone
            meta.unlink(missing_ok=True)
            removed.append(meta.name)
    if removed:
        log.warning("%s: removed leftovers %s", what, ", ".join(removed))
    return removed


class ImageRegistry:
    """Base images under ``<data_dir>/images``: add (dir or file), get, list, delete.

    ``in_use(name)`` (given by the storage) names the volumes over an image: such an
    image is not deleted.  Operations on one name are serialised; two adds of one name
    at once: exactly one wins, the other is a "conflict" StorageError.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        in_use: Callable[[str], Iterable[str]] = lambda _name: (),
        tool_timeout_s: float = 600.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.dir = Path(data_dir) / "images"
        self._in_use = in_use
        self._timeout = tool_timeout_s
        self._clock = clock
        self._busy: set[str] = set()

    # paths -------------------------------------------------------------------------

    def path(self, name: str) -> Path:
        """The qcow2 file of image ``name`` (whether or not it exists)."""
        qemuimg.check_name("image", name, qemuimg.IMAGE_NAME)
        return self.dir / f"{name}.qcow2"

    def _meta(self, name: str) -> Path:
        return self.dir / f"{name}.json"

    def _tmp(self, name: str, suffix: str) -> Path:
        return self.dir / f"{TMP_PREFIX}{name}.{secrets.token_hex(4)}{suffix}"

    def ensure_dirs(self) -> None:
        """Create the images directory (and its parents)."""
        self.dir.mkdir(parents=True, exist_ok=True)

    # queries -----------------------------------------------------------------------

    def get(self, name: str) -> Image | None:
        """The image ``name``, or None (an invalid name is None too: it cannot exist)."""
        if not isinstance(name, str) or not qemuimg.IMAGE_NAME.match(name):
            return None
        meta = self._meta(name)
        try:
            image = msgspec.json.decode(meta.read_bytes(), type=Image)
        except FileNotFoundError:
            return None
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.error("image %s: unreadable record %s: %s", name, meta, exc)
            return None
        return image if self.path(name).is_file() else None

    def list(self) -> list[Image]:
        """Every image, by name."""
        if not self.dir.is_dir():
            return []
        out = []
        for meta in sorted(self.dir.glob("*.json")):
            if meta.name.startswith(TMP_PREFIX):
                continue
            image = self.get(meta.stem)
            if image is not None:
                out.append(image)
        return out

    # mutations ---------------------------------------------------------------------

    @contextlib.contextmanager
    def _claim(self, name: str) -> Iterator[None]:
        if name in self._busy:
            raise StorageError(f"image {name!r} is being changed by another request", "conflict")
        self._busy.add(name)
        try:
            yield
        finally:
            self._busy.discard(name)

    def _check_new(self, name: str) -> None:
        try:
            qemuimg.check_name("image", name, qemuimg.IMAGE_NAME)
        except ValueError as exc:
            raise StorageError(str(exc), "invalid") from None
        if self.get(name) is not None or self._meta(name).exists():
            raise StorageError(f"image {name!r} exists already", "conflict")

    async def add_from_dir(
        self, name: str, directory: str | os.PathLike[str], size_bytes: int
    ) -> Image:
        """Build image ``name``: an ext4 file system of ``size_bytes`` holding ``directory``.

        ``directory`` is a path on the storage host (read as the controller's user).
        StorageError ("invalid") for a bad name/size or a missing directory, ("conflict")
        for an existing name, ("failed") when mke2fs/qemu-img fail (a too small size:
        mke2fs says so); nothing is left behind on a failure.
        """
        self._check_new(name)
        try:
            size = qemuimg.check_dir_size(size_bytes)
        except ValueError as exc:
            raise StorageError(f"image {name!r}: {exc}", "invalid") from None
        src = _source_dir(name, Path(directory))
        with self._claim(name):
            self.ensure_dirs()
            raw = self._tmp(name, ".raw")
            qcow = self._tmp(name, ".qcow2")
            try:
                _sparse_file(raw, size)
                await run_tool(
                    qemuimg.mke2fs_argv(str(raw), str(src), name),
                    self._timeout,
                    f"image {name!r}: building the file system from {str(src)!r}",
                )
                await run_tool(
                    qemuimg.convert_argv(str(raw), "raw", str(qcow)),
                    self._timeout,
                    f"image {name!r}: converting to qcow2",
                )
                raw.unlink()
                return await self._commit(name, qcow, f"dir:{src}")
            finally:
                raw.unlink(missing_ok=True)
                qcow.unlink(missing_ok=True)

    async def add_file(self, name: str, path: str | os.PathLike[str]) -> Image:
        """Register the image file at ``path`` (qcow2 or raw) as image ``name``.

        The file is copied (converted to a standalone qcow2); ``path`` itself is left as
        it is (the API's upload temp file: its caller removes it).  StorageError
        ("invalid") for a missing, empty, corrupt or unsafe file (a backing file, an
        external data file, encryption), with every reason.
        """
        self._check_new(name)
        src = Path(path)
        fmt = qemuimg.sniff_format(_source_head(name, src))
        with self._claim(name):
            self.ensure_dirs()
            qcow = self._tmp(name, ".qcow2")
            what = f"image {name!r}: {src.name} is not a valid {fmt} image"
            try:
                out = await _run_invalid(qemuimg.info_argv(str(src), fmt), self._timeout, what)
                try:
                    qemuimg.check_upload(qemuimg.parse_info(out), fmt, _file_size(src))
                except ValueError as exc:
                    raise StorageError(f"image {name!r}: {exc}", "invalid") from None
                if fmt == "qcow2":
                    await self._check_qcow2(src, what)
                argv = qemuimg.convert_argv(str(src), fmt, str(qcow))
                await _run_invalid(argv, self._timeout, what)
                return await self._commit(name, qcow, f"upload:{src.name}")
            finally:
                qcow.unlink(missing_ok=True)

    async def _check_qcow2(self, path: Path, what: str) -> None:
        out = await _run_invalid(qemuimg.check_argv(str(path)), self._timeout, what, (0, 3))
        try:
            corruptions, errors = qemuimg.parse_check(out)
        except ValueError as exc:
            raise StorageError(f"{what}: {exc}", "invalid") from None
        if corruptions or errors:
            raise StorageError(
                f"{what}: qemu-img check found {corruptions} corruptions, {errors} errors",
                "invalid",
            )

    async def _commit(self, name: str, qcow: Path, source: str) -> Image:
        """Move the finished ``qcow`` into place and write its record (the commit point)."""
        info = qemuimg.parse_info(
            await run_tool(qemuimg.info_argv(str(qcow), "qcow2"), self._timeout, f"image {name!r}")
        )
        digest, size = await asyncio.to_thread(_seal, qcow)
        image = Image(
            name=name,
            format="qcow2",
            size_bytes=size,
            virtual_size=info.virtual_size,
            sha256=digest,
            created_ts=self._clock(),
            source=source,
        )
        self._install(qcow, image)
        log.info("image %s added (%s, %d bytes)", name, source, image.size_bytes)
        return image

    def _install(self, qcow: Path, image: Image) -> None:
        final = self.path(image.name)
        os.replace(qcow, final)
        try:
            write_json_atomic(self._meta(image.name), image)
        except BaseException:
            final.unlink(missing_ok=True)
            raise

    async def delete(self, name: str) -> None:
        """Delete image ``name``: "not_found" if absent, "conflict" while volumes use it."""
        if self.get(name) is None:
            raise StorageError(f"no image {name!r}", "not_found")
        users = sorted(self._in_use(name))
        if users:
            raise StorageError(
                f"image {name!r} is the base of volumes {', '.join(users)}: delete them first",
                "conflict",
            )
        with self._claim(name):
            self._meta(name).unlink(missing_ok=True)  # uncommit first
            self.path(name).unlink(missing_ok=True)
        log.info("image %s deleted", name)

    def cleanup(self) -> builtins.list[str]:
        """Remove leftovers of interrupted adds and deletes (:func:`remove_leftovers`)."""
        return remove_leftovers(self.dir, "images")


async def _run_invalid(
    argv: list[str], timeout_s: float, what: str, ok_codes: tuple[int, ...] = (0,)
) -> str:
    """run_tool, a failure being the input's fault ("invalid": the file is bad)."""
    try:
        return await run_tool(argv, timeout_s, what, ok_codes)
    except ToolError as exc:
        raise StorageError(exc.message, "invalid") from None
