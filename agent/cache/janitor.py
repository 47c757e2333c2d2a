"""Deleting dropped cache copies off the reader's thread, without loosening the size bound.

Unlinking a copy of a few hundred KiB costs ~0.5-1 ms on ext4 (its pages and blocks are
freed), twice per eviction with its record: on the thread of the reader whose miss
evicted it, that was most of what a miss cost beyond the fetch.  :class:`Janitor` unlinks
on a thread of its own and counts the bytes it has yet to delete (:attr:`pending_bytes`):
they are still on disk, so the store's bound is ``used + reserved + pending <= max_bytes``
for every byte a fill *writes* — a fill waits in :meth:`wait` (before its first write,
after its source request: the unlinks overlap the fetch) until the janitor has caught
up.  Every queued deletion ends in ``pending_bytes`` going down, whatever the unlink
answers (a file already gone, or an error: logged), so a wait always ends.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

log = logging.getLogger(__name__)


class Janitor:
    """Unlinks files on its own thread (see the module doc); ``name`` names the thread."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._cond = threading.Condition()
        self._queue: deque[tuple[Sequence[Path], int]] = deque()
        self._pending = 0
        self._stopping = False
        self._thread: threading.Thread | None = None

    @property
    def pending_bytes(self) -> int:
        """Bytes of queued files not deleted yet."""
        return self._pending

    def start(self) -> None:
        """Start the thread (once)."""
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Delete everything still queued, then stop the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._drain()

    def discard(self, paths: Sequence[Path], nbytes: int) -> None:
        """Queue ``paths`` (one copy: its data and record) for deletion; ``nbytes``: what
        they hold on disk.  Without a running thread they are deleted at once."""
        if self._thread is None:
            _unlink(paths)
            return
        with self._cond:
            self._queue.append((paths, nbytes))
            self._pending += nbytes
            self._cond.notify_all()

    def wait(self, ready: Callable[[int], bool], timeout_s: float) -> bool:
        """Wait until ``ready(pending_bytes)`` holds (re-asked after every deletion); False
        after ``timeout_s`` without it."""
        with self._cond:
            return self._cond.wait_for(lambda: ready(self._pending), timeout_s)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    return
                paths, nbytes = self._queue.popleft()
            try:
                _unlink(paths)
            finally:
                with self._cond:
                    self._pending -= nbytes
                    self._cond.notify_all()

    def _drain(self) -> None:
        with self._cond:
            items = list(self._queue)
            self._queue.clear()
            self._pending = 0
            self._cond.notify_all()
        for paths, _ in items:
            _unlink(paths)


def _unlink(paths: Sequence[Path]) -> None:
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
        except OSError as e:
            with contextlib.suppress(Exception):
                log.warning("deleting the dropped cache file %s failed: %s", p, e)
