"""Exponential backoff with full jitter, and a guarded background task.

Full jitter (``uniform(0, min(cap, base * 2**n))``) spreads the retries of a whole fleet
that lost its server at the same moment, so a restarted server is not hit by every agent
at once.  The random source is injected so tests can replay a sequence.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

Sleep = Callable[[float], Awaitable[None]]
"""An injectable ``asyncio.sleep``."""

_MAX_EXPONENT = 62
"""2**n beyond this is larger than any cap worth having; avoids float overflow."""


@dataclass(slots=True)
class Backoff:
    """Delays for retry ``n`` (0-based): ``rng.uniform(0, min(cap, base * 2**n))``."""

    base_s: float = 0.5
    cap_s: float = 30.0
    rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        if self.base_s <= 0 or self.cap_s < self.base_s:
            raise ValueError(f"need 0 < base_s <= cap_s, got {self.base_s}, {self.cap_s}")

    def ceiling(self, attempt: int) -> float:
        """The upper bound of the delay before retry ``attempt``."""
        return min(self.cap_s, self.base_s * 2.0 ** min(max(attempt, 0), _MAX_EXPONENT))

    def delay(self, attempt: int) -> float:
        """A jittered delay before retry ``attempt``."""
        return self.rng.uniform(0.0, self.ceiling(attempt))


def guarded_task(
    name: str,
    body: Callable[[], Awaitable[None]],
    *,
    backoff: Backoff,
    sleep: Sleep = asyncio.sleep,
) -> asyncio.Task[None]:
    """Run ``body`` in a task; if it raises, log it and run it again after a backoff.

    ``body`` returning normally ends the task; cancelling the task stops it.  A crash is
    therefore never silent and never permanent.
    """

    async def supervise() -> None:
        crashes = 0
        while True:
            try:
                await body()
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                delay = backoff.delay(crashes)
                crashes += 1
                log.exception(
                    "task %s crashed (%d times); restarting in %.2fs", name, crashes, delay
                )
                await sleep(delay)

    task = asyncio.create_task(supervise(), name=name)
    task.add_done_callback(_log_unexpected_end)
    return task


def _log_unexpected_end(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("task %s ended with %r", task.get_name(), exc)
