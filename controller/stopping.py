"""Bounded task cancellation for the controller's stops: a stop never waits for ever.

A task can swallow its cancel (an inner ``suppress(CancelledError)``, or Python 3.11's
``asyncio.wait_for`` losing a cancel that arrives as its inner future completes) and run
on; awaiting it after ``cancel()`` then never returns. :func:`cancel_within` cancels
again each second and gives up after a deadline, naming what it left running.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable

log = logging.getLogger(__name__)

RECANCEL_S = 1.0


async def cancel_within(
    tasks: Iterable[asyncio.Task[object]],
    timeout_s: float,
    what: str,
    recancel_s: float = RECANCEL_S,
) -> int:
    """Cancel ``tasks`` and wait at most ``timeout_s`` for them to end (cancelling again
    each ``recancel_s``); how many were left running (logged as ``what``)."""
    pending = {t for t in tasks if not t.done()}
    deadline = time.monotonic() + timeout_s
    while pending:
        for task in pending:
            task.cancel()
        left = deadline - time.monotonic()
        if left <= 0:
            break
        _, pending = await asyncio.wait(pending, timeout=min(recancel_s, left))
    for task in pending:
        log.warning("%s: task %s did not end %.0f s after its cancel; left running",
                    what, task.get_name(), timeout_s)  # fmt: skip
    return len(pending)
