"""A real ``metalguard cache mount`` process over a real FUSE mount, for the cache tests.

:class:`CacheMount` starts ``python -m metalguard cache mount ...`` and waits for its
ready line (printed once the kernel shows the mount) on an event with a deadline; its
output is collected by a reader thread.  :func:`fuse_skip_reason` says why FUSE tests
cannot run here (not root, no /dev/fuse, no fusermount3, no libfuse3).
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import msgspec

from metalguard.proto.telemetry import DatasetCache
from tests.support import ROOT
from tests.support.waiting import wait_until_blocking

READY_TIMEOUT_S = 30.0
EXIT_TIMEOUT_S = 30.0
READY_LINE = "metalguard cache: mounted"


def fuse_skip_reason() -> str | None:
    """Why a real FUSE mount cannot be made here, or None."""
    if os.geteuid() != 0:
        return "FUSE mount tests need root (CI runs them as root)"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse in this environment"
    if shutil.which("fusermount3") is None:
        return "fusermount3 not installed (Debian: fuse3)"
    try:
        import mfusepy  # noqa: F401 - loads libfuse3
    except (ImportError, OSError, AttributeError) as e:
        return f"mfusepy cannot load libfuse3: {e}"
    return None


def is_dead_mount(path: Path) -> bool:
    """Whether ``path`` is a FUSE mount whose process is gone (ENOTCONN)."""
    try:
        os.stat(path)
        os.statvfs(path)  # always asks the file system; stat may answer from its cache
    except OSError as e:
        return e.errno in (errno.ENOTCONN, errno.ECONNABORTED)
    return False


def released(path: Path) -> bool:
    """The mountpoint is a plain directory again: no live mount, no dead one."""
    return not is_dead_mount(path) and not os.path.ismount(path)


def force_unmount(path: Path) -> None:
    """Teardown: detach whatever is mounted at ``path`` (live or dead)."""
    if os.path.ismount(path) or is_dead_mount(path):
        subprocess.run(["fusermount3", "-uz", str(path)], capture_output=True, check=False)
        if os.path.ismount(path) or is_dead_mount(path):
            subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def cache_command(*args: str) -> list[str]:
    """``python -m metalguard --log-level info cache ...``."""
    return [sys.executable, "-m", "metalguard", "--log-level", "info", "cache", *args]


def mount_args(
    source: Path | str,
    mountpoint: Path,
    cache_dir: Path,
    max_bytes: int,
    *extra: str,
    policy: str = "auto",
    metadata_ttl: float = 30.0,
    min_free_bytes: int = 0,
) -> list[str]:
    """The flags of one ``cache mount``."""
    return [
        "mount",
        "--source",
        str(source),
        "--mountpoint",
        str(mountpoint),
        "--cache-dir",
        str(cache_dir),
        "--max-bytes",
        str(max_bytes),
        "--policy",
        policy,
        "--metadata-ttl",
        str(metadata_ttl),
        "--min-free-bytes",
        str(min_free_bytes),
        "--stats-interval",
        "0.2",
        *extra,
    ]


class CacheMount:
    """One cache process; ``wait_ready`` blocks until its mount is up (or it exited)."""

    def __init__(
        self, args: Sequence[str], mountpoint: Path | None = None, prefix: Sequence[str] = ()
    ) -> None:
        self.args = list(args)
        self.mountpoint = mountpoint or Path(self.args[self.args.index("--mountpoint") + 1])
        self.lines: list[str] = []
        self.errors: list[str] = []
        self._ready = threading.Event()
        self.proc = subprocess.Popen(
            [*prefix, *cache_command(*self.args)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        self._threads = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self.lines), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, self.errors), daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _read(self, stream: object, into: list[str]) -> None:
        for line in stream:  # type: ignore[attr-defined]
            into.append(line)
            if READY_LINE in line:
                self._ready.set()
        self._ready.set()  # the output ended: wait_ready looks at why

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> CacheMount:
        """Until the ready line; AssertionError with the output when it never comes."""
        if not self._ready.wait(timeout_s):
            raise AssertionError(f"no ready line within {timeout_s}s: {self.output()}")
        if not any(READY_LINE in line for line in self.lines):
            self.proc.wait(EXIT_TIMEOUT_S)
            raise AssertionError(f"exited {self.proc.returncode} before mounting: {self.output()}")
        assert os.path.ismount(self.mountpoint), self.output()
        return self

    def wait_exit(self, timeout_s: float = EXIT_TIMEOUT_S) -> int:
        """The exit status (the output threads drained)."""
        code = self.proc.wait(timeout_s)
        for t in self._threads:
            t.join(timeout_s)
        return code

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Send ``sig`` and wait for the exit status."""
        self.proc.send_signal(sig)
        return self.wait_exit()

    def output(self) -> str:
        return "stdout:\n" + "".join(self.lines) + "stderr:\n" + "".join(self.errors)

    def stats(self) -> DatasetCache:
        """The figures through the mount's ``.mgcache-stats`` (this moment's)."""
        data = (self.mountpoint / ".mgcache-stats").read_bytes()
        return msgspec.json.decode(data, type=DatasetCache)

    def close(self) -> None:
        """Teardown: kill if still running, release the mountpoint."""
        if self.proc.poll() is None:
            self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(EXIT_TIMEOUT_S)
        force_unmount(self.mountpoint)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


def run_cache(args: Sequence[str], prefix: Sequence[str] = ()) -> subprocess.CompletedProcess[str]:
    """A ``cache`` command that is expected to exit by itself (a refusal, ``stats``)."""
    return subprocess.run(
        [*prefix, *cache_command(*args)],
        capture_output=True,
        text=True,
        timeout=EXIT_TIMEOUT_S,
        cwd=ROOT,
        check=False,
    )


def make_dataset(
    root: Path, count: int, min_size: int, max_size: int, seed: int, subdirs: int = 0
) -> dict[str, bytes]:
    """Random files under ``root``: relative path -> content."""
    rng = random.Random(seed)
    files: dict[str, bytes] = {}
    for i in range(count):
        folder = f"d{i % subdirs}/" if subdirs else ""
        rel = f"{folder}f{i:04d}.bin"
        data = rng.randbytes(rng.randint(min_size, max_size))
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        files[rel] = data
    return files


def data_bytes_on_disk(cache_dir: Path) -> int:
    """Bytes of the cache's data files (complete copies and fills in flight)."""
    total = 0
    for sub in ("objects", "tmp"):
        for path in (cache_dir / sub).rglob("*"):
            with contextlib.suppress(FileNotFoundError):
                if path.is_file() and not path.name.endswith((".meta", ".tmp")):
                    total += path.stat().st_size
    return total


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``predicate`` (a child's effect: no event to wait on) until a deadline."""
    wait_until_blocking(predicate, timeout_s, what)


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A small tmpfs mounted at ``path`` (a disk that can be filled), unmounted after."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        check=True,
        capture_output=True,
    )
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


def tmpfs_skip_reason(probe: Path) -> str | None:
    """Why a tmpfs cannot be mounted here, or None."""
    probe.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe)],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        return f"cannot mount a tmpfs here: {result.stderr.strip()}"
    subprocess.run(["umount", str(probe)], check=False, capture_output=True)
    return None


def fill_disk(directory: Path, leave_bytes: int = 0) -> Path:
    """Write a filler file until the file system at ``directory`` has about
    ``leave_bytes`` free (0: until ENOSPC)."""
    filler = directory / "filler"
    st = os.statvfs(directory)
    want = max(st.f_bavail * st.f_frsize - leave_bytes, 0) if leave_bytes else None
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        chunk = b"\0" * 4096
        written = 0
        while want is None or written < want:
            try:
                written += os.write(fd, chunk)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                break
    finally:
        os.close(fd)
    return filler
