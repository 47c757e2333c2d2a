"""controller/task_dump.py: every task named, with the frame it waits in."""

from __future__ import annotations

import asyncio
import logging

import pytest

from metalguard.controller.task_dump import log_task_stacks, task_stacks


async def waits_for_ever(event: asyncio.Event) -> None:
    await event.wait()


async def test_every_task_is_named_with_where_it_waits(caplog: pytest.LogCaptureFixture) -> None:
    event = asyncio.Event()
    task = asyncio.create_task(waits_for_ever(event), name="stuck-one")
    await asyncio.sleep(0)
    text = task_stacks()
    assert "--- task stuck-one" in text
    assert "waits_for_ever" in text
    assert f"{len(asyncio.all_tasks())} asyncio tasks" in text
    with caplog.at_level(logging.WARNING):
        log_task_stacks()
    assert "stuck-one" in caplog.text
    event.set()
    await task
