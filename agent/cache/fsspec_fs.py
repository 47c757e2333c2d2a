"""``mgcache::<url>``: the node's dataset cache as an fsspec file system, for Python loaders.

The cache itself is the node's ``metalguard cache mount`` process (one per dataset, the
only writer of its cache dir).  This file system reads *hits* straight from that
process's cached copies — a plain local ``open()``, no FUSE hop — and lets the mount do
everything else: it asks the mount (``getxattr user.mgcache.path``, one round trip) for
a file's cached copy, which fills it on a miss; a file the cache does not take (policy,
too large, full disk) is read through the mount.

Usage::

    fsspec.open("mgcache::s3://bucket/imagenet/train/0001.jpg")   # chained: the source URL
    fsspec.filesystem("mgcache", dataset="imagenet").open("train/0001.jpg")
    fsspec.filesystem("mgcache", mountpoint="/mnt/datasets/imagenet")

Which mount: ``mountpoint=``; else ``dataset=`` (its ``mountpoint`` in ``config=``,
default /etc/metalguard/agent.toml); else ``$MG_DATASET_DIR`` (what a job member that
names a dataset gets); else, for a chained URL, the ``[[cache.datasets]]`` entry whose
source holds it.  Chained paths must lie inside the mount's source; plain paths are
relative to the dataset's root.

Freshness: an answer of the mount is reused for the mount's ``metadata_ttl_s`` (so a
hit costs no round trip); a copy evicted meanwhile is noticed at ``open`` (the file is
gone) and asked for again.  A source change is therefore seen within twice the TTL.
Hits read from cached copies are reported to the mount over a datagram socket (best
effort: a full queue drops the report, counted in ``unreported_hits``) so its hit
counters and policy see them.

Without a running mount (none found, or it died) reads go to the source directly
through the chained target file system (a logged warning, once), or raise
``FileNotFoundError`` with ``fallback=False`` or when there is no target.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
import threading
import time
from pathlib import Path
from typing import IO, Any

import fsspec
import msgspec
from fsspec.spec import AbstractFileSystem

from metalguard.agent.cache.fusefs import XATTR_INFO, XATTR_PATH, MountInfo

try:  # fsspec >= 2025.10 passes a chained URL's inner path through to subclasses
    from fsspec.implementations.chained import ChainedFileSystem as _Base
except ImportError:  # pragma: no cover - older fsspec: the ``fo`` fallback below
    _Base = AbstractFileSystem

log = logging.getLogger(__name__)

PROTOCOL = "mgcache"
DEFAULT_CONFIG = "/etc/metalguard/agent.toml"
RETRY_S = 5.0
"""Without a running mount, how often to look for one again."""
_UNAVAILABLE = (errno.ENOTCONN, errno.ECONNABORTED, errno.ENODATA, errno.ENOTSUP, errno.ENOENT)


class MGCacheFileSystem(_Base):  # type: ignore[misc]
    """Read-only fsspec view of a dataset through the node's cache (see the module doc)."""

    protocol = PROTOCOL
    root_marker = ""

    def __init__(
        self,
        target_protocol: str | None = None,
        target_options: dict[str, Any] | None = None,
        fo: str = "",
        mountpoint: str | None = None,
        dataset: str | None = None,
        config: str | None = None,
        fallback: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.target: AbstractFileSystem | None = (
            fsspec.filesystem(target_protocol, **(target_options or {}))
            if target_protocol
            else None
        )
        self._fo = fo
        self._fallback = fallback
        self._lock = threading.Lock()
        self._known: dict[str, tuple[str, float]] = {}
        self._sock: socket.socket | None = None
        self._sock_pid = -1
        self._warned = False
        self.unreported_hits = 0
        """Hits read from a cached copy that the mount was not told of (its datagram queue
        was full or it was gone): the mount's hit counter is short by this many."""
        self.mountpoint = _find_mountpoint(mountpoint, dataset, config, target_protocol, fo)
        self.info_: MountInfo | None = None
        self._root = ""
        self._looked_at = -RETRY_S
        self._mount()

    def _mount(self) -> MountInfo | None:
        """The running mount's info; looked for again at most every RETRY_S when none."""
        if self.info_ is not None or self.mountpoint is None:
            return self.info_
        now = time.monotonic()
        if now - self._looked_at < RETRY_S:
            return None
        self._looked_at = now
        info = _mount_info(self.mountpoint)
        if info is not None:
            if self.target is not None:
                self._root = self.target._strip_protocol(info.source).rstrip("/")
            self._warned = False
        self.info_ = info
        return info

    def _lost(self, e: OSError) -> bool:
        """Whether ``e`` says the mount died (then forget it: the source serves)."""
        if e.errno not in (errno.ENOTCONN, errno.ECONNABORTED):
            return False
        log.warning("%s: the cache mount at %s is gone: %s", PROTOCOL, self.mountpoint, e)
        self.info_ = None
        self._looked_at = time.monotonic()
        with self._lock:
            self._known.clear()
        return True

    # -- paths ---------------------------------------------------------------------------

    def _rel(self, path: str) -> str:
        """The dataset-relative path of a caller's path (chained: a target path)."""
        path = self._strip_protocol(path) or self._fo
        if self.target is None:
            return path.strip("/")
        path = self.target._strip_protocol(path).rstrip("/")
        if not self._root:
            raise FileNotFoundError(f"{path}: no running cache mount knows this dataset")
        if path == self._root:
            return ""
        if not path.startswith(self._root + "/"):
            raise FileNotFoundError(f"{path}: outside the cached dataset {self._root}")
        return path[len(self._root) + 1 :]

    def _outer(self, rel: str) -> str:
        """A dataset-relative path back in the caller's terms."""
        if self.target is None:
            return rel
        return f"{self._root}/{rel}" if rel else self._root

    def _mounted(self, rel: str) -> str:
        assert self.mountpoint is not None
        return os.path.join(self.mountpoint, rel) if rel else self.mountpoint

    # -- data ----------------------------------------------------------------------------

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> IO[bytes]:
        if mode != "rb":
            raise PermissionError(f"{PROTOCOL}: read-only (mode {mode!r})")
        if self._mount() is None:
            return self._source_open(path)
        rel = self._rel(path)
        try:
            return self._open_cached(rel)
        except OSError as e:
            if self._lost(e):
                return self._source_open(path)
            raise

    def _open_cached(self, rel: str) -> IO[bytes]:
        now = time.monotonic()
        with self._lock:
            known = self._known.get(rel)
        if known is not None and now < known[1]:
            try:
                f = open(known[0], "rb")  # noqa: SIM115 - the caller closes it
            except (FileNotFoundError, PermissionError):  # evicted or replaced: ask again
                with self._lock:
                    self._known.pop(rel, None)
            else:
                self._report(rel)
                return f
        local = self._ask(rel)
        if local is not None:
            try:
                return open(local, "rb")
            except (FileNotFoundError, PermissionError):  # evicted meanwhile; unreadable
                pass
        return open(self._mounted(rel), "rb")

    def _ask(self, rel: str) -> str | None:
        """The mount's cached copy of ``rel`` (filled on a miss), None: read it through."""
        try:
            answer = os.fsdecode(os.getxattr(self._mounted(rel), XATTR_PATH))
        except OSError as e:
            if e.errno == errno.ENODATA:
                return None
            raise
        info = self.info_
        if info is None:
            return None
        local = os.path.join(info.cache_dir, answer)
        ttl = info.metadata_ttl_s
        if ttl > 0:
            with self._lock:
                self._known[rel] = (local, time.monotonic() + ttl)
        return local

    def _report(self, rel: str) -> None:
        """Tell the mount about a hit read from its copy (fire and forget)."""
        name = self.info_.hits_socket if self.info_ is not None else ""
        if not name:
            return
        try:
            with self._lock:
                if self._sock is None or self._sock_pid != os.getpid():  # a forked worker
                    self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                    self._sock.setblocking(False)
                    self._sock_pid = os.getpid()
                sock = self._sock
            sock.sendto(rel.encode() + b"\n", "\0" + name[1:])
        except OSError:  # the mount is gone or its queue is full: this hit goes uncounted
            with self._lock:
                self.unreported_hits += 1

    def _source_open(self, path: str) -> IO[bytes]:
        if self.target is None or not self._fallback:
            where = self.mountpoint or "none found"
            raise FileNotFoundError(
                f"{PROTOCOL}: no running cache mount (mountpoint: {where}); "
                "start `metalguard cache mount` for this dataset"
            )
        if not self._warned:
            self._warned = True
            log.warning(
                "%s: no running cache mount (%s): reading from the source directly",
                PROTOCOL,
                self.mountpoint or "none found",
            )
        target_path = self.target._strip_protocol(self._strip_protocol(path) or self._fo)
        f: IO[bytes] = self.target.open(target_path, "rb")
        return f

    # -- metadata (through the mount: the cache's listings) ----------------------------------

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        """The entries of a directory (``detail``: fsspec info dicts)."""
        if self._mount() is None:
            entries: list[Any] = self._source_fs().ls(
                self._source_path(path), detail=detail, **kwargs
            )
            return entries
        rel = self._rel(path)
        out: list[Any] = []
        with os.scandir(self._mounted(rel)) as it:
            for entry in sorted(it, key=lambda e: e.name):
                child = f"{rel}/{entry.name}" if rel else entry.name
                out.append(self._info_of(child, entry.stat()) if detail else self._outer(child))
        return out

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        """name, size, type (and mtime) of one path."""
        if self._mount() is None:
            info: dict[str, Any] = self._source_fs().info(self._source_path(path), **kwargs)
            return info
        rel = self._rel(path)
        return self._info_of(rel, os.stat(self._mounted(rel)))

    def _info_of(self, rel: str, st: os.stat_result) -> dict[str, Any]:
        kind = "directory" if stat.S_ISDIR(st.st_mode) else "file"
        return {"name": self._outer(rel), "size": st.st_size, "type": kind, "mtime": st.st_mtime}

    def _source_fs(self) -> AbstractFileSystem:
        if self.target is None or not self._fallback:
            raise FileNotFoundError(f"{PROTOCOL}: no running cache mount")
        return self.target

    def _source_path(self, path: str) -> str:
        assert self.target is not None
        return str(self.target._strip_protocol(self._strip_protocol(path) or self._fo))

    def cached_path(self, path: str) -> str | None:
        """The local file a read of ``path`` would use now (filled on a miss), or None."""
        if self._mount() is None:
            return None
        return self._ask(self._rel(path))


def _find_mountpoint(
    mountpoint: str | None,
    dataset: str | None,
    config: str | None,
    target_protocol: str | None,
    fo: str,
) -> str | None:
    """Where the dataset is mounted (see the module doc), or None."""
    if mountpoint:
        return mountpoint
    if dataset or target_protocol:
        found = _from_config(Path(config or DEFAULT_CONFIG), dataset, target_protocol, fo)
        if found:
            return found
        if dataset:
            return None
    return os.environ.get("MG_DATASET_DIR") or None


def _from_config(
    path: Path, dataset: str | None, target_protocol: str | None, fo: str
) -> str | None:
    from metalguard.agent.config import ConfigError, load_config

    try:
        datasets = load_config(path).cache.datasets
    except (ConfigError, ValueError, OSError):
        return None
    for d in datasets:
        if not d.mountpoint:
            continue
        if dataset is not None:
            if d.name == dataset:
                return d.mountpoint
            continue
        if target_protocol and _holds(d.source, target_protocol, fo):
            return d.mountpoint
    return None


def _holds(source: str, target_protocol: str, fo: str) -> bool:
    """Whether the chained path ``fo`` of ``target_protocol`` lies in ``source``."""
    try:
        cls = fsspec.get_filesystem_class(target_protocol)
        root = str(cls._strip_protocol(source)).rstrip("/")
        inner = str(cls._strip_protocol(fo)).rstrip("/")
    except (ValueError, ImportError):
        return False
    return bool(root) and (inner == root or inner.startswith(root + "/"))


def _mount_info(mountpoint: str) -> MountInfo | None:
    """The running mount's :class:`MountInfo`, or None when none runs there."""
    try:
        return msgspec.json.decode(os.getxattr(mountpoint, XATTR_INFO), type=MountInfo)
    except OSError as e:
        if e.errno not in _UNAVAILABLE:
            log.warning("%s: %s: %s", PROTOCOL, mountpoint, e)
        return None
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


fsspec.register_implementation(PROTOCOL, MGCacheFileSystem, clobber=True)
