"""A bounded, crash-safe, on-disk FIFO of messages that could not be published yet.

Layout of the spool directory::

    00000000000000000042.msg   one entry; the name is its position in the FIFO
    .00000000000000000043.tmp  an entry being written (removed at open)
    unreported_drops           lost entries not yet reported, carried over a restart
    lock                       flock'ed while a Spool owns the directory

An entry file is ``MAGIC | crc32(body) (4 bytes, big-endian) | body``, where the body is
the msgpack array ``[subject, msg_id, payload, enqueued_ts]``.  Each entry is written
to a temp file, fsync'ed and renamed into place, and the directory is fsync'ed once per
:meth:`Spool.append_many`, so a kill -9 at any moment leaves only whole entries (and a
stray temp file).  Removal does not fsync: an entry that reappears after a power loss is
replayed again and the server drops it by its message id.  A file that fails its magic
or CRC check is logged, deleted and counted; it never stops the spool.

When an append would exceed ``max_bytes`` (sum of entry file sizes) or ``max_entries``,
the **oldest** entries are deleted first and counted as dropped.

The class is synchronous and thread-safe (one lock).  Each call is a handful of small
file operations, but fsync can take tens of milliseconds on a busy disk, so the
publisher calls it through ``asyncio.to_thread`` to keep the event loop (collectors,
watchdog) responsive.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import struct
import threading
import time
import zlib
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import msgspec

from metalguard.runtime.durable import write_durably

log = logging.getLogger(__name__)

MAGIC = b"MGSPOOL1"
_HEADER = struct.Struct(">8sI")
_ENTRY_RE = re.compile(r"^(\d{20})\.msg$")
_TMP_SUFFIX = ".tmp"
_DROPS_FILE = "unreported_drops"
_LOCK_FILE = "lock"


class SpoolError(RuntimeError):
    """The spool directory cannot be used (locked by another process, not writable)."""


@dataclass(frozen=True, slots=True)
class SpoolEntry:
    """One message waiting to be published: its subject, JetStream message id, payload."""

    subject: str
    msg_id: str
    payload: bytes


@dataclass(frozen=True, slots=True)
class StoredEntry:
    """An entry read back from the spool, with its FIFO position."""

    index: int
    entry: SpoolEntry


class _Record(msgspec.Struct, array_like=True, frozen=True):
    subject: str
    msg_id: str
    payload: bytes
    enqueued_ts: float


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_Record)


def encode_entry(entry: SpoolEntry, now: float | None = None) -> bytes:
    """The bytes of an entry file."""
    ts = time.time() if now is None else now
    body = _encoder.encode(_Record(entry.subject, entry.msg_id, entry.payload, ts))
    return _HEADER.pack(MAGIC, zlib.crc32(body)) + body


def decode_entry(data: bytes) -> SpoolEntry:
    """Parse an entry file; raise ValueError if it is torn or not an entry."""
    if len(data) < _HEADER.size:
        raise ValueError(f"short file ({len(data)} bytes)")
    magic, crc = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ValueError("bad magic")
    body = data[_HEADER.size :]
    if zlib.crc32(body) != crc:
        raise ValueError("checksum mismatch")
    try:
        rec = _decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise ValueError(f"undecodable body: {exc}") from None
    return SpoolEntry(rec.subject, rec.msg_id, rec.payload)


class Spool:
    """A bounded FIFO of :class:`SpoolEntry` in one directory (see the module doc)."""

    def __init__(self, directory: Path, max_bytes: int, max_entries: int | None = None) -> None:
        if max_bytes <= 0 or (max_entries is not None and max_entries <= 0):
            raise ValueError("max_bytes and max_entries must be positive")
        self.directory = directory
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.dropped_total = 0
        """Entries evicted (oldest first) or refused because the spool was full."""
        self.corrupt_total = 0
        """Entry files found torn or garbled and deleted."""
        self._lock = threading.Lock()
        self._index: deque[tuple[int, int]] = deque()  # (index, file size), oldest first
        self._size = 0
        self._next = 1
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._lock_fd = _lock_directory(directory)
        try:
            self._scan()
            self._fsync_dir()
        except BaseException:
            self.close()
            raise

    # --- inspection ---------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._index)

    @property
    def size_bytes(self) -> int:
        """Total size of the entry files."""
        return self._size

    # --- FIFO ---------------------------------------------------------------------------
    def append(self, entry: SpoolEntry) -> int:
        """Add one entry at the tail; return how many entries were dropped to fit it."""
        return self.append_many([entry])

    def append_many(self, entries: list[SpoolEntry]) -> int:
        """Add entries at the tail in order (one directory fsync); return drops."""
        if not entries:
            return 0
        dropped = 0
        with self._lock:
            for entry in entries:
                data = encode_entry(entry)
                if len(data) > self.max_bytes:
                    log.warning(
                        "spool entry %s (%d bytes) exceeds max_bytes", entry.msg_id, len(data)
                    )
                    dropped += 1
                    continue
                dropped += self._make_room(len(data), 1)
                index = self._next
                self._write(index, data)
                self._index.append((index, len(data)))
                self._size += len(data)
                self._next += 1
            self._fsync_dir()
            self.dropped_total += dropped
        return dropped

    def peek(self, n: int) -> list[StoredEntry]:
        """Up to ``n`` entries from the head, oldest first; corrupt files are removed."""
        out: list[StoredEntry] = []
        with self._lock:
            i = 0
            while len(out) < n and i < len(self._index):
                index = self._index[i][0]
                entry = self._read(index)  # a corrupt entry is removed: same i, next entry
                if entry is not None:
                    out.append(StoredEntry(index, entry))
                    i += 1
        return out

    def ack(self, index: int) -> int:
        """Remove every entry up to and including ``index``; return how many."""
        removed = 0
        with self._lock:
            while self._index and self._index[0][0] <= index:
                self._remove_head()
                removed += 1
        return removed

    remove_upto = ack

    @property
    def lost_total(self) -> int:
        """Entries lost so far by this Spool object: dropped plus corrupt."""
        return self.dropped_total + self.corrupt_total

    # --- drop accounting carried over a restart -------------------------------------------
    def take_unreported_drops(self) -> int:
        """Return the count saved by :meth:`add_unreported_drops`, and reset it to zero."""
        with self._lock:
            count = self._read_unreported()
            if count:
                self._write_counter(0)
        return count

    def add_unreported_drops(self, count: int) -> None:
        """Persist ``count`` more unreported drops (counts still held in memory at exit)."""
        if count > 0:
            with self._lock:
                self._write_counter(self._read_unreported() + count)

    # --- lifecycle ----------------------------------------------------------------------
    def close(self) -> None:
        """Release the directory lock; the entries stay on disk."""
        fd, self._lock_fd = self._lock_fd, -1
        if fd >= 0:
            os.close(fd)

    def __enter__(self) -> Spool:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # --- internals (called with the lock held) ------------------------------------------
    def _path(self, index: int) -> Path:
        return self.directory / f"{index:020d}.msg"

    def _scan(self) -> None:
        found: list[tuple[int, int]] = []
        for child in self.directory.iterdir():
            name = child.name
            if name.endswith(_TMP_SUFFIX):
                log.info("spool: removing unfinished entry %s", name)
                child.unlink(missing_ok=True)
            elif m := _ENTRY_RE.match(name):
                with contextlib.suppress(FileNotFoundError):
                    found.append((int(m.group(1)), child.stat().st_size))
            elif name not in (_DROPS_FILE, _LOCK_FILE):
                log.warning("spool: ignoring unexpected file %s", child)
        found.sort()
        self._index.extend(found)
        self._size = sum(size for _, size in found)
        self._next = found[-1][0] + 1 if found else 1
        self.dropped_total += self._make_room(0, 0)
        if found:
            log.info("spool: %d entries (%d bytes) to replay", len(self._index), self._size)

    def _make_room(self, incoming_bytes: int, incoming_entries: int) -> int:
        """Evict from the head until ``incoming_*`` more fit within the bounds."""
        max_entries = self.max_entries
        dropped = 0
        while self._index and (
            self._size + incoming_bytes > self.max_bytes
            or (max_entries is not None and len(self._index) + incoming_entries > max_entries)
        ):
            self._remove_head()
            dropped += 1
        return dropped

    def _remove_head(self) -> None:
        index, size = self._index.popleft()
        self._size -= size
        self._path(index).unlink(missing_ok=True)

    def _write(self, index: int, data: bytes) -> None:
        final = self._path(index)
        tmp = self.directory / f".{final.stem}{_TMP_SUFFIX}"
        write_durably(tmp, data)
        os.replace(tmp, final)

    def _read(self, index: int) -> SpoolEntry | None:
        path = self._path(index)
        try:
            return decode_entry(path.read_bytes())
        except (OSError, ValueError) as exc:
            log.warning("spool: dropping corrupt entry %s: %s", path.name, exc)
            self._forget(index)
            path.unlink(missing_ok=True)
            self.corrupt_total += 1
            return None

    def _forget(self, index: int) -> None:
        for i, (idx, size) in enumerate(self._index):
            if idx == index:
                del self._index[i]
                self._size -= size
                return

    def _fsync_dir(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _read_unreported(self) -> int:
        try:
            return max(0, int((self.directory / _DROPS_FILE).read_text().strip() or 0))
        except FileNotFoundError:
            return 0
        except (OSError, ValueError) as exc:
            log.warning("spool: unreadable %s (%s); counting it as 0", _DROPS_FILE, exc)
            return 0

    def _write_counter(self, value: int) -> None:
        path = self.directory / _DROPS_FILE
        tmp = self.directory / f".{_DROPS_FILE}{_TMP_SUFFIX}"
        write_durably(tmp, f"{value}\n".encode())
        os.replace(tmp, path)


def _lock_directory(directory: Path) -> int:
    fd = os.open(directory / _LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise SpoolError(f"spool {directory} is in use by another process") from None
    return fd
