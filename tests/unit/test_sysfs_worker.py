"""The sysfs scan worker: scans run one at a time, and a hung scan blinds nobody."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from metalguard.agent.sysfs import STUCK_SCAN_S, SysfsReader, _ScanWorker


async def test_scans_run_in_one_thread_one_after_another(tmp_path: Path) -> None:
    worker = _ScanWorker()
    reader = SysfsReader(tmp_path)
    names = await asyncio.gather(
        *(worker.run(lambda _r: threading.current_thread().name, reader) for _ in range(5))
    )
    assert len(set(names)) == 1
    assert names[0] != threading.current_thread().name


async def test_a_hung_scan_gets_a_fresh_worker_for_the_next_ones(tmp_path: Path) -> None:
    now = [0.0]
    worker = _ScanWorker(clock=lambda: now[0])
    reader = SysfsReader(tmp_path)
    started, release = threading.Event(), threading.Event()

    def hang(_reader: SysfsReader) -> str:
        started.set()
        release.wait(30)
        return "late"

    hung = asyncio.ensure_future(worker.run(hang, reader))
    try:
        assert await asyncio.to_thread(started.wait, 10)
        now[0] = STUCK_SCAN_S + 1  # the driver read has now hung past the limit
        fresh = await asyncio.wait_for(worker.run(lambda _r: "fresh", reader), 10)
        assert fresh == "fresh"
    finally:
        release.set()
    assert await asyncio.wait_for(hung, 10) == "late"
