"""A real ``metalguard controller run`` child for the tests that signal or scrape it."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.integration.agent_proc import METALGUARD


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
