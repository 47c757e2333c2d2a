"""Reading the kernel log: /dev/kmsg in the event loop, or a file in its format (a
simulated node's), with a cursor that survives restarts (docs/kmsg.md "Reading").

/dev/kmsg: the fd is non-blocking in the loop's selector (no polling, no thread); each
``read()`` is one record; EPIPE means records were overwritten before they were read (the
next read goes on from the oldest one left), and the gap in sequence numbers says how
many. A regular file is read for what was appended, every ``poll_s`` (its writer appends each
record whole, with its continuation lines, in one write).

Where to start: the cursor (``{"boot_id", "seq"}``, written atomically after each batch
of records) names the last record handled in this boot: a restart goes on after it,
counting as lost what the ring buffer dropped meanwhile. Without a cursor for this boot
(first start, a reboot), the records of the last ``backfill_s`` seconds are read.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from metalguard.agent.kmsg.record import KmsgFormatError, KmsgRecord, parse_record, split_records
from metalguard.agent.statefile import write_json

log = logging.getLogger(__name__)

READ_SIZE: Final = 8192
"""One /dev/kmsg record is at most 1 KiB of text plus its fields (the kernel's limit)."""
BOOT_ID: Final = Path("/proc/sys/kernel/random/boot_id")


@dataclass(frozen=True, slots=True)
class Cursor:
    """The last record handled, in which boot."""

    boot_id: str
    seq: int
    ts_us: int = 0
    """The record's time since boot: where the previous boot's journal goes on from
    (docs/kmsg.md "Panics")."""


def load_cursor(path: Path) -> Cursor | None:
    """The saved cursor (None: none, or unreadable: logged)."""
    try:
        doc = json.loads(path.read_text())
        return Cursor(str(doc["boot_id"]), int(doc["seq"]), int(doc.get("ts_us", 0)))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("kmsg cursor %s unreadable (%s): reading back the window", path, exc)
        return None


def save_cursor(path: Path, cursor: Cursor) -> None:
    """Write the cursor atomically (a failure is logged: the next save tries again)."""
    doc = {"boot_id": cursor.boot_id, "seq": cursor.seq, "ts_us": cursor.ts_us}
    write_json(path, doc, "kmsg cursor")


def boot_id(path: Path = BOOT_ID) -> str:
    """This boot's id ("" when unknown: then every start reads the window back)."""
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def uptime_us(procfs: Path = Path("/proc")) -> int | None:
    """Microseconds since boot (/proc/uptime), the clock of the records' timestamps."""
    try:
        return int(float((procfs / "uptime").read_text().split()[0]) * 1e6)
    except (OSError, ValueError, IndexError):
        return None


@dataclass(slots=True)
class ReadCounts:
    """What the reader could not hand on."""

    lost: int = 0
    """Records overwritten before they were read (sequence gaps)."""
    malformed: int = 0
    skipped_backfill: int = 0
    """Records older than the window read back at a first start or after a reboot."""


class Position:
    """Which records to hand on: after the cursor, or within the backfill window (pure)."""

    def __init__(self, cursor: Cursor | None, boot: str, since_us: int | None) -> None:
        self.boot = boot
        self.last = cursor.seq if cursor is not None and boot and cursor.boot_id == boot else None
        self.since_us = since_us if self.last is None else None
        self.last_ts_us = cursor.ts_us if cursor is not None and self.last is not None else 0
        self.counts = ReadCounts()
        self.boundary: int | None = None
        """The newest record's sequence number when the log was opened: a record after it
        was written since, whatever its time stamp says (the records' clock runs tens of
        milliseconds behind /proc/uptime on some machines, more after a suspend), so the
        backfill window judges only the records that were there before."""

    def take(self, record: KmsgRecord) -> bool:
        """Whether ``record`` is new (counting the records lost before it)."""
        if self.last is not None:
            if record.seq <= self.last:
                return False  # handled before the restart, or a repeat
            if record.seq > self.last + 1:
                self.counts.lost += record.seq - self.last - 1
            self.last, self.last_ts_us = record.seq, record.ts_us
            return True
        before_open = self.boundary is None or record.seq <= self.boundary
        if self.since_us is not None and record.ts_us < self.since_us and before_open:
            self.counts.skipped_backfill += 1
            return False
        self.last, self.last_ts_us = record.seq, record.ts_us
        return True

    @property
    def cursor(self) -> Cursor | None:
        """Where a restart should go on from."""
        return None if self.last is None else Cursor(self.boot, self.last, self.last_ts_us)


OnRecords = Callable[[list[KmsgRecord]], None]


def newest_seq(path: Path) -> int | None:
    """The sequence number of the newest record in the kernel log device now (None: it is
    empty or unreadable); read through a descriptor of its own."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    newest: int | None = None
    try:
        while True:
            try:
                raw = os.read(fd, READ_SIZE)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno in (errno.EPIPE, errno.EINVAL):
                    continue  # overwritten, or too large: the next one
                break
            if not raw:
                break
            head = raw.split(b";", 1)[0].split(b",")
            with contextlib.suppress(IndexError, ValueError):
                newest = int(head[1])
    finally:
        os.close(fd)
    return newest


class KmsgReader:
    """Hands each new record of ``path`` to ``on_records`` (in order, in batches)."""

    def __init__(
        self,
        path: Path,
        on_records: OnRecords,
        *,
        cursor_path: Path | None,
        backfill_s: float = 300.0,
        poll_s: float = 0.2,
        boot: str | None = None,
        now_us: Callable[[], int | None] = uptime_us,
        cursor_every_s: float = 1.0,
    ) -> None:
        self.path = path
        self._on_records = on_records
        self._cursor_path = cursor_path
        self.poll_s = poll_s
        self._cursor_every_s = cursor_every_s
        boot_ = boot_id() if boot is None else boot
        saved = load_cursor(cursor_path) if cursor_path is not None else None
        now = now_us()
        since = None if now is None else max(0, now - int(backfill_s * 1e6))
        self.position = Position(saved, boot_, since)
        self._fd: int | None = None
        self._pending = ""
        self._saved_at = 0.0
        self._saved: Cursor | None = saved
        self.saved_at_start = saved
        """The cursor found at start: in another boot, where that boot's log was left."""
        self._done = asyncio.Event()
        self.reads = 0

    @property
    def counts(self) -> ReadCounts:
        """Lost, malformed and skipped records so far."""
        return self.position.counts

    def open(self) -> bool:
        """Open the log (True: a character device, read in the loop's selector)."""
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        self._fd = fd
        device = stat.S_ISCHR(os.fstat(fd).st_mode)
        if device and self.position.last is None:
            self.position.boundary = newest_seq(self.path)
        return device

    async def run(self) -> None:
        """Read until cancelled (the cursor is saved on the way out)."""
        device = self.open() if self._fd is None else stat.S_ISCHR(os.fstat(self._fd).st_mode)
        loop = asyncio.get_running_loop()
        try:
            if device:
                self._drain_device()
                loop.add_reader(self._fd, self._drain_device)  # type: ignore[arg-type]
                try:
                    await self._done.wait()
                finally:
                    loop.remove_reader(self._fd)  # type: ignore[arg-type]
            else:
                while True:
                    self._drain_file()
                    await asyncio.sleep(self.poll_s)
        finally:
            self._save(force=True)
            with contextlib.suppress(OSError):
                if self._fd is not None:
                    os.close(self._fd)
            self._fd = None

    def _drain_device(self) -> None:
        """Read every record there is now (one ``read()`` each), then hand them on."""
        assert self._fd is not None
        records: list[KmsgRecord] = []
        while True:
            try:
                raw = os.read(self._fd, READ_SIZE)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    continue  # overwritten: the sequence gap counts them
                if exc.errno == errno.EINVAL:  # a record larger than the buffer
                    self.counts.malformed += 1
                    continue
                log.error("reading %s: %s", self.path, exc)
                self._done.set()
                break
            if not raw:
                break
            self._take(raw.decode("utf-8", errors="replace"), records)
        self._hand_on(records)

    def _drain_file(self) -> None:
        """What was appended to a regular file since the last read."""
        assert self._fd is not None
        chunks: list[bytes] = []
        while chunk := os.read(self._fd, 65536):
            chunks.append(chunk)
        if not chunks:
            return
        data = self._pending + b"".join(chunks).decode("utf-8", errors="replace")
        complete, sep, rest = data.rpartition("\n")
        if not sep:
            self._pending = data
            return
        # a writer appends a record with its continuation lines at once (one write)
        texts = split_records(complete)
        self._pending = rest
        records: list[KmsgRecord] = []
        for text in texts:
            self._take(text, records)
        self._hand_on(records)

    def _take(self, text: str, into: list[KmsgRecord]) -> None:
        try:
            record = parse_record(text)
        except KmsgFormatError as exc:
            self.counts.malformed += 1
            log.debug("kmsg: %s", exc)
            return
        if self.position.take(record):
            into.append(record)

    def _hand_on(self, records: list[KmsgRecord]) -> None:
        self.reads += 1
        if records:
            self._on_records(records)
        self._save(force=False)

    def _save(self, *, force: bool) -> None:
        cursor = self.position.cursor
        if self._cursor_path is None or cursor is None or cursor == self._saved:
            return
        now = time.monotonic()
        if not force and now - self._saved_at < self._cursor_every_s:
            return
        save_cursor(self._cursor_path, cursor)
        self._saved, self._saved_at = cursor, now

    def stop(self) -> None:
        """End :meth:`run` (a device reader; a file reader ends when cancelled)."""
        self._done.set()
