"""Where a dataset cache reads from: a local path or any fsspec URL, behind one small API.

:func:`open_source` turns a path (a local disk, an NFS or Lustre mount) or an fsspec URL
(``file://``, ``http(s)://``, ``s3://``, ``memory://`` ...) into a :class:`Source`, checking
at once that its root can be listed (:class:`SourceError` otherwise, with a clear message).

Paths inside a source are *relative* POSIX paths (``"train/000123.jpg"``; ``""`` is the
root); :func:`normalize` makes one from what a caller passes (a leading ``/`` is fine, a
``..`` is refused).

Design notes
------------
* Metadata is cached.  A directory listing and a file's :class:`Entry` (size, mtime, ETag:
  whatever the backend gives, ``0.0`` / ``""`` when absent) are trusted for
  ``metadata_ttl_s`` seconds of the injected ``clock``, so opening a cached file costs no
  round trip to the source within that window.  When a file's entry is stale, the
  source re-lists its parent directory if that listing carries versions (local disks,
  object stores: one round trip refreshes every sibling; one listing per directory at a
  time), or asks for the file alone (``HEAD`` over http, whose listings carry names
  only: there the listing says which names exist, and :meth:`Source.listdir` asks for
  the sizes it lacks, in parallel: ``HEAD`` requests on fsspec's event loop, httpio.py).
* Misses need no fresh entry.  :meth:`Source.stat_for_fetch` answers the last entry
  seen, however old, where :meth:`Source.fetch_to` checks the version itself (a local
  file's fstat after the copy; an http GET's own headers, remembered as the file's
  entry): a miss costs one request, not a metadata round trip and a GET.
* :meth:`Source.check` asks for many files' entries at once (the store's background check
  of its cached copies): one listing per directory, or parallel ``HEAD`` requests.
* An :class:`Entry`'s :attr:`~Entry.version` (size, mtime, ETag) is what the cache records
  next to a cached copy: a source file whose version differs is a changed file.
* Reads: :meth:`Source.fetch_to` copies a whole file into a local file (``copy_file_range``
  for a local source, one ``GET`` for a small remote file (over http with its response
  headers, httpio.py), ranged reads of
  ``CHUNK_BYTES`` for a large one); :meth:`Source.read` reads a range (pass-through).
* Thread-safe: the metadata cache is guarded by a lock held only around dict operations;
  every call to the backend runs outside it.  Two threads refreshing the same stale
  entry at once may both ask the backend; the later answer wins.
"""

from __future__ import annotations

import contextlib
import datetime
import email.utils
import os
import posixpath
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, Any, Protocol

import fsspec
from fsspec.implementations.local import LocalFileSystem

from metalguard.agent.cache import httpio

CHUNK_BYTES = 8 * 1024 * 1024
"""Ranged-read size for fetching a large remote file (and the copy buffer)."""
WHOLE_GET_BYTES = 32 * 1024 * 1024
"""Remote files up to this size are fetched with one request."""
SIZE_WORKERS = 16
"""Threads asking for the sizes a listing lacks (a synchronous backend's listing)."""
SIZE_CONCURRENCY = 32
"""HEAD requests in flight at once for the sizes an http listing lacks."""


class Sink(Protocol):
    """Where :meth:`Source.fetch_to` writes a file: an open local file (or a wrapper)."""

    def write(self, data: bytes, /) -> int: ...

    def fileno(self) -> int: ...


class SourceError(Exception):
    """The source cannot be used: missing, unreadable, not a directory, bad URL."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One file or directory of a source, as its last listing or stat saw it."""

    path: str
    """Relative POSIX path inside the source (``""`` for the root)."""
    name: str
    """The last component of ``path`` (``""`` for the root)."""
    is_dir: bool
    size: int = 0
    mtime: float = 0.0
    """Modification time (Unix seconds); 0.0 when the backend gives none."""
    etag: str = ""
    """The backend's ETag (object stores, http); "" when it gives none."""

    @property
    def version(self) -> tuple[int, float, str]:
        """What identifies this content: (size, mtime, etag)."""
        return (self.size, self.mtime, self.etag)


def normalize(path: str) -> str:
    """A caller's path as a relative POSIX path: ``"/a//b/"`` -> ``"a/b"``, ``"/"`` -> ``""``.

    Raises ValueError for a path that would leave the source (``..``) or holds a NUL."""
    rel = path[1:] if path[:1] == "/" else path
    if (
        rel
        and "//" not in rel
        and "/." not in rel
        and rel[0] not in "./"
        and rel[-1] != "/"
        and "\x00" not in rel
    ):
        return rel  # already plain: the common case, on every read
    if "\x00" in path:
        raise ValueError(f"path {path!r} holds a NUL byte")
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise ValueError(f"path {path!r} leaves the source (..)")
    return "/".join(parts)


def _parse_time(value: object) -> float:
    """A backend's time field (float, datetime, ISO or HTTP date string) as Unix seconds."""
    if isinstance(value, bool):
        return 0.0
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, datetime.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=datetime.UTC)
        return value.timestamp()
    if isinstance(value, str) and value:
        with contextlib.suppress(ValueError, TypeError):
            return email.utils.parsedate_to_datetime(value).timestamp()
        with contextlib.suppress(ValueError):
            return _parse_time(datetime.datetime.fromisoformat(value))
    return 0.0


_MTIME_KEYS = ("mtime", "LastModified", "last_modified", "Last-Modified", "updated", "modified")
_ETAG_KEYS = ("ETag", "etag", "e_tag", "md5Hash", "Content-MD5")


def _version_of(info: Mapping[str, Any]) -> tuple[int | None, float, str]:
    size = info.get("size")
    mtime = 0.0
    for key in _MTIME_KEYS:
        if info.get(key) is not None:
            mtime = _parse_time(info[key])
            break
    else:
        mtime = _parse_time(info.get("created"))
    etag = ""
    for key in _ETAG_KEYS:
        if info.get(key):
            etag = str(info[key]).strip()
            break
    return (int(size) if isinstance(size, int | float) else None, mtime, etag)


def redact(url: str) -> str:
    """``url`` without credentials (``s3://key:secret@bucket`` -> ``s3://bucket``)."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urllib.parse.urlunsplit(parts._replace(netloc=host))


class Source:
    """A read-only view of one dataset's files (build it with :func:`open_source`)."""

    def __init__(
        self,
        fs: fsspec.AbstractFileSystem,
        root: str,
        url: str,
        metadata_ttl_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.fs = fs
        self.root = root.rstrip("/") if root not in ("/", "") else root
        self.url = redact(url)
        """The source as configured, without credentials (for stats and logs)."""
        self.metadata_ttl_s = metadata_ttl_s
        self.local = isinstance(fs, LocalFileSystem)
        """True for a local path (or file://): reads can use plain syscalls."""
        self._http = "http" in _protocols(fs)
        self._clock = clock
        self._lock = threading.Lock()
        self._files: dict[str, tuple[float, Entry]] = {}
        self._dirs: dict[str, tuple[float, dict[str, Entry]]] = {}
        self._list_locks: dict[str, threading.Lock] = {}
        self.versioned_listings = not self._http
        """Whether a listing carries each file's version (size, mtime): not over http,
        whose directory index names files only."""
        self.round_trips = 0
        """Calls to the backend for metadata (listings, stats): what a hit must not cost."""

    # -- paths ---------------------------------------------------------------------------

    def full_path(self, path: str) -> str:
        """The backend's path (or URL) of a relative ``path``."""
        rel = normalize(path)
        if not rel:
            return self.root
        if self._http:
            rel = urllib.parse.quote(rel)
        if self.root.endswith("/"):
            return self.root + rel
        return f"{self.root}/{rel}"

    def local_path(self, path: str) -> str | None:
        """The OS path of ``path`` when the source is local, else None."""
        return self.full_path(path) if self.local else None

    # -- metadata -------------------------------------------------------------------------

    def listdir(self, path: str = "") -> list[Entry]:
        """The entries of directory ``path``, sorted by name (cached for the TTL).

        FileNotFoundError when ``path`` is missing, NotADirectoryError for a file."""
        rel = normalize(path)
        entries = self._listing(rel, fresh=True)
        unsized = [e.path for e in entries.values() if not e.is_dir and e.size < 0]
        if unsized:
            sized = self._sizes(unsized)
            entries = {n: sized.get(e.path, e) for n, e in entries.items()}
            entries = {n: e for n, e in entries.items() if e.is_dir or e.size >= 0}
        return sorted(entries.values(), key=lambda e: e.name)

    def names(self, path: str = "") -> list[str]:
        """The sorted names of the files (not directories) in directory ``path``, from its
        last listing whatever its age (one listing, without sizes, when there is none)."""
        entries = self._listing(normalize(path), fresh=False)
        return sorted(n for n, e in entries.items() if not e.is_dir)

    def stat(self, path: str) -> Entry:
        """The :class:`Entry` of ``path`` (cached for the TTL); FileNotFoundError if missing."""
        rel = normalize(path)
        if not rel:
            return Entry(path="", name="", is_dir=True)
        now = self._clock()
        parent, name = posixpath.split(rel)
        with self._lock:
            cached_file = self._files.get(rel)
            cached_dir = self._dirs.get(parent)
        if cached_file is not None and now < cached_file[0]:
            return cached_file[1]
        if self.versioned_listings:
            if cached_dir is not None and now < cached_dir[0]:
                entries = cached_dir[1]
            elif cached_dir is not None:  # one re-listing refreshes every sibling
                entries = self._list(parent)
            else:
                return self._info(rel)
            entry = entries.get(name)
            if entry is None:
                raise FileNotFoundError(rel)
            return entry
        # listings name files only (http): the listing says what exists, a HEAD the rest
        entries = self._listing(parent, fresh=False)
        entry = entries.get(name)
        if entry is None and cached_dir is not None and now >= cached_dir[0]:
            entry = self._list(parent).get(name)
        if entry is None:
            raise FileNotFoundError(rel)
        return entry if entry.is_dir else self._info(rel)

    def known(self, path: str) -> Entry | None:
        """The last entry seen of file ``path`` whatever its age (no round trip); None when
        none was seen (or the last listing gave no size)."""
        rel = normalize(path)
        parent, name = posixpath.split(rel)
        with self._lock:
            cached_file = self._files.get(rel)
            cached_dir = self._dirs.get(parent)
        if cached_file is not None:
            return cached_file[1]
        if cached_dir is not None:
            entry = cached_dir[1].get(name)
            if entry is not None and not entry.is_dir and entry.size >= 0:
                return entry
        return None

    def stat_for_fetch(self, path: str) -> Entry:
        """The entry to fetch file ``path`` with (a miss): where :meth:`fetch_to` checks the
        version itself — a local copy's fstat, an http GET's headers — the last entry seen,
        however old, so a miss costs no metadata round trip (a changed file makes
        ``fetch_to`` answer -1 and the caller asks :meth:`stat`, which then knows the
        version the fetch saw); else :meth:`stat`."""
        known = self.known(path)
        if known is not None and (self.local or (self._http and known.size <= WHOLE_GET_BYTES)):
            return known
        return self.stat(path)

    def check(
        self, paths: Sequence[str], concurrency: int = httpio.HEAD_CONCURRENCY
    ) -> dict[str, Entry | None]:
        """Ask the source now for the current entries of files ``paths`` (the background
        check of cached copies): one listing per parent directory where listings carry
        versions (the answer then holds every file of those directories), else one HEAD
        per file (http: in parallel on the file system's event loop).  Per path its entry,
        or None when it is gone (or a directory); paths the source gave no answer for (an
        error) are left out.  The answers refresh the metadata cache as a listing or a
        stat would.  ``concurrency``: HEAD requests in flight at once."""
        out: dict[str, Entry | None] = {}
        rels = [normalize(p) for p in paths]
        if self.versioned_listings:
            by_dir: dict[str, list[str]] = {}
            for rel in rels:
                by_dir.setdefault(posixpath.dirname(rel), []).append(rel)
            for parent, members in by_dir.items():
                try:
                    entries = self._list(parent)
                except (FileNotFoundError, NotADirectoryError):
                    entries = {}
                except Exception:  # the source did not answer: no verdict
                    continue
                for sibling in entries.values():  # the siblings' versions come with it
                    if not sibling.is_dir:
                        out[sibling.path] = sibling
                for rel in members:
                    found = entries.get(posixpath.basename(rel))
                    out[rel] = found if found is not None and not found.is_dir else None
            return out
        if self._http:
            started = self._clock()
            self.round_trips += len(rels)
            answers = httpio.head_many(self.fs, [self.full_path(r) for r in rels], concurrency)
            for rel, answer in zip(rels, answers, strict=True):
                if isinstance(answer, BaseException):
                    continue
                seen = None if answer is None else self._entry(rel, answer)
                if seen is None or seen.size < 0:
                    self.invalidate(rel)
                    out[rel] = None
                    continue
                self._remember(rel, seen, started)
                out[rel] = seen
            return out
        for rel in rels:
            try:
                out[rel] = self._info(rel)
            except FileNotFoundError:
                out[rel] = None
            except Exception:
                continue
        return out

    def is_fresh(self, entry: Entry) -> bool:
        """Whether ``entry`` is what the metadata cache holds for its file, within the TTL."""
        now = self._clock()
        parent, name = posixpath.split(entry.path)
        with self._lock:
            cached_file = self._files.get(entry.path)
            cached_dir = self._dirs.get(parent)
        if cached_file is not None and now < cached_file[0] and cached_file[1] == entry:
            return True
        return (
            self.versioned_listings
            and cached_dir is not None
            and now < cached_dir[0]
            and cached_dir[1].get(name) == entry
        )

    def read_current(self, path: str, limit: int = WHOLE_GET_BYTES) -> tuple[bytes, Entry] | None:
        """All of file ``path`` and the entry of the version those bytes are, in one request,
        where the source can say (http: a GET's headers; remembered as the file's entry);
        None where it cannot, or the file is larger than ``limit``.  FileNotFoundError when
        it is gone."""
        if not self._http:
            return None
        rel = normalize(path)
        try:
            got = self._get_current(rel, limit)
        except FileNotFoundError:
            self.invalidate(rel)
            raise FileNotFoundError(rel) from None
        return got

    def _get_current(self, rel: str, limit: int) -> tuple[bytes, Entry] | None:
        """One http GET of ``rel``: its bytes and their version (remembered as its entry);
        None (nothing read) when it announces more than ``limit`` bytes."""
        started = self._clock()
        data, info = httpio.get_with_info(self.fs, self.full_path(rel), limit)
        seen = self._entry(rel, info)
        if seen.size >= 0:
            self._remember(rel, seen, started)
        if data is None:
            return None
        return data, seen

    def _remember(self, rel: str, entry: Entry, seen_at: float | None = None) -> None:
        """Trust ``entry`` for the TTL from ``seen_at`` (default: now)."""
        at = self._clock() if seen_at is None else seen_at
        with self._lock:
            self._files[rel] = (at + self.metadata_ttl_s, entry)

    def invalidate(self, path: str | None = None) -> None:
        """Forget cached metadata: of ``path`` (and its parent listing), or all of it."""
        with self._lock:
            if path is None:
                self._files.clear()
                self._dirs.clear()
                return
            rel = normalize(path)
            self._files.pop(rel, None)
            self._dirs.pop(posixpath.dirname(rel), None)

    def _listing(self, rel: str, fresh: bool) -> dict[str, Entry]:
        """Directory ``rel``'s cached listing (a fresh one with ``fresh``), else a new one."""
        with self._lock:
            cached = self._dirs.get(rel)
        if cached is not None and (not fresh or self._clock() < cached[0]):
            return cached[1]
        return self._list(rel)

    def _info(self, rel: str) -> Entry:
        self.round_trips += 1
        try:
            info = self.fs.info(self.full_path(rel))
        except FileNotFoundError:
            raise FileNotFoundError(rel) from None
        entry = self._entry(rel, info)
        if not entry.is_dir and entry.size < 0:
            raise FileNotFoundError(rel)
        self._remember(rel, entry)
        return entry

    def _list(self, rel: str) -> dict[str, Entry]:
        """List directory ``rel`` now (one listing at a time per directory: a thread that
        finds one in flight takes its answer)."""
        with self._lock:
            lock = self._list_locks.setdefault(rel, threading.Lock())
            before = self._dirs.get(rel)
        with lock:
            with self._lock:
                now_cached = self._dirs.get(rel)
            if now_cached is not None and now_cached is not before:
                return now_cached[1]
            return self._list_now(rel)

    def _list_now(self, rel: str) -> dict[str, Entry]:
        self.round_trips += 1
        full = self.full_path(rel)
        try:
            infos = self.fs.ls(full, detail=True)
        except FileNotFoundError:
            raise FileNotFoundError(rel) from None
        if len(infos) == 1 and infos[0].get("type") != "directory" and rel:
            name = _basename(str(infos[0]["name"]), self._http)
            if name == posixpath.basename(rel) and not self._info(rel).is_dir:
                raise NotADirectoryError(rel)  # fsspec lists a file as itself
        entries: dict[str, Entry] = {}
        for info in infos:
            name = _basename(str(info["name"]), self._http)
            if not name or name in (".", ".."):
                continue
            child = f"{rel}/{name}" if rel else name
            entries[name] = self._entry(child, info)
        with self._lock:
            self._dirs[rel] = (self._clock() + self.metadata_ttl_s, entries)
        return entries

    def _sizes(self, paths: list[str]) -> dict[str, Entry]:
        """Entries of files a listing named without sizes (http), asked for in parallel
        (those known and fresh are not asked again)."""
        now = self._clock()
        with self._lock:
            fresh = {p: self._files.get(p) for p in paths}
        found = {p: c[1] for p, c in fresh.items() if c is not None and now < c[0]}
        ask = [p for p in paths if p not in found]
        if ask and self._http:
            for rel, entry in self.check(ask, SIZE_CONCURRENCY).items():
                if entry is not None:
                    found[rel] = entry
            return found

        def one(rel: str) -> Entry | None:
            try:
                return self.stat(rel)
            except OSError:
                return None

        if ask:
            with ThreadPoolExecutor(min(SIZE_WORKERS, len(ask))) as pool:
                for e in pool.map(one, ask):
                    if e is not None:
                        found[e.path] = e
        return found

    def _entry(self, rel: str, info: Mapping[str, Any]) -> Entry:
        is_dir = info.get("type") == "directory"
        size, mtime, etag = _version_of(info)
        if is_dir:
            return Entry(path=rel, name=posixpath.basename(rel), is_dir=True, mtime=mtime)
        return Entry(
            path=rel,
            name=posixpath.basename(rel),
            is_dir=False,
            size=-1 if size is None else size,
            mtime=mtime,
            etag=etag,
        )

    # -- data -----------------------------------------------------------------------------

    def read(self, path: str, offset: int = 0, size: int = -1) -> bytes:
        """``size`` bytes of file ``path`` from ``offset`` (to its end for ``size < 0``)."""
        rel = normalize(path)
        if self.local:
            with open(self.full_path(rel), "rb") as f:
                if size < 0:
                    f.seek(offset)
                    return f.read()
                return os.pread(f.fileno(), size, offset)
        end = None if size < 0 else offset + size
        data = bytes(self.fs.cat_file(self.full_path(rel), start=offset, end=end))
        if offset or size >= 0:
            # a server that ignores Range answers the whole file: cut the range out of it
            with contextlib.suppress(OSError):
                whole = self.stat(rel).size
                want = max(0, min(whole - offset, size if size >= 0 else whole))
                if len(data) != want and len(data) == whole:
                    data = data[offset : offset + want]
        return data

    def open(self, path: str) -> IO[bytes]:
        """A read-only file object of ``path`` (what a pass-through reader streams from)."""
        rel = normalize(path)
        if self.local:
            return open(self.full_path(rel), "rb")  # the caller closes it
        f: IO[bytes] = self.fs.open(self.full_path(rel), "rb")
        return f

    def fetch_to(self, path: str, dest: Sink, entry: Entry) -> int:
        """Copy file ``path``, whose version is believed to be ``entry``, into the open
        local file ``dest``; return the bytes copied.  A count other than ``entry.size``
        means the file is not (or no longer) that version: a local file whose size or
        mtime differ, or an http GET whose headers show another version, answers -1 (an
        http GET's version is remembered: :meth:`stat` then answers it without a round
        trip).  Never writes more than ``entry.size + 1`` bytes of a local file, nor any
        byte of a whole http GET of another version.  FileNotFoundError when the file is
        gone (its metadata is forgotten)."""
        rel = normalize(path)
        size = entry.size
        try:
            if self.local:
                with open(self.full_path(rel), "rb") as src:
                    copied = _copy_fd(src.fileno(), dest.fileno(), limit=size + 1)
                    st = os.fstat(src.fileno())
                if (st.st_size, st.st_mtime) != (entry.size, entry.mtime) or copied != size:
                    return -1
                return copied
            if size <= WHOLE_GET_BYTES and self._http:
                got = self._get_current(rel, WHOLE_GET_BYTES)
                if got is None or got[1].version != entry.version:
                    return -1
                dest.write(got[0])
                return len(got[0])
            if size <= WHOLE_GET_BYTES:
                data = self.fs.cat_file(self.full_path(rel))
                dest.write(data)
                return len(data)
            copied = 0
            with self.fs.open(self.full_path(rel), "rb", cache_type="none") as src:
                while chunk := src.read(CHUNK_BYTES):
                    dest.write(chunk)
                    copied += len(chunk)
            return copied
        except FileNotFoundError:
            self.invalidate(rel)
            raise FileNotFoundError(rel) from None


def _copy_fd(src: int, dst: int, limit: int) -> int:
    """Copy ``src`` to ``dst``, at most ``limit`` bytes (copy_file_range where the kernel
    has it)."""
    copied = 0
    try:
        while copied < limit and (
            n := os.copy_file_range(src, dst, min(CHUNK_BYTES, limit - copied))
        ):
            copied += n
        return copied
    except OSError as e:
        if copied or e.errno not in (18, 22, 38, 95):  # EXDEV, EINVAL, ENOSYS, EOPNOTSUPP
            raise
    while copied < limit and (chunk := os.read(src, min(CHUNK_BYTES, limit - copied))):
        view = memoryview(chunk)
        while view:
            view = view[os.write(dst, view) :]
        copied += len(chunk)
    return copied


def _basename(name: str, http: bool) -> str:
    base = posixpath.basename(name.rstrip("/"))
    if http:
        base = urllib.parse.unquote(base.split("?", 1)[0])
    return base


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)


def open_source(
    url_or_path: str,
    metadata_ttl_s: float = 30.0,
    clock: Callable[[], float] = time.monotonic,
    **storage_options: Any,
) -> Source:
    """A :class:`Source` for a local path or an fsspec URL whose root can be listed.

    Raises SourceError (naming the source, never its credentials) when it is missing,
    unreadable, not a directory, or the URL names no known file system."""
    shown = redact(url_or_path)
    if not url_or_path:
        raise SourceError("the source is empty: give a path or an fsspec URL")
    try:
        if "://" in url_or_path or "::" in url_or_path:
            fs, root = fsspec.core.url_to_fs(url_or_path, **storage_options)
        else:
            fs, root = LocalFileSystem(), os.path.abspath(url_or_path)
    except (ValueError, ImportError) as e:
        raise SourceError(f"source {shown}: {e}") from None
    if "http" in _protocols(fs):
        root = url_or_path
    shown_url = root if isinstance(fs, LocalFileSystem) else url_or_path
    source = Source(fs, root, shown_url, metadata_ttl_s=metadata_ttl_s, clock=clock)
    if source.local:
        if not os.path.exists(root):
            raise SourceError(f"source {shown}: no such directory")
        if not os.path.isdir(root):
            raise SourceError(f"source {shown}: not a directory")
        if not os.access(root, os.R_OK | os.X_OK):
            raise SourceError(f"source {shown}: permission denied")
    try:
        source.listdir("")
    except FileNotFoundError:
        raise SourceError(f"source {shown}: no such directory") from None
    except NotADirectoryError:
        raise SourceError(f"source {shown}: not a directory") from None
    except PermissionError:
        raise SourceError(f"source {shown}: permission denied") from None
    except Exception as e:  # any backend error at open: a bad source
        raise SourceError(f"source {shown}: cannot be listed: {type(e).__name__}: {e}") from None
    return source
