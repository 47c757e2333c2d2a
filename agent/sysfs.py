"""A root-bound, bounded, never-raising reader for sysfs.

Every path is relative to one root (``/sys`` in production, a fixture tree in tests) and
may not leave it, neither with ``..`` nor through a symlink.  An attribute is read once,
with at most ``max_bytes + 1`` bytes requested in total, so a driver that answers
``EAGAIN`` forever or a huge file cannot stall or bloat a collection cycle.

Errors are data, sorted into three kinds (:class:`ReadStatus`):

* ``MISSING``: the file does not exist (an optional attribute, or a device that vanished).
* ``NO_DATA``: the driver could not answer now (``EAGAIN``, ``EIO``, ``ENODATA``...).
* ``ERROR``: the file is there but unreadable (``EACCES``, ``EISDIR``, oversize, outside
  the root...): worth an error entry.

The reader is synchronous; a collector runs its whole scan in one worker thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import enum
import errno
import fnmatch
import functools
import itertools
import logging
import os
import posixpath
import re
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 64 * 1024
_PAGE = 4096
_MAX_LINK_DEPTH = 40
"""The largest attribute read in full; sysfs text attributes are at most one page."""

_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
_MISSING_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR})
_NO_DATA_ERRNOS = frozenset(
    {
        errno.EAGAIN,
        errno.EIO,
        errno.ENODATA,
        errno.EBUSY,
        errno.ETIMEDOUT,
        errno.ENXIO,
        errno.ENODEV,
    }
)
_ESCAPES = "path escapes the sysfs root"


class ReadStatus(enum.Enum):
    """How a read ended."""

    OK = "ok"
    MISSING = "missing"
    NO_DATA = "no_data"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class ReadResult:
    """One attribute read: ``text`` when OK, else ``error`` says why."""

    status: ReadStatus
    text: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        """True when ``text`` holds the attribute's contents."""
        return self.status is ReadStatus.OK


@dataclass(frozen=True, slots=True)
class DirListing:
    """A directory's entry names (naturally sorted), or why it could not be listed."""

    names: tuple[str, ...] = ()
    status: ReadStatus = ReadStatus.OK
    error: str | None = None


@dataclass(frozen=True, slots=True)
class OsCalls:
    """The OS calls the reader makes to read attributes and list directories; tests may
    fake them."""

    open: Callable[[str, int], int] = os.open
    read: Callable[[int, int], bytes] = os.read
    close: Callable[[int], None] = os.close
    listdir: Callable[[str], list[str]] = os.listdir


@functools.lru_cache(maxsize=8192)
def natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key that orders ``hwmon2`` before ``hwmon10``."""
    return tuple(
        (0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", name) if part
    )


def _escapes(rel: str) -> bool:
    """True when ``rel`` is absolute or its ``..`` parts climb above the root."""
    if rel.startswith("/"):
        return True
    if ".." not in rel:
        return False
    norm = posixpath.normpath(rel)
    return norm == ".." or norm.startswith("../")


def _classify(exc: OSError) -> ReadStatus:
    if exc.errno in _MISSING_ERRNOS:
        return ReadStatus.MISSING
    if exc.errno in _NO_DATA_ERRNOS:
        return ReadStatus.NO_DATA
    return ReadStatus.ERROR


def _describe(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0, "OSError")
    return f"{name}: {exc.strerror or exc}"


class SysfsReader:
    """Reads attributes and lists directories below ``root``; never raises ``OSError``."""

    def __init__(
        self,
        root: Path,
        max_bytes: int = DEFAULT_MAX_BYTES,
        os_calls: OsCalls | None = None,
    ) -> None:
        if max_bytes < 1:
            raise ValueError("max_bytes must be positive")
        self.root = Path(root)
        self.max_bytes = max_bytes
        self._os = os_calls or OsCalls()
        self._real_root = os.path.realpath(self.root)
        self._prefix = self._real_root.rstrip("/") + "/"
        self._physical: dict[str, str | None] = {}
        self._by_rel: dict[str, str | None] = {}

    def clear_cache(self) -> None:
        """Forget resolved symlinks; :func:`run_scan` calls it before each scan, so a
        hot-plugged device's links are followed afresh while one scan resolves each
        link only once."""
        self._physical.clear()
        self._by_rel.clear()

    def display(self, rel: str) -> str:
        """The path to show in an error entry for ``rel``."""
        return str(self.root / rel) if rel else str(self.root)

    def _child(self, base: str, name: str, depth: int) -> str | None:
        """The physical path of ``base/name`` (``base`` is physical); None on a loop.

        Like ``os.path.realpath`` but memoised per scan: a sysfs tree resolves the same
        ``device`` and ``bus/pci/devices`` links over and over.
        """
        path = os.path.join(base, name)
        if path in self._physical:
            return self._physical[path]
        try:
            is_link = stat.S_ISLNK(os.lstat(path).st_mode)
        except (OSError, ValueError):
            is_link = False  # absent: whoever opens it gets the errno
        result: str | None = path
        if is_link:
            try:
                target = os.readlink(path)
            except (OSError, ValueError):
                target = None
            if target is None or depth > _MAX_LINK_DEPTH:
                result = None
            else:
                result = self._walk("/" if posixpath.isabs(target) else base, target, depth + 1)
        self._physical[path] = result
        return result

    def _walk(self, base: str, rel: str, depth: int = 0) -> str | None:
        """Resolve ``rel`` component by component from the physical directory ``base``."""
        current: str | None = base
        for part in rel.split("/"):
            if current is None:
                return None
            if part in ("", "."):
                continue
            if part == "..":
                current = posixpath.dirname(current) or "/"
            else:
                current = self._child(current, part, depth)
        return current

    def _resolve_rel(self, rel: str) -> str | None:
        """The physical path of root-relative ``rel`` inside the root (memoised)."""
        if rel in self._by_rel:
            return self._by_rel[rel]
        real = self._by_rel[rel] = self._inside(self._walk(self._real_root, rel))
        return real

    def _inside(self, real: str | None) -> str | None:
        if real is None:
            return None
        return real if real == self._real_root or real.startswith(self._prefix) else None

    def _real(self, rel: str) -> str | None:
        """The symlink-free absolute path of ``rel``, or None if it is outside the root."""
        if _escapes(rel):
            return None
        return self._resolve_rel(rel)

    def _unresolved(self, rel: str) -> str | None:
        """``rel`` under its resolved parent, last component as is (None: outside)."""
        if _escapes(rel):
            return None
        parent, name = posixpath.split(rel.rstrip("/"))
        if name in ("", ".", ".."):
            return self._real(rel)
        real_parent = self._resolve_rel(parent)
        return None if real_parent is None else os.path.join(real_parent, name)

    def read(self, rel: str) -> ReadResult:
        """Read one attribute (decoded UTF-8, invalid bytes replaced; not stripped).

        Attributes are plain files, so the common path is one ``open(O_NOFOLLOW)``; an
        attribute that is a symlink (ELOOP) is resolved and checked against the root.
        """
        path = self._unresolved(rel)
        if path is None:
            return ReadResult(ReadStatus.ERROR, error=_ESCAPES)
        try:
            fd = self._os.open(path, _OPEN_FLAGS | os.O_NOFOLLOW)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                return ReadResult(_classify(exc), error=_describe(exc))
            real = self._real(rel)
            if real is None:
                return ReadResult(ReadStatus.ERROR, error=_ESCAPES)
            try:
                fd = self._os.open(real, _OPEN_FLAGS)
            except OSError as exc2:
                return ReadResult(_classify(exc2), error=_describe(exc2))
        try:
            return self._read_fd(fd)
        finally:
            with contextlib.suppress(OSError):
                self._os.close(fd)

    def _read_fd(self, fd: int) -> ReadResult:
        chunks: list[bytes] = []
        total = 0
        limit = self.max_bytes + 1
        while total < limit:
            try:
                chunk = self._os.read(fd, limit - total)
            except OSError as exc:
                return ReadResult(_classify(exc), error=_describe(exc))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if len(chunk) < _PAGE:
                break  # sysfs fills an attribute in one read of at most a page
        if total > self.max_bytes:
            return ReadResult(
                ReadStatus.ERROR, error=f"attribute larger than {self.max_bytes} bytes"
            )
        return ReadResult(ReadStatus.OK, text=b"".join(chunks).decode("utf-8", "replace"))

    def read_files(self, rel_dir: str, names: Iterable[str]) -> dict[str, ReadResult]:
        """Read several attributes of one directory, keyed by file name."""
        return {name: self.read(posixpath.join(rel_dir, name)) for name in names}

    def listdir(self, rel: str) -> DirListing:
        """The entry names of a directory (symlinks followed), naturally sorted."""
        real = self._real(rel)
        if real is None:
            return DirListing(status=ReadStatus.ERROR, error=_ESCAPES)
        try:
            names = self._os.listdir(real)
        except OSError as exc:
            return DirListing(status=_classify(exc), error=_describe(exc))
        return DirListing(names=tuple(sorted(names, key=natural_key)))

    def glob(self, rel_dir: str, pattern: str) -> tuple[str, ...]:
        """Entry names of ``rel_dir`` matching a shell pattern; empty when unlistable."""
        return tuple(n for n in self.listdir(rel_dir).names if fnmatch.fnmatchcase(n, pattern))

    def is_dir(self, rel: str) -> bool:
        """True when ``rel`` is (or links to) a directory inside the root."""
        real = self._real(rel)
        return real is not None and os.path.isdir(real)

    def readlink(self, rel: str) -> str | None:
        """The raw target of the symlink ``rel``, or None when it is no readable link."""
        real_parent = self._real(posixpath.dirname(rel))
        if real_parent is None:
            return None
        try:
            return os.readlink(os.path.join(real_parent, posixpath.basename(rel)))
        except (OSError, ValueError):
            return None

    def resolve(self, rel: str) -> str | None:
        """The root-relative, symlink-free path of ``rel`` when it exists inside the root.

        A dangling link, or one that points outside the root, gives None.
        """
        real = self._real(rel)
        if real is None or not os.path.exists(real):
            return None
        if real == self._real_root:
            return ""
        return real[len(self._real_root.rstrip("/")) + 1 :]


STUCK_SCAN_S = 5.0
"""A scan running longer than this is stuck in a driver read: later scans get a fresh
worker instead of queueing behind it."""

R = TypeVar("R")


class _ScanWorker:
    """One worker thread for every sysfs scan of the agent, replaced when it hangs.

    Scans are short and CPU-bound in Python: run concurrently on several threads they
    only contend for the GIL (measured: about 20 % more CPU per cycle), so they run one
    after another.  A read that never returns (some hwmon drivers block) must not blind
    the other collectors, so a worker busy for longer than ``STUCK_SCAN_S`` is abandoned
    (its thread ends whenever the read does) and a new one takes the next scans.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._pool = self._new_pool()
        self._started: dict[int, float] = {}
        self._ids = itertools.count()

    @staticmethod
    def _new_pool() -> concurrent.futures.ThreadPoolExecutor:
        return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="sysfs")

    def _stuck(self) -> bool:
        now = self._clock()
        return any(now - started > STUCK_SCAN_S for started in self._started.values())

    async def run(self, scan: Callable[[SysfsReader], R], reader: SysfsReader) -> R:
        if self._stuck():
            log.warning("a sysfs scan has hung for over %ss; starting a new worker", STUCK_SCAN_S)
            self._pool.shutdown(wait=False)
            self._pool = self._new_pool()
            self._started.clear()
        key = next(self._ids)

        def call() -> R:
            self._started[key] = self._clock()
            try:
                return scan(reader)
            finally:
                self._started.pop(key, None)

        return await asyncio.get_running_loop().run_in_executor(self._pool, call)


_worker: _ScanWorker | None = None


async def run_scan(scan: Callable[[SysfsReader], R], reader: SysfsReader) -> R:
    """Run one collector's whole scan off the event loop (see :class:`_ScanWorker`).

    Each scan starts from freshly resolved symlinks.
    """
    global _worker
    if _worker is None:
        _worker = _ScanWorker()
    reader.clear_cache()
    return await _worker.run(scan, reader)
