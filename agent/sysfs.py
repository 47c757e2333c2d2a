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

A collector that names the directories listing its devices (``watch`` in :func:`run_scan`)
keeps what the reader learnt of the tree's shape (resolved links, listings, absent
attributes) from one scan to the next while those listings stay the same, and on sysfs
itself keeps its attributes' descriptors open and re-reads them with ``pread`` at offset
0.  Anything that looks like a change (a watched listing differs, a known attribute is
gone, a kept descriptor fails) falls back to what a fresh reader does, so readings and
errors are the same as reading everything afresh.
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
import resource
import stat
import time
import weakref
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
_UNKNOWN = "\0"
"""Not yet looked up (no path holds a NUL byte)."""


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
    pread: Callable[[int, int, int], bytes] = os.pread


REFRESH_SCANS = 60
"""A reader that keeps the tree's shape across scans still learns it afresh every this
many scans (at a 5 s interval, every 5 minutes): an attribute added to a device that
stayed is found then at the latest."""

MAX_KEPT_FDS = 256
"""At most this many attribute descriptors kept open per reader (and at most an eighth of
the soft ``RLIMIT_NOFILE``); reads past it open and close as usual."""

_SYSFS_TYPES = frozenset({"sysfs"})


def mount_fs_type(path: str, mountinfo: str) -> str | None:
    """The file-system type of the mount holding the absolute, symlink-free ``path``,
    from ``/proc/self/mountinfo`` text (pure): the longest mount point above it."""
    best, fs_type = -1, None
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5 or not right:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4])
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= best:
            best, fs_type = len(point), right.split()[0]
    return fs_type


def on_sysfs(path: str, mountinfo: Path = Path("/proc/self/mountinfo")) -> bool:
    """True when ``path`` is on a sysfs mount (kernfs: a descriptor of a removed
    attribute fails with ENODEV instead of reading stale text); False when unknown."""
    try:
        text = mountinfo.read_text(errors="replace")
    except OSError:
        return False
    return mount_fs_type(path, text) in _SYSFS_TYPES


def _fd_budget() -> int:
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (OSError, ValueError):
        soft = 1024
    if soft == resource.RLIM_INFINITY:
        return MAX_KEPT_FDS
    return max(0, min(MAX_KEPT_FDS, soft // 8))


def _close_fds(close: Callable[[int], None], fds: dict[str, int]) -> None:
    for fd in fds.values():
        with contextlib.suppress(OSError):
            close(fd)
    fds.clear()


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
        *,
        keep_open: bool | None = None,
        refresh_scans: int = REFRESH_SCANS,
    ) -> None:
        """``keep_open``: keep attribute descriptors across scans (None: only on sysfs,
        where a removed attribute's descriptor fails instead of reading stale text)."""
        if max_bytes < 1:
            raise ValueError("max_bytes must be positive")
        self.root = Path(root)
        self.max_bytes = max_bytes
        self._os = os_calls or OsCalls()
        self._real_root = os.path.realpath(self.root)
        self._prefix = self._real_root.rstrip("/") + "/"
        self._physical: dict[str, str | None] = {}
        self._by_rel: dict[str, str | None] = {}
        self._paths: dict[str, str | None] = {}
        """rel -> the path opened for it (last component as is); None: outside the root."""
        self._listings: dict[str, DirListing] = {}
        self._dirs: set[str] = set()
        self._resolved: dict[str, str] = {}
        self._absent: dict[str, ReadResult] = {}
        """Attributes found missing since the shape was last learnt."""
        self._seen: set[str] = set()
        """Paths read since the shape was last learnt: one of them missing is a change."""
        self._fds: dict[str, int] = {}
        keep = on_sysfs(self._real_root) if keep_open is None else keep_open
        self._fd_limit = _fd_budget() if keep else 0
        self._refresh_scans = refresh_scans
        self._scans = 0
        self._keep_shape = False
        self.changed = False
        """Set by a read that found a known attribute gone: the scan saw a stale shape."""
        self._finalizer = weakref.finalize(self, _close_fds, self._os.close, self._fds)

    @property
    def kept_fds(self) -> int:
        """How many attribute descriptors are open across scans now."""
        return len(self._fds)

    def clear_cache(self) -> None:
        """Forget everything learnt of the tree (links, listings, absent attributes) and
        close kept descriptors: the next reads see the tree afresh."""
        self._physical.clear()
        self._by_rel.clear()
        self._paths.clear()
        self._listings.clear()
        self._dirs.clear()
        self._resolved.clear()
        self._absent.clear()
        self._seen.clear()
        _close_fds(self._os.close, self._fds)
        self._scans = 0
        self._keep_shape = False

    def close(self) -> None:
        """Close the kept descriptors (the reader stays usable)."""
        self.clear_cache()

    def begin_scan(self, watch: tuple[str, ...] = ()) -> None:
        """Start a scan.  Without ``watch``, forget the tree (each scan resolves links
        afresh).  With it, keep the shape learnt by earlier scans while each watched
        directory (the listing of a collector's devices) lists the same names, fewer than
        ``refresh_scans`` scans have used it, and no read found a known attribute gone."""
        self.changed = False
        if not watch:
            self.clear_cache()
            return
        fresh = {rel: self._list_now(rel) for rel in watch}
        if (
            not self._keep_shape
            or self._scans >= self._refresh_scans
            or any(self._listings.get(rel) != listing for rel, listing in fresh.items())
        ):
            self.clear_cache()
        self._keep_shape = True
        self._scans += 1
        for rel, listing in fresh.items():
            if listing.status is ReadStatus.OK:
                self._listings[rel] = listing

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
        A kept descriptor is re-read with ``pread``; if that fails, the attribute is
        opened afresh and that read's result is the answer.
        """
        path = self._paths.get(rel, _UNKNOWN)
        if path is _UNKNOWN:
            path = self._paths[rel] = self._unresolved(rel)
        if path is None:
            return ReadResult(ReadStatus.ERROR, error=_ESCAPES)
        absent = self._absent.get(rel)
        if absent is not None:
            return absent
        fd = self._fds.get(path)
        if fd is not None:
            kept = self._read_fd(fd, kept=True)
            if kept is not None:
                return kept
            del self._fds[path]
            with contextlib.suppress(OSError):
                self._os.close(fd)
        result = self._open_and_read(rel, path)
        if result.status is ReadStatus.MISSING:
            if path in self._seen:
                self.changed = True
            elif self._keep_shape:
                self._absent[rel] = result
        else:
            self._seen.add(path)
        return result

    def _open_and_read(self, rel: str, path: str) -> ReadResult:
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
        keep = False
        try:
            result = self._read_fd(fd, kept=False) or ReadResult(ReadStatus.NO_DATA)
            keep = result.ok and self._keep_shape and len(self._fds) < self._fd_limit
            if keep:
                self._fds[path] = fd
            return result
        finally:
            if not keep:
                with contextlib.suppress(OSError):
                    self._os.close(fd)

    def _read_fd(self, fd: int, *, kept: bool) -> ReadResult | None:
        """Read ``fd`` from offset 0 (``pread`` when kept, else ``read``), at most
        ``max_bytes + 1`` bytes; None when a kept descriptor fails (re-open it)."""
        limit = self.max_bytes + 1
        size = min(limit, _PAGE)
        try:
            chunk = self._os.pread(fd, size, 0) if kept else self._os.read(fd, size)
        except OSError as exc:
            return None if kept else ReadResult(_classify(exc), error=_describe(exc))
        if len(chunk) < size:  # the common case: the whole attribute in one read
            return ReadResult(ReadStatus.OK, chunk.decode("utf-8", "replace"))
        chunks = [chunk]
        total = len(chunk)
        while total < limit:
            size = min(limit - total, _PAGE)
            try:
                chunk = self._os.pread(fd, size, total) if kept else self._os.read(fd, size)
            except OSError as exc:
                return None if kept else ReadResult(_classify(exc), error=_describe(exc))
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
        return ReadResult(ReadStatus.OK, b"".join(chunks).decode("utf-8", "replace"))

    def read_files(self, rel_dir: str, names: Iterable[str]) -> dict[str, ReadResult]:
        """Read several attributes of one directory, keyed by file name."""
        read = self.read
        if not rel_dir:
            return {name: read(name) for name in names}
        return {name: read(f"{rel_dir}/{name}") for name in names}

    def listdir(self, rel: str) -> DirListing:
        """The entry names of a directory (symlinks followed), naturally sorted."""
        known = self._listings.get(rel)
        if known is not None:
            return known
        listing = self._list_now(rel)
        if self._keep_shape and listing.status is ReadStatus.OK:
            self._listings[rel] = listing
        return listing

    def _list_now(self, rel: str) -> DirListing:
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
        if rel in self._dirs:
            return True
        real = self._real(rel)
        found = real is not None and os.path.isdir(real)
        if found and self._keep_shape:
            self._dirs.add(rel)
        return found

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
        known = self._resolved.get(rel)
        if known is not None:
            return known
        real = self._real(rel)
        if real is None or not os.path.exists(real):
            return None
        found = "" if real == self._real_root else real[len(self._real_root.rstrip("/")) + 1 :]
        if self._keep_shape:
            self._resolved[rel] = found
        return found


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


async def run_scan(
    scan: Callable[[SysfsReader], R], reader: SysfsReader, *, watch: tuple[str, ...] = ()
) -> R:
    """Run one collector's whole scan off the event loop (see :class:`_ScanWorker`).

    Without ``watch``, each scan starts from freshly resolved symlinks.  With it (the
    directories listing the collector's devices), the reader keeps the tree's shape while
    they list the same names (:meth:`SysfsReader.begin_scan`); a scan that found a known
    attribute gone is run again on a forgotten shape, so its result is a fresh scan's.
    """
    global _worker
    if _worker is None:
        _worker = _ScanWorker()

    def scan_once(r: SysfsReader) -> R:
        r.begin_scan(watch)
        result = scan(r)
        if r.changed:
            r.clear_cache()
            r.begin_scan(watch)
            result = scan(r)
        return result

    return await _worker.run(scan_once, reader)
