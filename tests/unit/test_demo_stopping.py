"""The demo's stop (metalguard/demo/stopping.py): the watchdog thread writes the report
and exits when the event loop is wedged; a second signal exits at once; the lag."""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Iterator

import pytest

from metalguard.demo.stopping import Stopper


class Calls:
    def __init__(self) -> None:
        self.reports = 0
        self.emergencies = 0
        self.exits: list[int] = []
        self.exited = threading.Event()

    def report(self) -> None:
        self.reports += 1

    def emergency(self) -> None:
        self.emergencies += 1

    def exit(self, code: int) -> None:
        self.exits.append(code)
        self.exited.set()


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """A loop that never runs: a wedged one, as far as the watchdog can tell."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def stopper(loop: asyncio.AbstractEventLoop, calls: Calls) -> Stopper:
    return Stopper(
        loop,
        force_report=calls.report,
        emergency=calls.emergency,
        grace_s=0.2,
        exit_after_s=0.4,
        exit=calls.exit,
    )


def test_a_wedged_loop_gets_its_report_written_and_the_process_ended(
    loop: asyncio.AbstractEventLoop,
) -> None:
    calls = Calls()
    s = stopper(loop, calls)
    s.install()
    try:
        s.arm(0.05)
        assert calls.exited.wait(10), "the watchdog never ended the process"
    finally:
        s.uninstall()
    assert calls.reports == 1
    assert calls.emergencies == 1
    assert calls.exits == [0]
    assert s.lag_s is not None
    assert s.lag_s >= 0.0


def test_a_loop_that_reports_in_time_is_not_overridden(loop: asyncio.AbstractEventLoop) -> None:
    calls = Calls()
    s = stopper(loop, calls)
    s.install()
    try:
        s.arm(0.0)
        s.stopping()
        s.reported()
        assert calls.exited.wait(10)  # in a real process the exit came first
    finally:
        s.uninstall()
    assert calls.reports == 0


def test_without_a_stop_the_watchdog_ends_with_the_run(loop: asyncio.AbstractEventLoop) -> None:
    calls = Calls()
    s = stopper(loop, calls)
    s.install()
    s.finished()
    s.uninstall()
    assert not calls.exited.wait(0.6)
    assert calls.reports == calls.emergencies == 0


def test_the_first_signal_asks_for_the_stop_the_second_exits_at_once(
    loop: asyncio.AbstractEventLoop,
) -> None:
    calls = Calls()
    now = [100.0]
    s = Stopper(
        loop,
        force_report=calls.report,
        emergency=calls.emergency,
        clock=lambda: now[0],
        exit=calls.exit,
    )
    s._on_signal(signal.SIGINT, None)
    assert s.asked_at == 100.0
    assert calls.exits == []
    now[0] = 101.5
    s.stopping()
    assert s.lag_s == 1.5
    s._on_signal(signal.SIGTERM, None)
    assert calls.emergencies == 1
    assert calls.exits == [128 + signal.SIGTERM]
    s.finished()


def test_the_lag_counts_from_the_deadline(loop: asyncio.AbstractEventLoop) -> None:
    now = [10.0]
    calls = Calls()
    s = Stopper(loop, force_report=calls.report, emergency=calls.emergency, clock=lambda: now[0])
    s.arm(5.0)
    assert s.deadline == 15.0
    s._due()  # the timer fired ...
    now[0] = 17.25  # ... and the loop got to it 2.25 s late
    s.stopping()
    assert s.lag_s == 2.25
    assert s.requested.is_set()
    s.finished()
    s.uninstall()


def test_the_signal_handler_takes_no_lock_its_own_thread_may_hold(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """A signal runs its handler on the main thread, possibly inside the watchdog's
    Event.set() (arm, stopping): a handler that took that lock would wait forever."""
    calls = Calls()
    s = stopper(loop, calls)
    returned = threading.Event()

    def signal_inside_poke_set() -> None:
        with s._poke._cond:  # type: ignore[attr-defined]  # the lock Event.set() holds
            s._on_signal(signal.SIGINT, None)
        returned.set()

    threading.Thread(target=signal_inside_poke_set, daemon=True).start()
    assert returned.wait(5), "the signal handler blocked on a lock its own thread held"
    assert s.asked_at is not None
    s.finished()
