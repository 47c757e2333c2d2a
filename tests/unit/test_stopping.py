"""controller/stopping.py: a stop's cancel is bounded and repeated (no wait for ever)."""

from __future__ import annotations

import asyncio
import contextlib

from metalguard.controller.stopping import cancel_within


async def test_a_task_that_swallows_its_first_cancel_ends_on_the_next() -> None:
    ended = asyncio.Event()

    async def stubborn() -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.Event().wait()  # the first cancel is swallowed here
        await asyncio.Event().wait()  # the second ends the task
        ended.set()

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    assert await cancel_within([task], 5.0, "test", recancel_s=0.01) == 0
    assert task.cancelled()
    assert not ended.is_set()


async def test_a_task_that_never_ends_is_left_after_the_deadline() -> None:
    release = asyncio.Event()

    async def deaf() -> None:
        while not release.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await release.wait()

    task = asyncio.create_task(deaf())
    await asyncio.sleep(0)
    assert await cancel_within([task], 0.05, "test", recancel_s=0.01) == 1
    assert not task.done()
    release.set()
    await asyncio.wait_for(task, 5.0)


async def test_done_tasks_and_none_are_nothing_to_wait_for() -> None:
    done = asyncio.create_task(asyncio.sleep(0))
    await done
    assert await cancel_within([done], 0.0, "test") == 0
    assert await cancel_within([], 0.0, "test") == 0
