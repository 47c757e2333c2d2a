# ruff: noqa: E501  (real kernel log lines are kept whole)
"""The previous boot's kernel log from the journal (docs/kmsg.md "Panics"): a
``journalctl`` on PATH that prints journald's JSON entries (the fields journald writes for
the kernel's records: ``_TRANSPORT=kernel``, ``_BOOT_ID`` without dashes,
``_SOURCE_MONOTONIC_TIMESTAMP``, every value a string) and checks it was asked for the
previous boot's kernel log."""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
from pathlib import Path

from metalguard.agent.kmsg.journal import PreviousBoot, parse_journal, same_boot, unseen
from metalguard.agent.kmsg.reader import Cursor, save_cursor
from metalguard.agent.kmsg.source import KmsgSource
from metalguard.proto.base import NodeIdentity
from metalguard.proto.events import NodeEvent
from tests.support.waiting import wait_until

NODE = NodeIdentity(region="r1", cluster="c1", node="n1")
PREVIOUS = "6d5e1a8f0c2b4e7a9f3d2c1b0a998877"
NOW = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
# real lines: tests/fixtures/kmsg/tasks.txt, storage.txt (their sources in PROVENANCE.md)
HUNG = "INFO: task jbd2/sda1-8:415 blocked for more than 120 seconds."
READONLY = "EXT4-fs (sda1): Remounting filesystem read-only"
OOPS = "BUG: kernel NULL pointer dereference, address: 0000000000000008"


def entry(message: str, mono_us: int, *, transport: str = "kernel", boot: str = PREVIOUS) -> str:
    doc = {
        "__CURSOR": f"s=1;i={mono_us}",
        "__REALTIME_TIMESTAMP": str(1_700_000_000_000_000 + mono_us),
        "__MONOTONIC_TIMESTAMP": str(mono_us + 1500),
        "_BOOT_ID": boot,
        "_TRANSPORT": transport,
        "PRIORITY": "3",
        "SYSLOG_FACILITY": "0" if transport == "kernel" else "3",
        "SYSLOG_IDENTIFIER": "kernel" if transport == "kernel" else "myapp",
        "_SOURCE_MONOTONIC_TIMESTAMP": str(mono_us),
        "_HOSTNAME": "gpu-17",
        "MESSAGE": message,
    }
    return json.dumps(doc)


JOURNAL = "\n".join(
    [
        entry(HUNG, 100_000_000),
        entry(READONLY, 200_000_000, transport="stdout"),  # another program's line
        entry(READONLY, 300_000_000),
        entry(OOPS, 400_000_000),
    ]
)


def test_parse_and_what_was_not_seen() -> None:
    previous = parse_journal(JOURNAL + "\nnot json\n[1, 2]\n")
    assert previous.boot_id == PREVIOUS
    assert [r.ts_us for r in previous.records] == [
        100_000_000,
        200_000_000,
        300_000_000,
        400_000_000,
    ]
    assert [r.from_kernel for r in previous.records] == [True, False, True, True]
    # the agent of that boot handled up to 250 s: the two after it
    dashed = "6d5e1a8f-0c2b-4e7a-9f3d-2c1b0a998877"
    assert same_boot(PREVIOUS, dashed)
    after = unseen(previous, Cursor(dashed, 99, 250_000_000))
    assert [r.text for r in after] == [READONLY, OOPS]
    # a cursor of another boot (or none): every kernel record of the previous boot
    assert len(unseen(previous, Cursor(NOW, 5, 999_000_000_000))) == 3
    assert len(unseen(previous, None)) == 3
    assert unseen(PreviousBoot("", ()), None) == []


def fake_journalctl(bin_dir: Path, output: str, *, rc: int = 0) -> Path:
    """A ``journalctl`` that checks its arguments, counts its runs, prints ``output``."""
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "out.json").write_text(output)
    script = bin_dir / "journalctl"
    script.write_text(
        f"""#!{sys.executable}
import sys, pathlib
here = pathlib.Path({str(bin_dir)!r})
with open(here / "runs", "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\\n")
args = sys.argv[1:]
assert args[:6] == ["-k", "-b", "-1", "-o", "json", "--no-pager"], args
if {rc}:
    print("Data from the specified boot (-1) is not available: No such boot ID in journal", file=sys.stderr)
    sys.exit({rc})
sys.stdout.write((here / "out.json").read_text())
"""
    )
    script.chmod(0o755)
    return script


async def _start_and_collect(source: KmsgSource, events: list[NodeEvent], want: int) -> None:
    task = asyncio.create_task(source.run())
    try:
        await wait_until(lambda: source.reader.reads >= 1, 10, "the log read once")
        if want:  # (the previous boot is read before the log: its counts are final now)
            await wait_until(lambda: len(events) >= want, 10, f"{want} events")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_the_previous_boots_journal_is_read_once_for_what_that_boots_agent_missed(
    tmp_path: Path,
) -> None:
    journalctl = fake_journalctl(tmp_path / "bin", JOURNAL)
    log = tmp_path / "kmsg"
    log.write_text("6,1,1,-;a new boot\n")
    cursor = tmp_path / "cursor.json"
    # that boot's agent handled its records up to 150 s (the hung task)
    save_cursor(cursor, Cursor("6d5e1a8f-0c2b-4e7a-9f3d-2c1b0a998877", 812, 150_000_000))
    events: list[NodeEvent] = []

    async def emit(event: NodeEvent) -> None:
        events.append(event)

    def source() -> KmsgSource:
        return KmsgSource(
            lambda: NODE, emit, log, cursor_path=cursor, boot=NOW,
            journalctl=str(journalctl), journal_state=tmp_path / "journal.json",
        )  # fmt: skip

    first = source()
    await _start_and_collect(first, events, 2)
    assert sorted(e.kind for e in events) == ["kmsg_fs_readonly", "kmsg_kernel_oops"]
    assert all(e.attributes["previous_boot"] is True for e in events)
    counts = first.counts().findings
    assert (counts["hung_task"], counts["fs_readonly"], counts["kernel_oops"]) == (0, 1, 1)
    again = source()  # an agent restart in the same boot: the journal is not read again
    await _start_and_collect(again, events, 0)
    assert again.counts().findings["fs_readonly"] == 0
    assert len(events) == 2
    assert len((tmp_path / "bin" / "runs").read_text().splitlines()) == 1


async def test_no_journal_or_no_journalctl_reports_nothing(tmp_path: Path) -> None:
    log = tmp_path / "kmsg"
    log.write_text("6,1,1,-;a new boot\n")
    events: list[NodeEvent] = []

    async def emit(event: NodeEvent) -> None:
        events.append(event)

    missing = fake_journalctl(tmp_path / "bin", "", rc=1)  # no previous boot in the journal
    for journalctl in (str(missing), str(tmp_path / "absent" / "journalctl")):
        source = KmsgSource(
            lambda: NODE, emit, log, cursor_path=tmp_path / "c.json", boot=NOW,
            journalctl=journalctl,
        )  # fmt: skip
        await _start_and_collect(source, events, 0)
        assert events == []
        assert source.counts().findings["kernel_oops"] == 0
    assert shutil.which(str(missing)) is not None


async def test_pstore_and_the_journal_report_one_line_once(tmp_path: Path) -> None:
    """The oops before a panic, in pstore's dump and in the journal: one event."""
    store = tmp_path / "pstore"
    store.mkdir()
    (store / "dmesg-erst-7530486857247").write_text(
        f"Oops#1 Part1\n<1>[  400.000000] {OOPS}\n<0>[  400.100000] Kernel panic - not syncing: Fatal exception\n"
    )
    journalctl = fake_journalctl(tmp_path / "bin", entry(OOPS, 400_000_000))
    log = tmp_path / "kmsg"
    log.write_text("6,1,1,-;a new boot\n")
    events: list[NodeEvent] = []

    async def emit(event: NodeEvent) -> None:
        events.append(event)

    source = KmsgSource(
        lambda: NODE, emit, log, cursor_path=tmp_path / "c.json", boot=NOW,
        pstore=(store,), pstore_state=tmp_path / "pstore.json", journalctl=str(journalctl),
    )  # fmt: skip
    await _start_and_collect(source, events, 2)
    assert sorted(e.kind for e in events) == ["kmsg_kernel_oops", "kmsg_kernel_panic"]
    assert source.counts().findings["kernel_oops"] == 1
