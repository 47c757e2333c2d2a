"""``kill -USR1`` on a real ``metalguard controller run``: it logs every asyncio task's
stack (docs/operations.md, "A controller that seems stuck") and carries on; SIGTERM
still stops it (exit 0)."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

from metalguard.proto.subjects import Subjects
from tests.integration.controller_proc import controller_toml, start_controller
from tests.waiting import wait_for_line

DEADLINE_S = 30.0


async def test_sigusr1_logs_every_task_and_the_controller_carries_on(
    nats_url: str, subjects: Subjects, tmp_path: Path
) -> None:
    config = tmp_path / "controller.toml"
    config.write_text(controller_toml(nats_url, subjects.prefix))
    proc = await start_controller(config)
    assert proc.stderr is not None
    seen: list[str] = []
    try:
        await wait_for_line(proc.stderr, "running", DEADLINE_S, seen)
        for _ in range(2):  # and again: the handler stays installed
            proc.send_signal(signal.SIGUSR1)
            await wait_for_line(proc.stderr, "asyncio tasks on SIGUSR1", DEADLINE_S, seen)
            await wait_for_line(proc.stderr, "--- task ", DEADLINE_S, seen)
        assert proc.returncode is None, "".join(seen)  # still running
        proc.terminate()
        drain = asyncio.create_task(proc.stderr.read())
        assert await asyncio.wait_for(proc.wait(), DEADLINE_S) == 0, "".join(seen)
        await drain
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
