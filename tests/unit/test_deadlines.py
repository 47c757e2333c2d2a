"""runtime/deadlines.py: deadlines that never swallow a cancel.

The controller's intermittent stop hang: a pass loop paced by
``with suppress(TimeoutError): await asyncio.wait_for(wake.wait(), tick)`` lost the
cancel of its stop when a wake landed in the same loop iteration (Python 3.11's
``wait_for`` returns the inner result then, CPython gh-86296), so ``await task`` after
``task.cancel()`` never returned. These tests make that interleaving on purpose.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Awaitable, Callable

import pytest

from metalguard.runtime.deadlines import wait_event, within

Pacer = Callable[[asyncio.Event], Awaitable[object]]


async def _paced_by_wait_event(wake: asyncio.Event) -> object:
    return await wait_event(wake, 30)


async def _paced_by_within(wake: asyncio.Event) -> object:
    with contextlib.suppress(TimeoutError):
        await within(wake.wait(), 30)
    return None


async def _paced_by_wait_for(wake: asyncio.Event) -> object:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(wake.wait(), 30)
    return None


async def _loop_survives_wake_and_cancel(pace: Pacer) -> bool:
    """A service loop paced by ``pace``; wake it and cancel it in the same iteration.
    Whether it was still running a second after its one cancel."""
    wake = asyncio.Event()
    rounds = 0

    async def loop() -> None:
        nonlocal rounds
        while True:
            rounds += 1
            await pace(wake)
            wake.clear()

    task = asyncio.create_task(loop())
    await asyncio.sleep(0.01)  # the loop waits in pace()
    assert rounds == 1
    wake.set()
    await asyncio.sleep(0)  # the inner wait completes; the loop has not resumed yet
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=1.0)
    survived = not done
    if survived:  # tidy up the runaway loop: later cancels land outside the race
        while not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=0.1)
    return survived


@pytest.mark.parametrize("pace", [_paced_by_wait_event, _paced_by_within])
async def test_one_cancel_ends_a_loop_woken_in_the_same_iteration(pace: Pacer) -> None:
    assert not await _loop_survives_wake_and_cancel(pace)


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="wait_for is fixed in 3.12")
async def test_wait_for_on_3_11_loses_that_cancel() -> None:
    """Why asyncio.wait_for is banned in production code (ruff TID251): the same loop
    paced by it outlives its cancel."""
    assert await _loop_survives_wake_and_cancel(_paced_by_wait_for)


async def test_wait_event_says_whether_the_event_was_set() -> None:
    event = asyncio.Event()
    assert await wait_event(event, 0.01) is False
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await wait_event(event, 30) is True
    assert await wait_event(event, 0) is True  # already set: no wait


async def test_within_returns_the_value_or_raises_timeout_and_cancels_the_work() -> None:
    async def answer() -> int:
        await asyncio.sleep(0)
        return 42

    assert await within(answer(), 5) == 42
    assert await within(answer(), None) == 42

    cancelled = asyncio.Event()

    async def slow() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(TimeoutError):
        await within(slow(), 0.01)
    assert cancelled.is_set()


async def test_a_cancel_of_the_caller_propagates_through_within() -> None:
    started = asyncio.Event()

    async def caller() -> None:
        started.set()
        await within(asyncio.sleep(30), 60)

    task = asyncio.create_task(caller())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
