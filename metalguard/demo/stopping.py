"""How ``metalguard demo`` stops on time under any load (docs/demo.md "Stopping").

The deadline (``--duration``) is a loop timer, SIGINT / SIGTERM are plain signal handlers
(they run between two bytecodes of the main thread, even while the event loop is busy),
and a watchdog **thread** backs both: when the loop has not written the report
``grace_s`` after the stop was asked for, the watchdog writes it itself (the loop is
wedged), ends the children and exits 0.  A second signal exits at once with 128 + the
signal (130 for SIGINT, 143 for SIGTERM), the report unwritten.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
GRACE_S = 3.0
"""How long the loop has, after the deadline or a signal, to write the report."""
EXIT_AFTER_S = 4.5
"""How long the loop has, after the deadline or a signal, to finish its cleanup."""


class Stopper:
    """The demo's stop: ``requested`` (an asyncio.Event) is set by the deadline or the
    first signal; :meth:`reported` and :meth:`finished` tell the watchdog how far the loop
    got.  ``force_report`` (run on the watchdog thread) writes the report when the loop
    could not; ``emergency`` (idem) ends the children before an exit without cleanup."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        force_report: Callable[[], None],
        emergency: Callable[[], None],
        grace_s: float = GRACE_S,
        exit_after_s: float = EXIT_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
        exit: Callable[[int], None] = os._exit,
    ) -> None:
        self.requested = asyncio.Event()
        self._loop = loop
        self._force_report = force_report
        self._emergency = emergency
        self._grace_s = grace_s
        self._exit_after_s = exit_after_s
        self._clock = clock
        self._exit = exit
        self.deadline: float | None = None
        """Monotonic time the run is due to end (None: no ``--duration``)."""
        self.asked_at: float | None = None
        """When the stop was asked for (the deadline, or the first signal's arrival)."""
        self.stopping_at: float | None = None
        """When the loop began to stop."""
        self.signals = 0
        self._poke = threading.Event()
        """Wakes the watchdog to read the deadline and ``asked_at`` again."""
        self._reported = threading.Event()
        self._finished = threading.Event()
        self._previous: dict[int, object] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._thread = threading.Thread(target=self._watch, name="demo-stop-watchdog", daemon=True)

    # --- arming -------------------------------------------------------------------------
    def install(self) -> None:
        """Take SIGINT and SIGTERM, start the watchdog."""
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        self._thread.start()

    def uninstall(self) -> None:
        """Give the signals back (the watchdog ends with :meth:`finished`)."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)  # type: ignore[arg-type]
        self._previous.clear()
        if self._timer is not None:
            self._timer.cancel()

    def arm(self, duration_s: float | None) -> None:
        """Start the ``--duration`` clock now (None: run until a signal)."""
        if duration_s is None:
            return
        self.deadline = self._clock() + duration_s
        self._timer = self._loop.call_later(duration_s, self._due)
        self._poke.set()  # the watchdog now watches the deadline too

    # --- what the loop says -----------------------------------------------------------
    def stopping(self) -> None:
        """The loop begins to stop (after the deadline, a signal, or on its own)."""
        now = self._clock()
        self.stopping_at = now
        if self.asked_at is None:
            self.asked_at = now
        self._poke.set()

    @property
    def lag_s(self) -> float | None:
        """Seconds from when the stop was due (deadline or signal) to the loop stopping."""
        if self.stopping_at is None or self.asked_at is None:
            return None
        return round(max(0.0, self.stopping_at - self.asked_at), 3)

    def reported(self) -> None:
        """The report is written (or none was asked for)."""
        self._reported.set()

    def finished(self) -> None:
        """The run is over: a watchdog still waiting for a stop ends (one already stopping
        keeps its exit deadline: a process that has not exited by then is ended)."""
        self._finished.set()
        self._poke.set()

    # --- internals ----------------------------------------------------------------------
    def _due(self) -> None:
        if self.asked_at is None:
            self.asked_at = self.deadline
        self.requested.set()

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.signals += 1
        if self.signals > 1:
            try:
                self._emergency()
            finally:
                self._exit(128 + signum)
            return
        if self.asked_at is None:
            self.asked_at = self._clock()
        # No lock here: the handler runs on the main thread between two bytecodes, maybe
        # inside ``self._poke.set()`` (arm, stopping), whose lock it would wait for forever
        # (seen once: a SIGINT right after "running" hung the demo and its watchdog). The
        # watchdog reads ``asked_at`` within its 0.5-s poll; call_soon_threadsafe takes
        # no lock (a deque append and a byte to the loop's self-pipe).
        with contextlib.suppress(RuntimeError):  # a closed loop: past the stop already
            self._loop.call_soon_threadsafe(self.requested.set)

    def _watch(self) -> None:
        while True:
            if self._finished.is_set():
                return
            due = self.asked_at if self.asked_at is not None else self.deadline
            now = self._clock()
            if due is not None and now >= due:
                break
            self._poke.wait(0.5 if due is None else min(0.5, due - now))
            self._poke.clear()
        started = self.asked_at if self.asked_at is not None else self._clock()
        if self.asked_at is None:
            self.asked_at = started
        with _suppress_all():
            self._loop.call_soon_threadsafe(self.requested.set)
        if not self._reported.wait(max(0.0, started + self._grace_s - self._clock())):
            log.warning("the event loop did not stop in %.1f s: writing the report", self._grace_s)
            if self.stopping_at is None:
                self.stopping_at = self._clock()
            with _suppress_all():
                self._force_report()
            self._reported.set()
        # the process normally exits before this: then this daemon thread ends with it
        threading.Event().wait(max(0.0, started + self._exit_after_s - self._clock()))
        log.warning("the demo did not exit within %.1f s of its stop: exiting", self._exit_after_s)
        try:
            with _suppress_all():
                self._emergency()
        finally:
            self._exit(0)


@contextlib.contextmanager
def _suppress_all() -> Iterator[None]:
    """Log and swallow any exception (the watchdog must reach its exit)."""
    try:
        yield
    except Exception as exc:
        log.error("demo stop watchdog: %r", exc)
