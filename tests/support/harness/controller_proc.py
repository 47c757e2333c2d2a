"""A real ``metalguard controller run`` child for the tests that signal or scrape it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from tests.support.harness.agent_proc import METALGUARD


def controller_toml(nats_url: str, prefix: str, extra: str = "") -> str:
    """A minimal controller.toml for region r1 on ``nats_url`` (``extra``: more sections)."""
    return f'region = "r1"\n[nats]\nservers = ["{nats_url}"]\nprefix = "{prefix}"\n' + extra


async def start_controller(config: Path) -> asyncio.subprocess.Process:
    """``metalguard controller run --config config``, its stderr piped (read it: a full
    pipe blocks the child)."""
    return await asyncio.create_subprocess_exec(
        str(METALGUARD), "controller", "run", "--config", str(config),
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip


@contextlib.asynccontextmanager
async def running_controller(config: Path) -> AsyncIterator[asyncio.subprocess.Process]:
    """:func:`start_controller`, killed on the way out if it is still running."""
    proc = await start_controller(config)
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def stop_cleanly(
    proc: asyncio.subprocess.Process,
    seen: list[str],
    deadline_s: float,
    drain: asyncio.Task[bytes] | None = None,
) -> None:
    """SIGTERM, and the controller exits 0 within ``deadline_s`` (its stderr read to the
    end meanwhile, by ``drain`` when the caller already reads it)."""
    assert proc.stderr is not None
    proc.terminate()
    drain = drain or asyncio.create_task(proc.stderr.read())
    assert await asyncio.wait_for(proc.wait(), deadline_s) == 0, "".join(seen)
    await drain
