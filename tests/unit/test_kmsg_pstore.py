"""A panic read back after the reboot from pstore (docs/kmsg.md "Panics"), on a real ERST
dump (tests/fixtures/kmsg/pstore, provenance in PROVENANCE.md): each dump reported once,
its panic a fatal event marked ``previous_boot``, counted for the batch."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

from metalguard.agent.kmsg.pstore import dump_records, dumps
from metalguard.agent.kmsg.source import KmsgSource
from metalguard.proto.base import NodeIdentity
from metalguard.proto.events import NodeEvent
from tests.support.waiting import wait_until

DUMP = Path(__file__).parents[1] / "fixtures" / "kmsg" / "pstore" / "dmesg-erst-7530486857247752194"
NODE = NodeIdentity(region="r1", cluster="c1", node="n1")


def test_a_dumps_records() -> None:
    records = dump_records(DUMP.read_text())
    panic = next(r for r in records if r.text.startswith("Kernel panic"))
    assert (panic.facility, panic.level, panic.ts_us) == (0, 0, 3098_275469)
    assert panic.text == "Kernel panic - not syncing: Test panic triggered by crash_test module"
    systemd = next(r for r in records if "systemd" in r.text)
    assert not systemd.from_kernel  # <30>: facility 3
    assert all(not r.text.startswith("Panic#") for r in records)


def test_dumps_found_in_both_layouts(tmp_path: Path) -> None:
    sys_fs = tmp_path / "sys"
    archived = tmp_path / "var" / "1700000000" / "7530486857247752194"
    for d in (sys_fs, archived):
        d.mkdir(parents=True)
    shutil.copy(DUMP, sys_fs / DUMP.name)
    shutil.copy(DUMP, archived / "dmesg.txt")
    (sys_fs / "console-ramoops-0").write_text("not a dmesg dump")
    found = dumps((sys_fs, tmp_path / "var", tmp_path / "absent"))
    assert [p.name for p in found] == [DUMP.name, "dmesg.txt"]


async def _run_until_read(source: KmsgSource) -> None:
    task = asyncio.create_task(source.run())
    try:
        await wait_until(lambda: source.reader.reads >= 1, 10, "the log read once")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_panic_in_pstore_is_reported_once(tmp_path: Path) -> None:
    store = tmp_path / "pstore"
    store.mkdir()
    shutil.copy(DUMP, store / DUMP.name)
    log = tmp_path / "kmsg"
    log.write_text("6,1,1,-;nothing to see\n")
    events: list[NodeEvent] = []

    async def emit(event: NodeEvent) -> None:
        events.append(event)

    def source() -> KmsgSource:
        return KmsgSource(
            lambda: NODE, emit, log, cursor_path=tmp_path / "cursor.json", boot="b",
            pstore=(store,), pstore_state=tmp_path / "pstore.json",
        )  # fmt: skip

    first = source()
    task = asyncio.create_task(first.run())
    try:
        await wait_until(lambda: bool(events), 10, "the panic's event")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    (panic,) = events
    assert (panic.kind, panic.severity) == ("kmsg_kernel_panic", "critical")
    assert panic.attributes["previous_boot"] is True
    assert first.counts().findings["kernel_panic"] == 1
    again = source()  # an agent restart: the dump was handled
    await _run_until_read(again)
    assert again.counts().findings["kernel_panic"] == 0
    assert len(events) == 1
