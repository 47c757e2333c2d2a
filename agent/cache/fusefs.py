"""The dataset cache's FUSE file system: a read-only view of the source over a CacheStore.

:class:`CacheFS` is an :mod:`mfusepy` ``Operations`` object (``raw_fi``: it sets
``keep_cache`` and ``direct_io`` on opens).  Every callback may run on any of libfuse's
worker threads at once; the store is thread-safe, and the little state kept here (the
stats snapshots of open ``.mgcache-stats`` handles, the versions the kernel's page cache
holds) sits behind one lock held only around dict operations.

What it serves
--------------
* The source's directories and files (mode 0555 / 0444), from the store's TTL-cached
  listings; reads through :meth:`CacheStore.read` (a hit, a fill on a miss, or a read
  through) — every byte is the store's, whose bytes are the source's.
* ``/.mgcache-stats`` (:data:`STATS_NAME`): the cache's figures (the ``stats.json``
  record, msgspec JSON) taken at open; not listed by ``readdir`` (a dataset walker does
  not see it), found by name.  It shadows a source file of that name.
* Extended attributes for the ``mgcache::`` fsspec path (fsspec_fs.py), which reads hits
  from the cached copies without a FUSE hop: ``user.mgcache.path`` on a file fills it if
  needed and answers the path of its current cached copy, relative to the cache dir
  (ENODATA when the file is read through; each call is one access for the store);
  ``user.mgcache.info`` on the root answers :class:`MountInfo` as JSON.
  Neither is listed by ``listxattr``.

The page cache: an open whose file has the version (size, mtime, ETag) the kernel's
pages were read at sets ``keep_cache``, so repeated reads of an unchanged file never
reach user space; any other open leaves it unset, which makes the kernel drop the
file's pages.  Versions only move forward (a changed source file is dropped and
fetched again), so pages read at the current version are the current bytes.

Hits without copying in Python (``read_buf``): an open of a file whose current copy is
cached takes a descriptor of that copy (:meth:`StoreLike.open_copy`, a ``dup`` of the
store's) and keeps it until release; each read then answers libfuse a *descriptor*
buffer (``FUSE_BUF_IS_FD``: the descriptor and the offset), and libfuse reads (or
splices, ``FUSE_CAP_SPLICE_WRITE``) the bytes itself, in C, without the GIL — Python only
fills a 64-byte struct.  An open file reads the copy it opened, whatever happens to the
cache meanwhile (an evicted or dropped copy's data stays readable through the
descriptor): the version at open, like close-to-open consistency.  Any other read
(a miss, a read-through, the stats file) answers a memory buffer of the bytes
:meth:`read` returns.  The buffers are ``malloc``'d, as libfuse frees them.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import cachetools
import mfusepy
import msgspec

from metalguard.agent.cache.source import Entry, normalize
from metalguard.proto.telemetry import DatasetCache

log = logging.getLogger(__name__)

STATS_NAME = ".mgcache-stats"
XATTR_PATH = "user.mgcache.path"
XATTR_INFO = "user.mgcache.info"
PAGE_VERSIONS = 200_000
"""Files whose page-cache version is remembered (forgetting one costs a re-read)."""
_ENOATTR = getattr(errno, "ENOATTR", errno.ENODATA)
_DIR_TYPE = {"st_mode": stat.S_IFDIR}
_FILE_TYPE = {"st_mode": stat.S_IFREG}
SPLICE = True
"""Ask libfuse to splice descriptor buffers into /dev/fuse (no copy through its memory)."""
MAX_READ = 512 * 1024
"""The largest read request the kernel sends (``max_read``, in the mount options and in
INIT): libfuse splices a descriptor buffer only when the whole reply fits its pipe (the
data plus a few pages, at most /proc/sys/fs/pipe-max-size, 1 MiB by default), so the
kernel's default 1 MiB requests fell back to a pread into memory and a copy into
/dev/fuse.  512 KiB requests splice: measured, hits through the mount at ~1.1-1.4 GB/s
with 4 readers instead of ~0.6-0.7 GB/s (bench/cache_bench.py --mount-only)."""
_CAP_SPLICE_WRITE = 1 << 7  # fuse_common.h (libfuse 3)
_CAP_SPLICE_MOVE = 1 << 8
_BUF_IS_FD = 1 << 1  # enum fuse_buf_flags
_BUF_FD_SEEK = 1 << 2
_BUF_FD_RETRY = 1 << 3


class _FuseBuf(ctypes.Structure):
    """``struct fuse_buf`` (fuse_common.h, libfuse 3.0-3.16)."""

    _fields_ = (
        ("size", ctypes.c_size_t),
        ("flags", ctypes.c_int),
        ("mem", ctypes.c_void_p),
        ("fd", ctypes.c_int),
        ("pos", ctypes.c_int64),
    )


class _FuseBufvec(ctypes.Structure):
    """``struct fuse_bufvec`` with its one inline ``buf[1]`` (mfusepy declares a pointer)."""

    _fields_ = (
        ("count", ctypes.c_size_t),
        ("idx", ctypes.c_size_t),
        ("off", ctypes.c_size_t),
        ("buf", _FuseBuf * 1),
    )


READ_BUF = (mfusepy.fuse_version_major, mfusepy.fuse_version_minor) >= (3, 0) and (
    mfusepy.fuse_version_minor < 17
)
"""Answer reads with descriptor buffers (``read_buf``) where ``struct fuse_buf`` is the
one above (libfuse 3.0-3.16); elsewhere every read goes through :meth:`CacheFS.read`."""
_SLACK = 64
"""Zeroed bytes after each ``fuse_bufvec`` (room for fields a newer libfuse might read)."""

_libc = ctypes.CDLL(None)
_malloc = _libc.malloc
_malloc.restype = ctypes.c_void_p
_malloc.argtypes = (ctypes.c_size_t,)
_free = _libc.free
_free.restype = None
_free.argtypes = (ctypes.c_void_p,)


def _answer(bufpp: Any, *, fd: int = -1, pos: int = 0, size: int = 0, data: bytes = b"") -> int:
    """Point libfuse's ``*bufpp`` at a new ``fuse_bufvec``: ``size`` bytes of ``fd`` from
    ``pos`` (fd >= 0), else a copy of ``data`` (libfuse frees both)."""
    addr = _malloc(ctypes.sizeof(_FuseBufvec) + _SLACK)
    if not addr:
        raise mfusepy.FuseOSError(errno.ENOMEM)
    ctypes.memset(addr, 0, ctypes.sizeof(_FuseBufvec) + _SLACK)
    vec = _FuseBufvec.from_address(addr)
    vec.count, vec.idx, vec.off = 1, 0, 0
    buf = vec.buf[0]
    if fd >= 0:
        buf.size, buf.flags, buf.mem, buf.fd, buf.pos = (
            size,
            _BUF_IS_FD | _BUF_FD_SEEK | _BUF_FD_RETRY,
            None,
            fd,
            pos,
        )
    else:
        mem = _malloc(max(len(data), 1))
        if not mem:
            _free(addr)
            raise mfusepy.FuseOSError(errno.ENOMEM)
        ctypes.memmove(mem, data, len(data))
        buf.size, buf.flags, buf.mem, buf.fd, buf.pos = len(data), 0, mem, -1, 0
    ctypes.cast(bufpp, ctypes.POINTER(ctypes.c_void_p))[0] = addr
    return 0


@dataclass(eq=False, slots=True)
class _Copy:
    """An open file read from its cached copy's descriptor."""

    key: str
    fd: int
    size: int
    nbytes: int = 0
    """Bytes served and not yet reported to the store (reported at release)."""


class StoreLike(Protocol):
    """What :class:`CacheFS` needs of a :class:`~.store.CacheStore`."""

    def stat(self, path: str) -> Entry: ...

    def listdir(self, path: str = "") -> list[Entry]: ...

    def read(self, path: str, offset: int, size: int) -> bytes: ...

    def fetch(self, path: str) -> Path | None: ...

    def stats(self) -> DatasetCache: ...

    def open_copy(self, path: str) -> tuple[int, int] | None: ...

    def note_read(self, path: str, nbytes: int, access: bool) -> None: ...


class MountInfo(msgspec.Struct, frozen=True):
    """What ``user.mgcache.info`` on the mount's root answers (the fsspec path's view)."""

    dataset: str
    source: str
    """The source, without credentials."""
    cache_dir: str
    metadata_ttl_s: float
    hits_socket: str = ""
    """A datagram socket taking the relative paths of hits read from cached copies
    directly ("" when none)."""


class CacheFS(mfusepy.Operations):  # type: ignore[misc]
    """A read-only FUSE view of ``store`` (mount it with :func:`fuse_options` and
    ``raw_fi=True``); ``on_init`` runs once libfuse has started the session."""

    use_ns = True

    def __init__(
        self,
        store: StoreLike,
        info: MountInfo,
        on_init: Callable[[], None] | None = None,
    ) -> None:
        self._store = store
        self._info = msgspec.json.encode(info)
        self._cache_dir = info.cache_dir
        self._on_init = on_init
        self._uid = os.getuid()
        self._gid = os.getgid()
        self._lock = threading.Lock()
        self._snapshots: dict[int, bytes] = {}
        self._copies: dict[int, _Copy] = {}
        self._next_fh = 1
        self._started = time.time()
        self._page_versions: cachetools.LRUCache[str, tuple[int, float, str]] = cachetools.LRUCache(
            PAGE_VERSIONS
        )

    # -- lifecycle -------------------------------------------------------------------------

    def init_with_config(self, conn_info: Any, config_3: Any) -> None:
        """libfuse started the session (the kernel's INIT): splice where it can (SPLICE),
        reads of at most :data:`MAX_READ` (libfuse wants INIT's value equal to the mount
        option's), then tell the runner."""
        if conn_info is not None:
            conn_info.max_read = MAX_READ
            if SPLICE:
                conn_info.want |= conn_info.capable & (_CAP_SPLICE_WRITE | _CAP_SPLICE_MOVE)
        if self._on_init is not None:
            self._on_init()

    # -- metadata --------------------------------------------------------------------------

    def getattr(self, path: str, fh: Any = None) -> dict[str, Any]:
        """stat(2) of ``path``: the source's entry, the root, or the stats file."""
        if path == "/" + STATS_NAME:
            return self._file_attrs(len(self._stats_bytes()), 0)
        entry = self._entry(path)
        if entry.is_dir:
            return self._dir_attrs(entry.mtime)
        return self._file_attrs(entry.size, entry.mtime)

    def readdir(self, path: str, fh: int) -> list[tuple[str, dict[str, int], int]]:
        """The names in directory ``path`` with their types (the kernel's ``d_type``: a
        walker needs no stat per entry); the stats file is not listed.  The listing is the
        store's with sizes (over http: ``HEAD`` requests for the whole directory at once),
        so the opens and stats that follow ask the source nothing within the TTL."""
        try:
            entries = self._store.listdir(_rel(path))
        except (FileNotFoundError, ValueError):
            raise mfusepy.FuseOSError(errno.ENOENT) from None
        except NotADirectoryError:
            raise mfusepy.FuseOSError(errno.ENOTDIR) from None
        except OSError as e:
            raise _io_error("listing", path, e) from None
        return [
            (".", _DIR_TYPE, 0),
            ("..", _DIR_TYPE, 0),
            *((e.name, _DIR_TYPE if e.is_dir else _FILE_TYPE, 0) for e in entries),
        ]

    def statfs(self, path: str) -> dict[str, int]:
        """The cache's capacity and occupancy, in 4 KiB blocks (what ``df`` shows)."""
        s = self._store.stats()
        block = 4096
        total = max(s.max_bytes // block, 1)
        used = min(s.used_bytes // block, total)
        return {
            "f_bsize": block,
            "f_frsize": block,
            "f_blocks": total,
            "f_bfree": total - used,
            "f_bavail": 0,
            "f_files": s.cached_files,
            "f_ffree": 0,
            "f_favail": 0,
            "f_namemax": 255,
        }

    def getxattr(self, path: str, name: str, position: int = 0) -> bytes:
        """``user.mgcache.path`` (a file's cached copy) and ``user.mgcache.info`` (the
        root); ENODATA for any other name, or when the file is read through."""
        if name == XATTR_INFO and path == "/":
            return self._info
        if name != XATTR_PATH or path in ("/", "/" + STATS_NAME):
            raise mfusepy.FuseOSError(_ENOATTR)
        entry = self._entry(path)
        if entry.is_dir:
            raise mfusepy.FuseOSError(_ENOATTR)
        try:
            local = self._store.fetch(entry.path)
        except FileNotFoundError:
            raise mfusepy.FuseOSError(errno.ENOENT) from None
        except OSError as e:
            raise _io_error("fetching", path, e) from None
        if local is None:
            raise mfusepy.FuseOSError(_ENOATTR)
        # Relative to the cache dir: short enough for one getxattr call of the caller
        # (CPython's os.getxattr tries 128 bytes first; a second call would count twice).
        return os.fsencode(os.path.relpath(local, self._cache_dir))

    def listxattr(self, path: str) -> list[str]:
        """No attributes listed (``user.mgcache.*`` are asked for by name)."""
        return []

    # -- data -------------------------------------------------------------------------------

    def open(self, path: str, fi: Any) -> int:
        """Read-only opens; ``keep_cache`` when the kernel's pages are of this version."""
        if fi.flags & os.O_ACCMODE != os.O_RDONLY:
            raise mfusepy.FuseOSError(errno.EROFS)
        if path == "/" + STATS_NAME:
            with self._lock:
                fh = self._next_fh
                self._next_fh += 1
                self._snapshots[fh] = self._stats_bytes()
            fi.fh = fh
            fi.direct_io = 1
            return 0
        entry = self._entry(path)
        if entry.is_dir:
            raise mfusepy.FuseOSError(errno.EISDIR)
        copy, fh = None, 0
        try:
            opened = self._store.open_copy(entry.path)
        except OSError:
            opened = None  # read() below answers (or fails) as the store does
        with self._lock:
            keep = self._page_versions.get(entry.path) == entry.version
            self._page_versions[entry.path] = entry.version
            if opened is not None:
                copy = _Copy(entry.path, opened[0], opened[1])
                fh = self._next_fh
                self._next_fh += 1
                self._copies[fh] = copy
        fi.fh = fh
        fi.keep_cache = 1 if keep else 0
        return 0

    def read_buf(self, path: str, bufpp: Any, size: int, offset: int, fi: Any) -> int:
        """libfuse's read: the open copy's descriptor and offset (libfuse reads the bytes),
        or the bytes of :meth:`read` (see the module doc)."""
        copy = self._copies.get(fi.fh) if fi.fh else None
        if copy is None:
            return _answer(bufpp, data=self.read(path, size, offset, fi))
        n = max(0, min(size, copy.size - offset))
        if offset == 0:  # a file read: the store counts it (policy, pattern, a hit)
            self._store.note_read(copy.key, n, access=True)
        else:
            copy.nbytes += n  # reported at release: no lock per read
        return _answer(bufpp, fd=copy.fd, pos=offset, size=n)

    def read(self, path: str, size: int, offset: int, fi: Any) -> bytes:
        """``size`` bytes at ``offset``: the store's (cached, filled or read through)."""
        if fi.fh:
            with self._lock:
                snapshot = self._snapshots.get(fi.fh)
                copy = self._copies.get(fi.fh)
            if copy is not None:
                data = os.pread(copy.fd, max(0, min(size, copy.size - offset)), offset)
                self._store.note_read(copy.key, len(data), access=offset == 0)
                return data
            return (snapshot or b"")[offset : offset + size]
        try:
            return self._store.read(_rel(path), offset, size)
        except (FileNotFoundError, ValueError):
            raise mfusepy.FuseOSError(errno.ENOENT) from None
        except IsADirectoryError:
            raise mfusepy.FuseOSError(errno.EISDIR) from None
        except OSError as e:
            raise _io_error("reading", path, e) from None
        except Exception as e:  # a source backend's own exception: the reader sees EIO
            log.warning("reading %s failed: %s: %s", path, type(e).__name__, e)
            raise mfusepy.FuseOSError(errno.EIO) from None

    def release(self, path: str, fi: Any) -> int:
        """Forget an open stats file's snapshot; close an open copy's descriptor."""
        if fi.fh:
            with self._lock:
                self._snapshots.pop(fi.fh, None)
                copy = self._copies.pop(fi.fh, None)
            if copy is not None:
                os.close(copy.fd)
                if copy.nbytes:
                    self._store.note_read(copy.key, copy.nbytes, access=False)
        return 0

    # -- helpers ----------------------------------------------------------------------------

    def _entry(self, path: str) -> Entry:
        try:
            return self._store.stat(_rel(path))
        except (FileNotFoundError, ValueError):
            raise mfusepy.FuseOSError(errno.ENOENT) from None
        except OSError as e:
            raise _io_error("stat of", path, e) from None
        except Exception as e:  # a source backend's own exception
            log.warning("stat of %s failed: %s: %s", path, type(e).__name__, e)
            raise mfusepy.FuseOSError(errno.EIO) from None

    def _stats_bytes(self) -> bytes:
        return msgspec.json.encode(self._store.stats()) + b"\n"

    def _dir_attrs(self, mtime: float) -> dict[str, Any]:
        ns = int((mtime or self._started) * 1e9)  # no mtime from the source: the mount's
        return {
            "st_mode": stat.S_IFDIR | 0o555,
            "st_nlink": 2,
            "st_uid": self._uid,
            "st_gid": self._gid,
            "st_mtime": ns,
            "st_ctime": ns,
            "st_atime": ns,
        }

    def _file_attrs(self, size: int, mtime: float) -> dict[str, Any]:
        ns = int(mtime * 1e9)
        return {
            "st_mode": stat.S_IFREG | 0o444,
            "st_nlink": 1,
            "st_size": size,
            "st_blocks": (size + 511) // 512,
            "st_uid": self._uid,
            "st_gid": self._gid,
            "st_mtime": ns,
            "st_ctime": ns,
            "st_atime": ns,
        }


if not READ_BUF:  # mfusepy then leaves libfuse's read_buf unset: reads use read()
    CacheFS.read_buf.libfuse_ignore = True  # type: ignore[attr-defined]


def fuse_options(dataset: str, metadata_ttl_s: float) -> dict[str, Any]:
    """The mount options: read-only, every user may read (``allow_other`` with the
    kernel checking the 0444/0555 modes), multithreaded, in the foreground, read requests
    of at most :data:`MAX_READ` (so that hits splice), and kernel attribute caching no
    longer than the metadata TTL (at most 1 s more staleness)."""
    timeout = min(metadata_ttl_s, 1.0)
    return {
        "foreground": True,
        "ro": True,
        "allow_other": True,
        "default_permissions": True,
        "fsname": f"mgcache:{dataset}",
        "subtype": "mgcache",
        "max_read": MAX_READ,
        "attr_timeout": timeout,
        "entry_timeout": timeout,
        "negative_timeout": timeout,
    }


def _rel(path: str) -> str:
    return normalize(path)


def _io_error(what: str, path: str, e: OSError) -> mfusepy.FuseOSError:
    code = e.errno if isinstance(e.errno, int) and e.errno > 0 else errno.EIO
    log.warning("%s %s failed: %s", what, path, e)
    return mfusepy.FuseOSError(code)
