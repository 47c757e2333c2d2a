"""Reading the kernel log from a file in /dev/kmsg's format (a simulated node's): where
to start (the cursor of this boot, else the backfill window), restarts that neither
repeat nor lose a record, gaps counted as lost (docs/kmsg.md "Reading")."""

from __future__ import annotations

import asyncio
from pathlib import Path

from metalguard.agent.kmsg.reader import Cursor, KmsgReader, Position, load_cursor, save_cursor
from metalguard.agent.kmsg.record import KmsgRecord, text_record
from tests.support.waiting import wait_until


def _rec(seq: int, ts_s: float = 100.0) -> KmsgRecord:
    return text_record(f"line {seq}", seq=seq, ts_us=int(ts_s * 1e6))


def test_a_first_start_reads_back_the_window_only() -> None:
    p = Position(None, "boot-a", since_us=50_000_000)
    assert [p.take(_rec(s, ts)) for s, ts in ((1, 10.0), (2, 49.9), (3, 50.0), (4, 80.0))] == [
        False,
        False,
        True,
        True,
    ]
    assert (p.counts.skipped_backfill, p.counts.lost) == (2, 0)
    assert p.cursor == Cursor("boot-a", 4, 80_000_000)  # with its time: the journal goes on there


def test_a_record_written_after_the_open_is_taken_whatever_its_time_stamp() -> None:
    """The records' clock can run behind /proc/uptime (tens of ms on a VM, a suspend's
    length on a laptop): a record newer than the log's newest at open is new, even when
    its time stamp is before the window's start (it was not taken with backfill 0)."""
    p = Position(None, "boot-a", since_us=50_000_000)
    p.boundary = 2
    taken = [p.take(_rec(s, ts)) for s, ts in ((1, 10.0), (2, 49.9), (3, 49.96), (4, 49.97))]
    assert taken == [False, False, True, True]
    assert p.counts.skipped_backfill == 2


def test_the_same_boot_goes_on_after_the_cursor_and_counts_the_gap() -> None:
    p = Position(Cursor("boot-a", 10), "boot-a", since_us=10**12)
    assert [p.take(_rec(s)) for s in (9, 10, 11, 15, 15, 16)] == [
        False,
        False,
        True,
        True,
        False,
        True,
    ]
    assert p.counts.lost == 3  # 12, 13, 14 were overwritten before they were read


def test_a_new_boot_forgets_the_old_cursor() -> None:
    p = Position(Cursor("boot-a", 10), "boot-b", since_us=0)
    assert p.take(_rec(1))
    assert p.counts.lost == 0


def test_the_cursor_file(tmp_path: Path) -> None:
    path = tmp_path / "spool" / "kmsg.cursor.json"
    assert load_cursor(path) is None
    save_cursor(path, Cursor("b", 42, 7))
    assert load_cursor(path) == Cursor("b", 42, 7)
    path.write_text('{"boot_id": "b", "seq": 42}')  # a cursor saved before the time was
    assert load_cursor(path) == Cursor("b", 42, 0)
    path.write_text("{broken")
    assert load_cursor(path) is None


def _append(path: Path, *records: str) -> None:
    with path.open("a") as f:
        for r in records:
            f.write(r if r.endswith("\n") else r + "\n")


async def _read(path: Path, cursor: Path, until: int, boot: str = "b1") -> list[KmsgRecord]:
    """Start a reader, wait until it handed ``until`` records on, stop it."""
    got: list[KmsgRecord] = []
    reader = KmsgReader(
        path, got.extend, cursor_path=cursor, backfill_s=5.0, poll_s=0.02, boot=boot,
        now_us=lambda: 10_000_000,
    )  # fmt: skip
    task = asyncio.create_task(reader.run())
    try:
        # what was written is read in one pass: the lists below hold exactly it
        await wait_until(lambda: len(got) >= until, 10, f"{until} records")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return got


async def test_a_restart_neither_repeats_nor_loses_a_record(tmp_path: Path) -> None:
    log, cursor = tmp_path / "kmsg", tmp_path / "cursor.json"
    _append(
        log,
        "6,1,1000000,-;too old for the window",
        "6,2,6000000,-;first\n SUBSYSTEM=pci\n DEVICE=+pci:0000:31:00.0",
        "bogus line",
        "6,3,7000000,-;second",
    )
    first = await _read(log, cursor, 2)
    assert [(r.seq, r.text) for r in first] == [(2, "first"), (3, "second")]
    assert first[0].device == "0000:31:00.0"
    _append(log, "6,4,8000000,-;third", "6,7,9000000,-;after a gap")
    second = await _read(log, cursor, 2)
    assert [r.seq for r in second] == [4, 7]  # 1-3 not again
    assert load_cursor(cursor) == Cursor("b1", 7, 9_000_000)


async def test_the_gap_is_counted_as_lost(tmp_path: Path) -> None:
    log, cursor = tmp_path / "kmsg", tmp_path / "cursor.json"
    save_cursor(cursor, Cursor("b1", 3))
    _append(log, "6,9,9000000,-;after the buffer wrapped")
    got: list[KmsgRecord] = []
    reader = KmsgReader(
        log, got.extend, cursor_path=cursor, poll_s=0.02, boot="b1", now_us=lambda: 10**7
    )
    task = asyncio.create_task(reader.run())
    try:
        await wait_until(lambda: len(got) == 1, 10, "the record")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert reader.counts.lost == 5
