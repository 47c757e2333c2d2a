"""The node-local dataset cache: whole files of a :class:`~.source.Source` on local disk.

:class:`CacheStore` is what the FUSE mount and the ``mgcache::`` fsspec file system sit on:
``stat``/``listdir`` answer from the source's (TTL-cached) metadata, ``read`` serves a
range of a file from its cached copy, fetching the whole file first on a miss.

On disk (``cache_dir``)::

    cache.json                 the source this directory caches (another source: wiped)
    stats.json                 the figures (stats.py), rewritten every stats_interval_s
    tmp/                       fills in progress (emptied at open)
    objects/ab/<h>-<gen>       a complete copy of one source file (h: sha1 of its path)
    objects/ab/<h>-<gen>.meta  its record: path, size, source version, when filled

Design notes
------------
* Never a partial file.  A fill streams into ``tmp/``, is checked against the expected
  size, then renamed into ``objects/`` — only then does the store serve it.  Its
  ``.meta`` record is written after the rename (by a committer thread, after an fsync of
  the data when ``durable``), so a crash between data and record leaves a data file
  without a record, which :meth:`CacheStore.open` deletes; a record whose data is missing
  or of the wrong size is deleted too.  ``<gen>`` is unique per fill, so a late unlink of
  an evicted copy can never hit its successor.
* Source changes.  Each cached copy records its source version (size, mtime, ETag) and
  is served only until ``metadata_ttl_s`` after the source last confirmed it: a read past
  that checks it first (the source's listing cache answers without a round trip inside
  its own TTL); a different version drops the copy and fetches the file again.  While the
  dataset is read, a background check (revalidate.py) confirms copies *before* their
  time runs out, in batches, so hits do not pay that check; it spends at most one source
  request per hit.  Recovered copies are checked on first use (or by it).
* A miss costs one request: it starts from the source's last entry of the file, however
  old, where the fetch checks the version of the bytes itself (a local copy's fstat, an
  http GET's headers: :meth:`Source.stat_for_fetch`); a fetch of another version starts
  over once from a fresh stat.  A stale entry never reads through: :meth:`_current`
  makes it current with one versioned GET kept as the file's read-through window.
* Deletions off the reader's thread.  Evicted and dropped copies are unlinked by the
  janitor (janitor.py); until then their bytes still count: a fill writes its first
  byte only when ``used + reserved + pending deletions <= max_bytes``.
* Size bound.  ``used_bytes + reserved <= max_bytes`` at every moment: a fill reserves its
  file's size (and has the policy name its victims, evicted first) before it fetches;
  on disk, copies still being deleted count too (above).
  Files larger than ``max_bytes`` are read through (a counted warning).
* Free-space floor.  Below ``min_free_bytes`` free on the cache's file system (statvfs,
  minus what fills in flight will write), and after ENOSPC/EIO writing a fill (for
  ``TROUBLE_BACKOFF_S``), the store reads through: counted, logged (at most once per
  ``WARN_EVERY_S`` per kind), never an error to the reader.
* Read-through.  A file the cache does not take is read from the source in windows
  (readthrough.py: the whole file up to 16 MiB, else 8 MiB at a time), kept in memory
  for the chunks that follow, so a FUSE reader costs one request per file, as a direct
  reader does, not one per chunk.
* One fetch per missing file: concurrent readers of a file being filled wait for that
  fill (an Event) and then read the copy.
* A source that does not answer a version check (down, timing out: anything but "not
  found") does not fail hits: the cached copy is served unchecked, with a counted
  warning, and checked again after ``SOURCE_RETRY_S``.  Misses return the source's error.
* Hits are cheap: one lock section (a dict lookup, the policy's and the pattern
  detector's bookkeeping, counters), an fd from a bounded fd cache (``FD_CACHE``; an fd
  is closed only when no read is using it, so a read never sees a recycled fd), and
  ``os.pread`` outside the lock; a second short lock section releases the fd.
* Accesses.  A read at offset 0 is a file access (a hit or a miss in the counters, an
  access for the policy and the pattern detector); reads further into a file only count
  bytes.  :meth:`CacheStore.cached_path` and :meth:`CacheStore.open_file` count one access
  each.
* Prefetch.  When the policy wants it (``pin``, ``auto`` on sequential readers) and the
  pattern is ``sequential``, each access queues the next ``prefetch_depth`` files of its
  directory (name order) for a pool of ``prefetch_workers`` threads; at most
  ``PREFETCH_QUEUE`` are queued, the rest are dropped.  Prefetches go through the same
  admission as misses (they never evict what the policy keeps); a file the policy does
  not take is prefetched into the read-through windows instead (memory, bounded).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import heapq
import logging
import math
import os
import posixpath
import queue
import shutil
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import msgspec

from metalguard.agent.cache.janitor import Janitor
from metalguard.agent.cache.pattern import SEQUENTIAL, Pattern, PatternDetector
from metalguard.agent.cache.policy import (
    CLASSIFY_EVERY,
    POLICIES,
    AutoPolicy,
    make_policy,
)
from metalguard.agent.cache.readthrough import ReadThrough
from metalguard.agent.cache.revalidate import Revalidator
from metalguard.agent.cache.source import Entry, Source, normalize, open_source
from metalguard.agent.cache.stats import Counters, stats_path, write_stats
from metalguard.proto.telemetry import DatasetCache

log = logging.getLogger(__name__)

GIB = 1024**3
FD_CACHE = 256
"""Open fds kept for cached files (least recently read closed first)."""
PREFETCH_QUEUE = 64
TROUBLE_BACKOFF_S = 5.0
"""After ENOSPC/EIO on the cache disk, reads go through for this long before a retry."""
WARN_EVERY_S = 10.0
SOURCE_RETRY_S = 5.0
"""A cached copy whose version check failed (the source did not answer) is served
unchecked for this long before the next check."""
READTHROUGH_BYTES = 128 * 1024 * 1024
"""Memory for the read-through windows (readthrough.py) of files the cache does not take."""
ROOM_WAIT_S = 30.0
"""How long a fill waits for the janitor to delete dropped copies before it writes."""
FORMAT = 1
BUCKETS = 256
"""``objects/00`` .. ``objects/ff``: created once at open."""


class _Meta(msgspec.Struct, frozen=True):
    """An ``objects/*.meta`` record."""

    path: str
    size: int
    mtime: float
    etag: str
    filled: float
    data: str
    """The data file's name (beside the record)."""


@dataclass(eq=False, slots=True)
class _Object:
    key: str
    size: int
    version: tuple[int, float, str]
    data: Path
    checked_until: float
    fd: int = -1
    refs: int = 0
    release_fd: bool = False
    dead: bool = False
    last_read: float = 0.0
    """When it was last read as a whole (a file access; its fill counts)."""
    reread_s: float = math.inf
    """The time between its last two file reads (inf: read once so far)."""

    def touch(self, now: float) -> None:
        """A file read of this copy at ``now``."""
        if self.last_read:
            self.reread_s = now - self.last_read
        self.last_read = now


@dataclass(eq=False, slots=True)
class _Fill:
    entry: Entry
    done: threading.Event = field(default_factory=threading.Event)
    ok: bool = False
    changed: bool = False
    """The source file was not the version ``entry`` names (found while fetching)."""
    prefetch: bool = False
    """Started by the sequential prefetch (not by a reader)."""


_CHANGED = object()
"""What a fill attempt answers when the file was not the version it was started with."""


class _Sink:
    """A fill's file, as :meth:`Source.fetch_to` writes it: the first write (or fileno,
    for a local copy) first waits until the store's bound leaves room on disk for it
    (dropped copies still being deleted count, janitor.py)."""

    def __init__(self, f: IO[bytes], wait_for_room: Callable[[], None]) -> None:
        self._f = f
        self._wait = wait_for_room
        self._ready = False

    def _room(self) -> None:
        if not self._ready:
            self._wait()
            self._ready = True

    def write(self, data: bytes, /) -> int:
        self._room()
        return self._f.write(data)

    def fileno(self) -> int:
        self._room()
        self._f.flush()
        return self._f.fileno()


class CacheStore:
    """A whole-file read cache of one dataset (thread-safe; see the module doc).

    ``source``: a :class:`Source` or a path/fsspec URL (opened with ``metadata_ttl_s``,
    ``clock`` and ``storage_options``).  ``clock``: wall-clock seconds, for the metadata
    TTL and the stats' ``ts`` (tests inject one).  ``stats_interval_s``: when set,
    :meth:`open` starts a thread writing ``stats.json`` that often (and :meth:`close`
    writes it once more).  ``durable``: fsync each copy before its record is written
    (power-loss safety; off: a process crash is still safe).  ``revalidate_ahead``: check
    cached copies against the source on a thread before their TTL runs out
    (revalidate.py; off, :meth:`revalidate` runs a pass on demand: tests)."""

    def __init__(
        self,
        source: Source | str,
        cache_dir: str | os.PathLike[str],
        max_bytes: int,
        policy: str = "auto",
        *,
        dataset: str = "",
        mountpoint: str = "",
        min_free_bytes: int = GIB,
        metadata_ttl_s: float = 30.0,
        clock: Callable[[], float] = time.time,
        prefetch_depth: int = 4,
        prefetch_workers: int = 4,
        stats_interval_s: float | None = None,
        durable: bool = True,
        readthrough_bytes: int = READTHROUGH_BYTES,
        storage_options: dict[str, Any] | None = None,
        revalidate_ahead: bool = True,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown cache policy {policy!r} (one of {', '.join(POLICIES)})")
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, not {max_bytes}")
        if isinstance(source, str):
            source = open_source(
                source, metadata_ttl_s=metadata_ttl_s, clock=clock, **(storage_options or {})
            )
        self.source = source
        self.cache_dir = Path(cache_dir)
        self.max_bytes = max_bytes
        self.policy_name = policy
        self.dataset = dataset or posixpath.basename(source.root.rstrip("/")) or "dataset"
        self.mountpoint = mountpoint
        self.min_free_bytes = min_free_bytes
        self.metadata_ttl_s = metadata_ttl_s
        self.prefetch_depth = prefetch_depth
        self.stats_interval_s = stats_interval_s
        self.durable = durable
        self._clock = clock
        self._objects_dir = self.cache_dir / "objects"
        self._tmp_dir = self.cache_dir / "tmp"

        self._lock = threading.Lock()
        self._objects: dict[str, _Object] = {}
        self._fills: dict[str, _Fill] = {}
        self._fds: OrderedDict[str, _Object] = OrderedDict()
        self._used = 0
        self._reserved = 0
        self._seen: dict[str, int] = {}
        self._seen_bytes = 0
        self._counters = Counters()
        self._warned_at: dict[str, float] = {}
        self._trouble_until = 0.0
        self._detector = PatternDetector()
        self._pattern = self._detector.classify()
        self._policy = make_policy(policy, max_bytes, self._detector)
        self._accesses = 0
        self._places: dict[str, tuple[str, int]] = {}
        self._orders: dict[str, tuple[list[str], dict[str, int]]] = {}
        self._prefetch_pool: ThreadPoolExecutor | None = None
        self._prefetch_workers = prefetch_workers
        self._prefetch_queued: set[str] = set()
        self._currents: dict[str, threading.Event] = {}
        """Versioned whole GETs in flight (:meth:`_current`), by path."""
        self._commits: queue.Queue[tuple[_Object, _Meta] | None] = queue.Queue()
        self._committer: threading.Thread | None = None
        self._stats_stop = threading.Event()
        self._stats_thread: threading.Thread | None = None
        self._through = ReadThrough(source, max_bytes=readthrough_bytes)
        self._janitor = Janitor(f"mgcache-unlink-{self.dataset}")
        self._revalidate_ahead = revalidate_ahead
        self._revalidator: Revalidator | None = None
        if metadata_ttl_s > 0:
            self._revalidator = Revalidator(
                metadata_ttl_s,
                clock,
                due=self._due,
                check=self._check,
                earned=lambda: self._counters.hits,
                name=f"mgcache-revalidate-{self.dataset}",
            )
        self._open = False
        self._closed = False

    # -- lifecycle ------------------------------------------------------------------------

    def open(self) -> CacheStore:
        """Prepare ``cache_dir``, recover the copies a previous run left (see the module
        doc), start the committer (and the stats writer). Returns self."""
        if self._open:
            return self
        if self._closed:
            raise RuntimeError("a CacheStore opens once: make a new one")
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self._claim()
        shutil.rmtree(self._tmp_dir, ignore_errors=True)
        self._tmp_dir.mkdir(exist_ok=True)
        self._objects_dir.mkdir(exist_ok=True)
        self._recover()
        for i in range(BUCKETS):  # once, not on a miss's path
            (self._objects_dir / f"{i:02x}").mkdir(exist_ok=True)
        self._janitor.start()
        self._committer = threading.Thread(
            target=self._commit_loop, name=f"mgcache-commit-{self.dataset}", daemon=True
        )
        self._committer.start()
        if self.prefetch_depth > 0 and self._prefetch_workers > 0:
            self._prefetch_pool = ThreadPoolExecutor(
                self._prefetch_workers, thread_name_prefix=f"mgcache-prefetch-{self.dataset}"
            )
        if self.stats_interval_s is not None:
            self._stats_stop.clear()
            self._stats_thread = threading.Thread(
                target=self._stats_loop, name=f"mgcache-stats-{self.dataset}", daemon=True
            )
            self._stats_thread.start()
        if self._revalidator is not None and self._revalidate_ahead:
            self._revalidator.start()
        self._open = True
        return self

    def close(self) -> None:
        """Stop prefetching, write every pending record, close fds, write stats.json."""
        if not self._open:
            return
        self._open = False
        self._closed = True
        if self._revalidator is not None:
            self._revalidator.stop()
        if self._prefetch_pool is not None:
            self._prefetch_pool.shutdown(wait=True, cancel_futures=True)
            self._prefetch_pool = None
        self._commits.put(None)
        if self._committer is not None:
            self._committer.join()
            self._committer = None
        self._stats_stop.set()
        if self._stats_thread is not None:
            self._stats_thread.join()
            self._stats_thread = None
        with self._lock:
            for obj in self._fds.values():
                if obj.refs == 0 and obj.fd >= 0:
                    os.close(obj.fd)
                    obj.fd = -1
            self._fds.clear()
        self._janitor.close()
        with contextlib.suppress(OSError):
            self.write_stats()

    def __enter__(self) -> CacheStore:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _claim(self) -> None:
        """Record which source this directory caches; wipe copies of another source."""
        marker = self.cache_dir / "cache.json"
        want = {"format": FORMAT, "source": self.source.url}
        try:
            have = msgspec.json.decode(marker.read_bytes())
        except (OSError, msgspec.DecodeError):
            have = None
        if have != want:
            if have is not None:
                log.warning(
                    "cache dir %s held a cache of %r: its copies are dropped",
                    self.cache_dir,
                    have.get("source") if isinstance(have, dict) else have,
                )
            shutil.rmtree(self._objects_dir, ignore_errors=True)
            tmp = marker.with_suffix(".json.tmp")
            tmp.write_bytes(msgspec.json.encode(want))
            os.replace(tmp, marker)

    def _recover(self) -> None:
        """Keep complete copies with a valid record; delete everything else."""
        records: list[tuple[_Meta, Path]] = []
        referenced: set[Path] = set()
        for bucket in sorted(self._objects_dir.iterdir()):
            if not bucket.is_dir():
                bucket.unlink(missing_ok=True)
                continue
            for meta_path in bucket.glob("*.meta"):
                try:
                    meta = msgspec.json.decode(meta_path.read_bytes(), type=_Meta)
                    if meta_path.name != meta.data + ".meta" or not meta.data.startswith(
                        _digest(normalize(meta.path)) + "-"
                    ):
                        raise ValueError("a record of another file")
                    data = bucket / meta.data
                    if data.stat().st_size != meta.size:
                        raise ValueError("size differs")
                except (OSError, ValueError, msgspec.DecodeError, msgspec.ValidationError):
                    meta_path.unlink(missing_ok=True)
                    continue
                records.append((meta, data))
                referenced.add(data)
        records.sort(key=lambda r: r[0].filled)
        kept: dict[str, tuple[_Meta, Path]] = {}
        for meta, data in records:
            older = kept.pop(meta.path, None)
            if older is not None:  # a crash left two generations: the newer one counts
                _unlink(older[1].with_name(older[1].name + ".meta"), older[1])
                referenced.discard(older[1])
            kept[meta.path] = (meta, data)
        for bucket in self._objects_dir.iterdir():
            for f in bucket.iterdir():
                if f.suffix != ".meta" and f not in referenced:
                    f.unlink(missing_ok=True)
        for meta, data in kept.values():
            if self._used + meta.size > self.max_bytes:  # max_bytes shrank since
                _unlink(data.with_name(data.name + ".meta"), data)
                continue
            obj = _Object(
                key=meta.path,
                size=meta.size,
                version=(meta.size, meta.mtime, meta.etag),
                data=data,
                checked_until=0.0,
            )
            self._objects[meta.path] = obj
            self._used += meta.size
            self._policy.insert(meta.path, meta.size)
        if kept:
            log.info(
                "cache %s: recovered %d files (%d bytes)",
                self.cache_dir,
                len(self._objects),
                self._used,
            )

    # -- metadata -------------------------------------------------------------------------

    def listdir(self, path: str = "") -> list[Entry]:
        """The entries of directory ``path`` of the source, sorted by name."""
        entries = self.source.listdir(path)
        with self._lock:
            for e in entries:
                if not e.is_dir:
                    self._note_locked(e)
        return entries

    def stat(self, path: str) -> Entry:
        """The source's entry of ``path`` (FileNotFoundError when missing); a cached copy
        whose version differs from it is dropped."""
        entry = self.source.stat(path)
        if not entry.is_dir:
            with self._lock:
                self._note_locked(entry)
        return entry

    def _note_locked(self, entry: Entry) -> None:
        old = self._seen.get(entry.path)
        if old != entry.size:
            self._seen_bytes += entry.size - (old or 0)
            self._seen[entry.path] = entry.size
            self._detector.population = len(self._seen)
        obj = self._objects.get(entry.path)
        if obj is not None and obj.version != entry.version:
            self._drop_locked(obj, "changed")

    # -- reads ----------------------------------------------------------------------------

    def read(self, path: str, offset: int, size: int) -> bytes:
        """``size`` bytes of file ``path`` from ``offset`` (fewer at its end; ``size < 0``:
        to the end): from the cached copy, after filling it on a miss, or from the source
        when the file is not cached (policy, too large, cache disk full or failing).

        FileNotFoundError / IsADirectoryError as the source says; errors of the source
        itself propagate, the cache disk's never do."""
        key = normalize(path)
        access = offset == 0
        found = self._hit(key, access) or self._miss(key, access)
        if isinstance(found, Entry):
            data, fetched = self._through.read(found, offset, size)
            with self._lock:
                self._counters.bytes_from_source += fetched
            return data
        obj = found
        n = size if size >= 0 else max(obj.size - offset, 0)
        data = b""
        try:
            data = os.pread(obj.fd, n, offset)
        finally:
            self._release(obj, len(data))
        return data

    def cached_path(self, path: str, count: bool = True) -> Path | None:
        """The local file of a cached, current copy of ``path``, or None (not cached).

        With ``count`` (the default) the store counts this as a hit of the whole file
        (one access, ``size`` bytes from cache): for a caller that then reads the file
        itself (the fsspec hit path).  The copy may be evicted before the caller opens
        it (FileNotFoundError then: fall back to :meth:`open_file` or :meth:`read`)."""
        key = normalize(path)
        obj = self._hit(key, access=count)
        if obj is None:
            return None
        self._release(obj, obj.size if count else 0)
        return obj.data

    def fetch(self, path: str) -> Path | None:
        """Make sure ``path`` is cached (a miss fills it; counted as an access) and return
        its local file, or None when it is read through (not admitted, too large, cache
        disk full or failing).  The same eviction caveat as :meth:`cached_path`."""
        key = normalize(path)
        hit = self._hit(key, access=True)
        obj = hit or self._miss(key, access=True)
        if isinstance(obj, Entry):
            return None
        # A hit's bytes are the caller's read of the local copy; a fill's were counted
        # from the source already.
        self._release(obj, obj.size if hit is not None else 0)
        return obj.data

    def open_copy(self, path: str) -> tuple[int, int] | None:
        """A new descriptor of the current cached copy of ``path`` and its size, for a
        reader that reads it itself (the FUSE hit path: it reports its reads with
        :meth:`note_read`, and closes the descriptor); None when ``path`` is not cached.
        Counts no access.  The copy stays readable through it if it is evicted."""
        key = normalize(path)
        obj = self._hit(key, access=False)
        if obj is None:
            return None
        try:
            return os.dup(obj.fd), obj.size
        except OSError:
            return None
        finally:
            self._release(obj, 0)

    def note_read(self, path: str, nbytes: int, access: bool) -> None:
        """Count ``nbytes`` read from a copy opened with :meth:`open_copy`; with ``access``
        (a read at offset 0) also a file read: a hit for the counters, the policy and the
        pattern detector."""
        key = normalize(path)
        with self._lock:
            self._counters.bytes_from_cache += nbytes
            if access:
                obj = self._objects.get(key)
                self._counters.hits += 1
                if obj is not None:
                    obj.touch(self._clock())
                    self._access_locked(key, obj.size, hit=True)

    def open_file(self, path: str) -> IO[bytes]:
        """A read-only file object of ``path``: the cached copy (a hit, or after a fill),
        else the source's file (read through).  One access; its bytes are counted as the
        file's size, from cache or from source.  Eviction while it is open is harmless
        (the open copy stays readable)."""
        key = normalize(path)
        obj = self._hit(key, access=True) or self._miss(key, access=True)
        if isinstance(obj, Entry):
            f = self.source.open(key)
            with self._lock:
                self._counters.bytes_from_source += obj.size
            return f
        try:
            return open(obj.data, "rb")  # the caller closes it
        finally:
            self._release(obj, obj.size)

    # -- hit path -------------------------------------------------------------------------

    def _hit(self, key: str, access: bool) -> _Object | None:
        """The current copy of ``key``, acquired (fd open, refs + 1), or None."""
        now = self._clock()
        with self._lock:
            obj = self._objects.get(key)
            if obj is None:
                return None
            if now < obj.checked_until:
                return self._acquire_locked(obj, access, hit=True)
        try:
            entry = self.source.stat(key)
        except FileNotFoundError:
            with self._lock:
                if self._objects.get(key) is obj:
                    self._drop_locked(obj, "gone from the source")
            raise
        except Exception as e:  # the source cannot answer: serve the copy we have
            with self._lock:
                self._warn_locked(
                    "source",
                    f"{key}: the source did not answer ({type(e).__name__}: {e}): "
                    "serving the cached copy unchecked",
                )
                if self._objects.get(key) is not obj:
                    return None
                obj.checked_until = now + min(self.metadata_ttl_s, SOURCE_RETRY_S)
                return self._acquire_locked(obj, access, hit=True)
        self._learn_order(key)  # known already but after a restart
        with self._lock:
            self._note_locked(entry)
            if self._objects.get(key) is not obj:
                return None
            obj.checked_until = now + self.metadata_ttl_s
            return self._acquire_locked(obj, access, hit=True)

    def _acquire_locked(self, obj: _Object, access: bool, hit: bool) -> _Object | None:
        if obj.fd < 0:
            try:
                obj.fd = os.open(obj.data, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as e:
                self._warn_locked("disk", f"cached copy of {obj.key} unreadable: {e}")
                self._drop_locked(obj, "unreadable")
                return None
            obj.release_fd = False
            self._fds[obj.key] = obj
            while len(self._fds) > FD_CACHE:
                _, old = self._fds.popitem(last=False)
                self._close_fd_locked(old)
        elif obj.key in self._fds:
            self._fds.move_to_end(obj.key)
        obj.refs += 1
        if access:
            if hit:
                self._counters.hits += 1
            obj.touch(self._clock())
            self._access_locked(obj.key, obj.size, hit)
        return obj

    def _release(self, obj: _Object, nbytes: int) -> None:
        with self._lock:
            obj.refs -= 1
            self._counters.bytes_from_cache += nbytes
            if obj.refs == 0 and (obj.release_fd or obj.dead) and obj.fd >= 0:
                os.close(obj.fd)
                obj.fd = -1

    def _close_fd_locked(self, obj: _Object) -> None:
        if obj.refs == 0:
            if obj.fd >= 0:
                os.close(obj.fd)
            obj.fd = -1
        else:
            obj.release_fd = True

    def _access_locked(self, key: str, size: int, hit: bool) -> None:
        """One file access: the policy's and the pattern detector's bookkeeping."""
        place = self._places.get(key)
        if place is None:
            directory, name = posixpath.split(key)
            order = self._orders.get(directory)
            index = order[1].get(name, -1) if order is not None else -1
            if index >= 0:
                place = (directory, index)
                self._places[key] = place
        directory, index = place if place is not None else (posixpath.dirname(key), -1)
        order = self._orders.get(directory)
        self._detector.observe(key, directory, index, len(order[0]) if order else 0)
        self._policy.access(key, size, hit)
        self._accesses += 1
        if self._accesses % CLASSIFY_EVERY == 0:
            self._pattern = self._detector.classify()
            if isinstance(self._policy, AutoPolicy):
                self._policy.reclassify(self._pattern)
        if (
            self._prefetch_pool is not None
            and self._policy.prefetch
            and self._pattern.kind == SEQUENTIAL
            and index >= 0
            and directory in self._orders
        ):
            names = self._orders[directory][0]
            for name in names[index + 1 : index + 1 + self.prefetch_depth]:
                nxt = f"{directory}/{name}" if directory else name
                if (
                    nxt in self._objects
                    or nxt in self._fills
                    or nxt in self._prefetch_queued
                    or len(self._prefetch_queued) >= PREFETCH_QUEUE
                ):
                    continue
                self._prefetch_queued.add(nxt)
                try:
                    self._prefetch_pool.submit(self._prefetch, nxt)
                except RuntimeError:  # shutting down
                    self._prefetch_queued.discard(nxt)
                    break

    # -- miss path ------------------------------------------------------------------------

    def _miss(self, key: str, access: bool, prefetch: bool = False) -> _Object | Entry:
        """Fill ``key`` (or wait for the fill in flight) and return its copy, acquired;
        or its current source entry: read it through.

        It starts from the source's last entry of the file, however old
        (:meth:`Source.stat_for_fetch`: no metadata round trip where the fetch checks the
        version itself); a fetch that finds another version starts over once from a
        fresh :meth:`Source.stat`.  An entry answered for reading through is always
        current (:meth:`_current`)."""
        entry = self.source.stat_for_fetch(key)
        if entry.is_dir:
            raise IsADirectoryError(key)
        self._learn_order(key)
        found = self._miss_once(key, entry, access, prefetch)
        if found is _CHANGED:
            entry = self.source.stat(key)  # knows the version the fetch saw: no round trip
            if entry.is_dir:
                raise IsADirectoryError(key)
            found = self._miss_once(key, entry, False, prefetch)
            if found is _CHANGED:  # changing under us: read it through
                return self._current(key, self.source.stat(key), prefetch)
        if isinstance(found, Entry):
            if prefetch and key in self._objects:  # filled meanwhile: nothing to read
                return found
            return self._current(key, found, prefetch)
        assert isinstance(found, _Object)
        return found

    def _current(self, key: str, entry: Entry, prefetch: bool) -> Entry:
        """``entry`` if it is fresh, else the file's current entry: one whole GET with its
        version where the source can (kept as the file's read-through window: the read
        that follows costs nothing more), else a fresh :meth:`Source.stat`.  One such GET
        per file at a time: a reader that catches up with the prefetch of its file (or
        another reader) waits for that GET and reads its window."""
        if self.source.is_fresh(entry):
            return entry
        if entry.size > self._through.whole_bytes:
            return self.source.stat(key)
        with self._lock:
            pending = self._currents.get(key)
            if pending is None:
                self._currents[key] = threading.Event()
        if pending is not None:
            pending.wait()
            known = self.source.known(key)
            if known is not None and self.source.is_fresh(known):
                return known  # the GET just made: its window holds the file
            return self.source.stat(key)
        try:
            got = self.source.read_current(key, limit=self._through.whole_bytes)
            if got is None:
                return self.source.stat(key)
            data, seen = got
            self._through.adopt(seen, data)
            with self._lock:
                self._note_locked(seen)
                self._counters.bytes_from_source += len(data)
                if prefetch:
                    self._counters.prefetched += 1
            return seen
        finally:
            with self._lock:
                done = self._currents.pop(key)
            done.set()

    def _miss_once(self, key: str, entry: Entry, access: bool, prefetch: bool) -> object:
        """One attempt of :meth:`_miss` with ``entry``: the copy (acquired), an Entry (read
        it through), or _CHANGED (the file is not that version)."""
        while True:
            free = self._free_bytes()
            victims: list[_Object] = []
            with self._lock:
                self._note_locked(entry)
                obj = self._objects.get(key)
                if obj is not None:  # filled meanwhile
                    if prefetch:
                        return entry
                    return self._acquire_locked(obj, access, hit=True) or entry
                fill = self._fills.get(key)
                mine = fill is None
                if fill is None:
                    if access:
                        self._counters.misses += 1
                        self._access_locked(key, entry.size, hit=False)
                    why = self._admit_locked(key, entry, free, victims, quiet=not access)
                    if why is None:
                        fill = _Fill(entry, prefetch=prefetch)
                        self._fills[key] = fill
                        self._reserved += entry.size
                    elif why and access:
                        self._counters.passthrough_reads += 1
                for victim in victims:  # out of the table already: no reader can reach them
                    self._discard_locked(victim)
            if mine:
                if fill is None:
                    return entry
                break
            assert fill is not None
            fill.done.wait()
            if fill.changed:
                return _CHANGED
            if prefetch:
                return entry
            if not fill.ok:
                if access:
                    with self._lock:
                        self._counters.misses += 1
                return entry
        obj = self._fill(key, fill)
        if obj is None:
            return _CHANGED if fill.changed else entry
        self._through.forget(key)
        if prefetch:
            with self._lock:
                self._counters.prefetched += 1
            return entry
        with self._lock:
            if self._objects.get(key) is not obj:
                return entry
            return self._acquire_locked(obj, access=False, hit=False) or entry

    def _admit_locked(
        self, key: str, entry: Entry, free: int | None, victims: list[_Object], quiet: bool
    ) -> str | None:
        """None: admitted (``victims`` evicted for it, their files still to unlink); else
        why not: "" (the policy's choice) or a warning's text (also counted)."""
        size = entry.size
        kind = why = ""
        if size > self.max_bytes:
            kind = "size"
            why = f"{key}: {size} bytes is more than the whole cache ({self.max_bytes} bytes)"
        elif self._clock() < self._trouble_until:
            kind = "disk"
            why = f"{key}: the cache disk failed recently: reading through"
        elif free is not None and free - self._reserved - size < self.min_free_bytes:
            kind = "full"
            why = (
                f"{key}: the cache disk has {free} bytes free, the floor is "
                f"{self.min_free_bytes}: reading through"
            )
        if why:
            if not quiet:
                self._warn_locked(kind, why)
            return why
        need = self._used + self._reserved + size - self.max_bytes
        chosen = self._policy.make_room(key, size, need)
        if chosen is None:
            return ""
        for victim_key in chosen:
            victim = self._objects.get(victim_key)
            if victim is not None:
                self._drop_locked(victim, "", evict=True, unlink=False)
                victims.append(victim)
                self._counters.evictions += 1
        if self._used + self._reserved + size > self.max_bytes:  # a policy's mistake
            return ""
        return None

    def _fill(self, key: str, fill: _Fill) -> _Object | None:
        """Fetch ``fill``'s file into tmp/, rename it into objects/ and register it."""
        entry = fill.entry
        digest = _digest(key)
        name = f"{digest}-{uuid.uuid4().hex[:12]}"
        tmp = self._tmp_dir / name
        final = self._objects_dir / digest[:2] / name
        obj: _Object | None = None
        try:
            try:
                with open(tmp, "wb") as f:
                    sink = _Sink(f, lambda: self._wait_for_room(key))
                    copied = self.source.fetch_to(key, sink, entry)
                if copied != entry.size:
                    log.info("%s is not the version it was fetched as: asking again", key)
                    fill.changed = True
                    tmp.unlink(missing_ok=True)
                    return None
                try:
                    os.rename(tmp, final)
                except FileNotFoundError:  # its bucket was removed from outside
                    final.parent.mkdir(exist_ok=True)
                    os.rename(tmp, final)
            except OSError as e:
                tmp.unlink(missing_ok=True)
                if _is_local_error(e, tmp):
                    with self._lock:
                        self._trouble_until = self._clock() + TROUBLE_BACKOFF_S
                        self._warn_locked("disk", f"{key}: writing the cache failed: {e}")
                        self._counters.passthrough_reads += 1
                    return None
                raise
            obj = _Object(
                key=key,
                size=entry.size,
                version=entry.version,
                data=final,
                checked_until=self._clock() + self.metadata_ttl_s,
            )
            if not fill.prefetch:
                obj.touch(self._clock())  # the miss that filled it read it
            meta = _Meta(
                path=key,
                size=entry.size,
                mtime=entry.mtime,
                etag=entry.etag,
                filled=time.time(),
                data=name,
            )
            with self._lock:  # reservation -> resident in one step
                self._reserved -= entry.size
                self._fills.pop(key, None)
                self._objects[key] = obj
                self._used += entry.size
                self._policy.insert(key, entry.size)
                self._counters.bytes_from_source += entry.size
            self._commits.put((obj, meta))
            fill.ok = True
            return obj
        finally:
            if not fill.ok:
                with self._lock:
                    self._reserved -= entry.size
                    self._fills.pop(key, None)
            fill.done.set()

    def _prefetch(self, key: str) -> None:
        try:
            if self._open:
                entry = self._miss(key, access=False, prefetch=True)
                if isinstance(entry, Entry) and key not in self._objects:
                    fetched = self._through.warm(entry)  # not kept: warm its window
                    if fetched:
                        with self._lock:
                            self._counters.prefetched += 1
                            self._counters.bytes_from_source += fetched
        except Exception as e:  # a failed prefetch costs only itself
            log.debug("prefetch of %s failed: %s", key, e)
        finally:
            with self._lock:
                self._prefetch_queued.discard(key)

    def _learn_order(self, key: str) -> None:
        """Know the sorted names of ``key``'s directory (for sequential detection)."""
        directory, name = posixpath.split(key)
        order = self._orders.get(directory)
        if order is not None and name in order[1]:
            return
        try:
            names = self.source.names(directory)
        except OSError:
            return
        with self._lock:
            self._orders[directory] = (names, {n: i for i, n in enumerate(names)})
            for stale in [k for k in self._places if posixpath.dirname(k) == directory]:
                del self._places[stale]

    # -- removal --------------------------------------------------------------------------

    def _drop_locked(
        self, obj: _Object, why: str, evict: bool = False, unlink: bool = True
    ) -> None:
        """Forget ``obj`` (its fd closes when no read uses it); unlink its files unless
        the caller does (outside the lock)."""
        if self._objects.get(obj.key) is not obj:
            return
        del self._objects[obj.key]
        self._used -= obj.size
        obj.dead = True
        if not evict:
            self._policy.remove(obj.key)
        if self._fds.get(obj.key) is obj:
            del self._fds[obj.key]
        self._close_fd_locked(obj)
        if why:
            log.info("cache %s: dropped %s (%s)", self.dataset, obj.key, why)
        if unlink:
            self._discard_locked(obj)

    def _discard_locked(self, obj: _Object) -> None:
        """Have the janitor delete a dropped copy's files (its bytes count against the
        bound until they are gone)."""
        self._janitor.discard((obj.data.with_name(obj.data.name + ".meta"), obj.data), obj.size)

    def _wait_for_room(self, key: str) -> None:
        """Before a fill's first write: wait until the bytes of copies still being deleted
        fit beside what is cached and reserved (ENOSPC, a disk problem, after
        ROOM_WAIT_S)."""

        def ready(pending: int) -> bool:
            return self._used + self._reserved + pending <= self.max_bytes

        if not self._janitor.wait(ready, ROOM_WAIT_S):
            raise OSError(
                errno.ENOSPC,
                f"dropped copies not deleted within {ROOM_WAIT_S:g} s: no room to fill {key}",
                str(self._tmp_dir),
            )

    # -- the background check (revalidate.py) -------------------------------------------

    def revalidate(self) -> int:
        """One pass of the background check now (what its thread does every interval):
        the copies it checked; 0 with a TTL of 0."""
        return 0 if self._revalidator is None else self._revalidator.run_once()

    def _due(self, horizon: float, limit: int) -> list[str]:
        """Up to ``limit`` cached copies trusted only until ``horizon`` or less, soonest
        first.  Where each check is a request of its own (http), only copies re-read
        within a TTL last time: a copy read less often would need more checks ahead than
        its reads (it is checked when read instead); a listing confirms a directory's
        copies at once, so there every copy is due."""
        every = self.source.versioned_listings
        ttl = self.metadata_ttl_s
        with self._lock:
            due = [
                (o.checked_until, k)
                for k, o in self._objects.items()
                if o.checked_until <= horizon and (every or o.reread_s <= ttl)
            ]
        return [k for _, k in heapq.nsmallest(limit, due)]

    def _check(self, keys: list[str], started: float) -> int:
        """Ask the source for ``keys`` (and, with a listing, their siblings) and apply the
        answers: a copy of the same version is trusted until ``started`` + the TTL, a
        changed or vanished file's copy is dropped.  Returns the requests it cost."""
        answers = self.source.check(keys)
        until = started + self.metadata_ttl_s
        with self._lock:
            for key, entry in answers.items():
                obj = self._objects.get(key)
                if entry is None:
                    if obj is not None:
                        self._drop_locked(obj, "gone from the source")
                    continue
                self._note_locked(entry)  # drops a copy of another version
                if obj is not None and self._objects.get(key) is obj:
                    obj.checked_until = max(obj.checked_until, until)
        if self.source.versioned_listings:
            return len({posixpath.dirname(k) for k in keys})
        return len(keys)

    # -- the committer ------------------------------------------------------------------

    def _commit_loop(self) -> None:
        while (item := self._commits.get()) is not None:
            obj, meta = item
            if obj.dead:
                continue
            try:
                if self.durable:
                    fd = os.open(obj.data, os.O_RDONLY | os.O_CLOEXEC)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                record = obj.data.with_name(obj.data.name + ".meta")
                tmp = self._tmp_dir / (record.name + ".tmp")
                tmp.write_bytes(msgspec.json.encode(meta))
                if obj.dead:
                    tmp.unlink(missing_ok=True)
                    continue
                os.replace(tmp, record)
                if obj.dead:  # dropped meanwhile: the drop may have missed the record
                    record.unlink(missing_ok=True)
            except FileNotFoundError:
                continue
            except OSError as e:
                with self._lock:
                    self._warn_locked("disk", f"{obj.key}: writing its record failed: {e}")

    # -- space, warnings ------------------------------------------------------------------

    def _free_bytes(self) -> int | None:
        try:
            st = os.statvfs(self.cache_dir)
        except OSError:
            return None
        return st.f_bavail * st.f_frsize

    def _warn_locked(self, kind: str, text: str) -> None:
        self._counters.warnings += 1
        self._counters.last_warning = text
        now = self._clock()
        if now - self._warned_at.get(kind, -WARN_EVERY_S) >= WARN_EVERY_S:
            self._warned_at[kind] = now
            log.warning(
                "cache %s: %s (%d warnings so far)", self.dataset, text, self._counters.warnings
            )

    # -- figures --------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        """Bytes of complete cached copies."""
        return self._used

    @property
    def pattern(self) -> Pattern:
        """The access pattern last detected."""
        return self._pattern

    def stats(self) -> DatasetCache:
        """The cache's figures now (the stats.json record)."""
        with self._lock:
            c = self._counters
            policy = self._policy
            return DatasetCache(
                dataset=self.dataset,
                source=self.source.url,
                mountpoint=self.mountpoint,
                cache_dir=str(self.cache_dir),
                pid=os.getpid(),
                ts=self._clock(),
                policy=policy.name,
                policy_reason=policy.reason,
                pattern=self._pattern.kind,
                max_bytes=self.max_bytes,
                used_bytes=self._used,
                cached_files=len(self._objects),
                dataset_bytes=self._seen_bytes,
                hits=c.hits,
                misses=c.misses,
                bytes_from_cache=c.bytes_from_cache,
                bytes_from_source=c.bytes_from_source,
                evictions=c.evictions,
                prefetched=c.prefetched,
                passthrough_reads=c.passthrough_reads,
                warnings=c.warnings,
                last_warning=c.last_warning,
            )

    def write_stats(self) -> Path:
        """Write :meth:`stats` to ``<cache_dir>/stats.json`` atomically; return its path."""
        path = stats_path(self.cache_dir)
        write_stats(path, self.stats())
        return path

    def _stats_loop(self) -> None:
        assert self.stats_interval_s is not None
        while not self._stats_stop.wait(self.stats_interval_s):
            try:
                self.write_stats()
            except OSError as e:
                log.warning("cache %s: writing stats.json failed: %s", self.dataset, e)


def _digest(key: str) -> str:
    """The name a cached copy of ``key`` starts with (sha1 of the path, hex)."""
    return hashlib.sha1(key.encode(), usedforsecurity=False).hexdigest()


def _unlink(*paths: Path) -> None:
    for p in paths:
        with contextlib.suppress(OSError):
            p.unlink()


def _is_local_error(e: OSError, tmp: Path) -> bool:
    """Whether ``e`` came from the cache disk (full, failing, read-only) — not the source."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS):
        return True
    filename = getattr(e, "filename", None)
    return filename is not None and str(filename).startswith(str(tmp.parent.parent))
