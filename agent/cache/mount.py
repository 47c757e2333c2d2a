"""``metalguard cache mount``: one dataset's cache, mounted with FUSE until a signal.

Order of work (every refusal is exit 2 with one line naming the problem):

1. the mountpoint: missing, not a directory, or a live mount -> refused; a dead FUSE
   mount left by a killed cache (ENOTCONN) -> cleared (``fusermount3 -uz``) and reused;
2. the cache directory: created if missing; refused when it cannot be written (a full
   disk, read-only, no permission), when another cache process holds it (``lock``), or
   when it lies inside the mountpoint;
3. the source: missing, unreadable, not a directory -> refused (SourceError);
4. the store opens (a warm cache left by the previous run is recovered), the FUSE
   session starts, and once the kernel sees the mount a ready line is printed on stdout
   (``metalguard cache: mounted ...``) and systemd is told ``READY=1``;
5. SIGTERM, SIGINT or SIGHUP: libfuse leaves its loop and unmounts; the store writes
   its last ``stats.json``; exit 0.  An unmount from outside (``fusermount3 -u``) ends
   it the same way.

Exit 1 when the FUSE session itself could not start (no /dev/fuse, libfuse refused).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING

from metalguard.agent.cache.mountpoint import (
    MountpointError,
    State,
    check_mountpoint,
    clear_dead_mount,
    is_within,
)
from metalguard.agent.sdnotify import notify

if TYPE_CHECKING:
    from metalguard.agent.cache.store import CacheStore

log = logging.getLogger(__name__)

GIB = 1024**3
READY_TIMEOUT_S = 30.0
READAHEAD_KB = 1024
"""The mount's readahead: 1 MiB requests instead of the kernel's 128 KiB (measured: ~1.7x
the hit throughput through the mount)."""
LOCK_FILE = "lock"
PROBE_BYTES = 4096


@dataclass(frozen=True, slots=True)
class MountOptions:
    """Everything ``cache mount`` needs (from flags, or a ``[[cache.datasets]]`` entry)."""

    dataset: str
    source: str
    mountpoint: str
    cache_dir: str
    max_bytes: int
    policy: str = "auto"
    min_free_bytes: int = GIB
    metadata_ttl_s: float = 30.0
    stats_interval_s: float = 2.0


class SetupError(Exception):
    """A bad input found before mounting (exit 2)."""


def main_mount(options: MountOptions, out: IO[str] | None = None) -> int:
    """Run the cache until a signal; 0 after a clean unmount, 2 for a bad input, 1 when
    the FUSE session could not start."""
    out = out or sys.stdout
    lock_fd = -1
    store: CacheStore | None = None
    try:
        mountpoint = os.path.abspath(options.mountpoint)
        cache_dir = os.path.abspath(options.cache_dir)
        _check_paths(mountpoint, cache_dir)
        if check_mountpoint(mountpoint) is State.DEAD:
            how = clear_dead_mount(mountpoint)
            log.warning("mountpoint %s: cleared a dead FUSE mount (%s)", mountpoint, how)
        lock_fd = _prepare_cache_dir(cache_dir)
        store = _open_store(options, mountpoint, cache_dir)
    except (MountpointError, SetupError) as e:
        print(f"metalguard: cache mount: {e}", file=sys.stderr)
        if store is not None:
            store.close()
        _unlock(lock_fd)
        return 2

    try:
        from metalguard.agent.cache.fusefs import CacheFS, MountInfo, fuse_options
    except (ImportError, OSError, AttributeError) as e:  # mfusepy loads libfuse3 on import
        print(f"metalguard: cache mount: libfuse3 unusable ({e}): install fuse3", file=sys.stderr)
        store.close()
        _unlock(lock_fd)
        return 1

    receiver = HitReceiver(_socket_name(cache_dir), store.cached_path)
    info = MountInfo(
        dataset=store.dataset,
        source=store.source.url,
        cache_dir=cache_dir,
        metadata_ttl_s=options.metadata_ttl_s,
        hits_socket=receiver.name,
    )
    started = threading.Event()

    def on_init() -> None:
        started.set()
        threading.Thread(
            target=_announce,
            args=(mountpoint, options, out, store.write_stats),
            name="mgcache-ready",
            daemon=True,
        ).start()

    fs = CacheFS(store, info, on_init=on_init)
    code = 0
    try:
        _run_fuse(fs, mountpoint, fuse_options(store.dataset, options.metadata_ttl_s))
    except RuntimeError as e:  # libfuse's exit status: a signal ends its loop with one too
        if not started.is_set():
            print(
                f"metalguard: cache mount: the FUSE mount at {mountpoint} failed ({e}; "
                "libfuse's message above): is /dev/fuse there, fuse3 installed?",
                file=sys.stderr,
            )
            code = 1
    finally:
        receiver.close()
        store.close()
        _unlock(lock_fd)
    if started.is_set():
        print(f"metalguard cache: unmounted {mountpoint}", file=out, flush=True)
    return code


def _run_fuse(fs: object, mountpoint: str, options: dict[str, object]) -> None:
    import mfusepy

    mfusepy.FUSE(fs, mountpoint, raw_fi=True, **options)


def _check_paths(mountpoint: str, cache_dir: str) -> None:
    if is_within(cache_dir, mountpoint):
        raise SetupError(f"cache dir {cache_dir} is inside the mountpoint {mountpoint}")
    if is_within(mountpoint, cache_dir):
        raise SetupError(f"mountpoint {mountpoint} is inside the cache dir {cache_dir}")


def _prepare_cache_dir(cache_dir: str) -> int:
    """Create ``cache_dir``, lock it for this process, prove it takes a write; the lock's
    fd (held until exit: a second cache on the same directory is refused)."""
    try:
        os.makedirs(cache_dir, exist_ok=True)
    except OSError as e:
        raise SetupError(f"cache dir {cache_dir}: cannot create it: {e.strerror or e}") from None
    if not os.path.isdir(cache_dir):
        raise SetupError(f"cache dir {cache_dir}: not a directory")
    lock_path = os.path.join(cache_dir, LOCK_FILE)
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise SetupError(f"cache dir {cache_dir}: {_why_unwritable(e)}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise SetupError(
            f"cache dir {cache_dir}: in use by another cache process (pid {holder})"
        ) from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _probe(cache_dir)
    except OSError as e:
        _unlock(fd)
        raise SetupError(f"cache dir {cache_dir}: {_why_unwritable(e)}") from None
    return fd


def _probe(cache_dir: str) -> None:
    """Write, fsync and remove a small file: a full or read-only disk fails here."""
    probe = os.path.join(cache_dir, f".probe-{os.getpid()}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, b"\0" * PROBE_BYTES)
            os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(probe)


def _why_unwritable(e: OSError) -> str:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return "its disk is full (no space left): free space, or give another cache dir"
    if e.errno == errno.EROFS:
        return "its file system is read-only"
    if e.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    return f"cannot write there: {e.strerror or e}"


def _unlock(fd: int) -> None:
    if fd >= 0:
        with contextlib.suppress(OSError):
            os.close(fd)


def _open_store(options: MountOptions, mountpoint: str, cache_dir: str) -> CacheStore:
    from metalguard.agent.cache.source import SourceError, open_source
    from metalguard.agent.cache.store import CacheStore

    try:
        source = open_source(options.source, metadata_ttl_s=options.metadata_ttl_s)
    except SourceError as e:
        raise SetupError(str(e)) from None
    try:
        store = CacheStore(
            source,
            cache_dir,
            options.max_bytes,
            options.policy,
            dataset=options.dataset,
            mountpoint=mountpoint,
            min_free_bytes=options.min_free_bytes,
            metadata_ttl_s=options.metadata_ttl_s,
            stats_interval_s=options.stats_interval_s,
        )
        return store.open()
    except ValueError as e:
        raise SetupError(str(e)) from None
    except OSError as e:
        raise SetupError(f"cache dir {cache_dir}: {_why_unwritable(e)}") from None


def _announce(
    mountpoint: str, options: MountOptions, out: IO[str], write_stats: Callable[[], object]
) -> None:
    """Once the kernel shows the mount: readahead, stats.json, the ready line, READY=1."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not os.path.ismount(mountpoint):
        if time.monotonic() >= deadline:
            log.error(
                "mountpoint %s: the mount did not appear within %ss", mountpoint, READY_TIMEOUT_S
            )
            return
        time.sleep(0.02)
    set_readahead(mountpoint, READAHEAD_KB)
    try:
        write_stats()
    except OSError as e:
        log.warning("cache %s: writing stats.json failed: %s", options.dataset, e)
    print(
        f"metalguard cache: mounted {options.dataset} at {mountpoint} "
        f"(cache {options.cache_dir}, max {options.max_bytes} bytes, policy {options.policy})",
        file=out,
        flush=True,
    )
    notify("READY=1")


def set_readahead(mountpoint: str, kb: int) -> bool:
    """Raise the mount's readahead (its bdi's ``read_ahead_kb``); False where not allowed."""
    try:
        dev = os.stat(mountpoint).st_dev
        Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb").write_text(f"{kb}\n")
    except OSError as e:
        log.debug("mountpoint %s: readahead left as it is: %s", mountpoint, e)
        return False
    return True


def _socket_name(cache_dir: str) -> str:
    digest = hashlib.sha1(os.path.realpath(cache_dir).encode(), usedforsecurity=False)
    return f"@mgcache-{digest.hexdigest()[:20]}"


class HitReceiver:
    """Takes the hits the ``mgcache::`` fsspec path read from cached copies itself: a
    datagram socket in the abstract namespace (no file, no permissions), one relative
    path per line; each one is counted by ``on_hit``.  Best effort: when the socket
    cannot be bound, :attr:`name` is "" and the fsspec path sends nothing."""

    def __init__(self, name: str, on_hit: Callable[[str], object]) -> None:
        self._on_hit = on_hit
        self._stop = threading.Event()
        self._sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._sock.bind("\0" + name[1:])
        except OSError as e:
            log.warning("hit socket %s: %s (fsspec hits are not counted)", name, e)
            self._sock.close()
            self._sock = None
            self.name = ""
            return
        self._sock.settimeout(0.5)
        self.name = name
        self._thread = threading.Thread(target=self._loop, name="mgcache-hits", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                data = self._sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            for line in data.decode(errors="replace").splitlines():
                if line:
                    try:
                        self._on_hit(line)
                    except Exception as e:  # a bad path from a client counts nothing
                        log.debug("hit report %r: %s", line, e)

    def close(self) -> None:
        """Stop receiving."""
        if self._sock is None:
            return
        self._stop.set()
        self._thread.join()
        self._sock.close()
        self._sock = None
