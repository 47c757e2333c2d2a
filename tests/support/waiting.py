"""Waiting on what another process does, with a deadline.

Inside one process, tests wait on events.  A child process (the agent, a server) offers
no event to wait on, only its effects: a file it writes, a stream it fills.  These
helpers poll such an effect until a deadline and fail with a message naming it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

POLL_S = 0.1


async def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``predicate`` until it holds; AssertionError naming ``what`` at the deadline."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(POLL_S)


def wait_until_blocking(
    predicate: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.05
) -> None:
    """:func:`wait_until` for a test without an event loop (threads, a child's files)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(poll_s)


async def wait_for_value(
    probe: Callable[[], Awaitable[T]], done: Callable[[T], bool], timeout_s: float, what: str
) -> T:
    """Await ``probe`` until ``done(value)``; return that value, or fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await probe()
        if done(value):
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}: {value!r}")
        await asyncio.sleep(POLL_S)


async def wait_for_line(
    stream: asyncio.StreamReader, needle: str, timeout_s: float, seen: list[str]
) -> None:
    """Read a child's output line by line until one contains ``needle``; every line read
    is kept in ``seen``.  AssertionError if the output ends or the deadline passes first."""

    async def scan() -> None:
        while line := (await stream.readline()).decode():
            seen.append(line)
            if needle in line:
                return
        raise AssertionError(f"output ended before {needle!r}: {''.join(seen)}")

    try:
        await asyncio.wait_for(scan(), timeout_s)
    except TimeoutError:
        raise AssertionError(f"no {needle!r} within {timeout_s}s: {''.join(seen)}") from None
