"""Deadlines that never swallow a cancel: use these, not ``asyncio.wait_for``.

On Python 3.11, ``asyncio.wait_for`` returns its inner result when a cancel of the
waiting task arrives in the same loop iteration as the inner awaitable completes
(CPython gh-86296; fixed in 3.12 by rebuilding ``wait_for`` on ``asyncio.timeout``). A
service loop such as ``while True: await wait_for(wake.wait(), tick)`` then runs on after
its ``task.cancel()``, and a stop that awaits the task waits for ever: the intermittent
controller stop hang (docs/operations.md, "A stop that never ends"). ``asyncio.timeout``
(3.11+) counts cancels and re-raises ours, so these helpers are built on it. ruff bans
``asyncio.wait_for`` outside this module (pyproject.toml, TID251).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def within(awaitable: Awaitable[T], timeout_s: float | None) -> T:
    """Await ``awaitable`` for at most ``timeout_s`` seconds (``None``: no deadline).

    Raises ``TimeoutError`` past the deadline (the awaitable is cancelled first, as
    ``wait_for`` does); a cancel of the caller always propagates as ``CancelledError``.
    """
    async with asyncio.timeout(timeout_s):
        return await awaitable


async def wait_event(event: asyncio.Event, timeout_s: float | None) -> bool:
    """Wait until ``event`` is set or ``timeout_s`` passes; whether it is set.

    The loop-pacing idiom (``wake`` or ``stop`` events with a tick) without the
    ``suppress(TimeoutError)`` around a ``wait_for`` that can lose the loop's cancel.
    """
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        return event.is_set()
    return True
