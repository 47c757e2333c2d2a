"""Checking cached copies against the source *before* their check falls due in a read.

A cached copy is trusted for ``metadata_ttl_s`` after its version was last checked; a
read past that checks it first (store.py, ``_hit``) — over http one ``HEAD`` per file on
the reader's path, which cost a hit a round trip whenever an epoch outlasted the TTL.
:class:`Revalidator` runs those checks on a thread of its own, ahead of time: every
``interval_s`` it takes the copies whose trust ends within ``lead_s`` (soonest first, at
most ``BATCH`` a pass), asks the source for their entries in one batch (one listing per
directory, or parallel ``HEAD`` requests: :meth:`~.source.Source.check`), and the store
applies the answers — a copy of the same version is trusted for another TTL from the
moment the batch was sent; a changed or vanished file's copy is dropped.

The rule a reader sees is unchanged, and exact: no copy is served more than
``metadata_ttl_s`` after its version was last confirmed; a read that finds a copy past it
(the revalidator behind, or idle) checks it inline, as before.  The revalidator only
moves checks off the read path; it never serves anything stale.

It spends a budget earned by hits: each cache hit of the dataset (store.py counts them)
earns one source request, capped at ``cap`` — what that hit would have cost checking
inline past the TTL, so the background check never asks the source for more than the
hits do; a cache nobody reads (or that only misses) puts no load on the source.  Where
copies are re-read less often than every TTL (an epoch longer than the TTL) keeping them
all confirmed would take more checks than there are hits: the budget runs out and the
remaining hits check inline, as they did before.  Off for ``metadata_ttl_s`` of 0
(every read checks).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

BATCH = 512
"""Copies checked in one batch (one call to the source)."""
LEAD_SHARE = 0.25
"""A copy is checked ahead once this share of the TTL is left of its trust."""
MAX_INTERVAL_S = 1.0
MIN_INTERVAL_S = 0.05


class Revalidator:
    """The background check of cached copies (see the module doc).

    ``due(horizon, limit)``: up to ``limit`` keys of copies trusted only until
    ``horizon`` or less, soonest first.  ``check(keys, started)``: ask the source and
    apply its answers; returns the source requests it cost.  ``earned()``: the dataset's
    cache hits so far (the budget).  ``clock``: the store's clock."""

    def __init__(
        self,
        ttl_s: float,
        clock: Callable[[], float],
        due: Callable[[float, int], list[str]],
        check: Callable[[list[str], float], int],
        earned: Callable[[], int],
        name: str = "mgcache-revalidate",
        cap: int = 4 * BATCH,
    ) -> None:
        self.ttl_s = ttl_s
        self.lead_s = ttl_s * LEAD_SHARE
        self.interval_s = min(MAX_INTERVAL_S, max(ttl_s / 8, MIN_INTERVAL_S))
        self.cap = cap
        self.checked = 0
        """Copies checked so far (figures, tests)."""
        self._clock = clock
        self._due = due
        self._check = check
        self._earned = earned
        self._tokens = 0.0
        self._seen_earned = 0
        self._name = name
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread (not for a TTL of 0)."""
        if self.ttl_s <= 0 or self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (a batch in flight finishes first)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def run_once(self) -> int:
        """One pass: earn the budget of the hits since the last pass, check what falls due
        (within the budget); returns the copies checked."""
        total = self._earned()
        self._tokens = min(self._tokens + max(total - self._seen_earned, 0), self.cap)
        self._seen_earned = total
        done = 0
        tried: set[str] = set()  # a copy the source gave no answer for is not asked twice
        while self._tokens >= 1 and not self._stop.is_set():
            keys = self._due(self._clock() + self.lead_s, min(int(self._tokens), BATCH))
            keys = [k for k in keys if k not in tried]
            if not keys:
                break
            tried.update(keys)
            cost = self._check(keys, self._clock())
            self._tokens -= max(cost, 1)
            done += len(keys)
            self.checked += len(keys)
            if len(keys) < BATCH:
                break
        return done

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.run_once()
            except Exception as e:  # a failed pass costs only itself: reads check inline
                log.debug("background check of cached copies failed: %s", e)
