"""``kill -USR1`` on a real ``metalguard controller run``: it logs every asyncio task's
stack (docs/operations.md, "A controller that seems stuck") and carries on; SIGTERM
still stops it (exit 0)."""

from __future__ import annotations

import signal
from pathlib import Path

from metalguard.proto.subjects import Subjects
from tests.support.harness.controller_proc import controller_toml, running_controller, stop_cleanly
from tests.support.waiting import wait_for_line

DEADLINE_S = 30.0


async def test_sigusr1_logs_every_task_and_the_controller_carries_on(
    nats_url: str, subjects: Subjects, tmp_path: Path
) -> None:
    config = tmp_path / "controller.toml"
    config.write_text(controller_toml(nats_url, subjects.prefix))
    async with running_controller(config) as proc:
        assert proc.stderr is not None
        seen: list[str] = []
        await wait_for_line(proc.stderr, "running", DEADLINE_S, seen)
        for _ in range(2):  # and again: the handler stays installed
            proc.send_signal(signal.SIGUSR1)
            await wait_for_line(proc.stderr, "asyncio tasks on SIGUSR1", DEADLINE_S, seen)
            await wait_for_line(proc.stderr, "--- task ", DEADLINE_S, seen)
        assert proc.returncode is None, "".join(seen)  # still running
        await stop_cleanly(proc, seen, DEADLINE_S)
