"""An injected clock the test moves by hand."""

from __future__ import annotations

from dataclasses import dataclass

T0 = 1_800_000_000.0
"""A fixed start time (2027-01-15), far from any real clock."""


@dataclass
class ManualClock:
    """Callable like ``time.time``; returns ``now``, which the test sets."""

    now: float = T0

    def __call__(self) -> float:
        return self.now
