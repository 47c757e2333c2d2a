"""`metalguard demo` stops on time and with a report, whatever happens in its run.

- the bad-command scenario (issue 16): a job whose ``command`` is a relative path the
  members cannot run ends ``failed`` with the reason in the report, and the demo, with a
  CPU-bound process busy beside it, stops within 5 s of its ``--duration`` and exits 0;
- SIGINT mid-run writes the report and exits 0; two SIGINTs exit at once, 130.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.harness.demo_child import Demo

RUNNING = "running; press Ctrl-C to stop"
BAD_COMMAND = """\
description = "a job whose command is not runnable from the member's directory"

[[job]]
at = 0
name = "bad-command"
nodes = 2
command = "examples/trainer.py"
args = ["--steps", "50"]
"""
DURATION_S = 15.0


@pytest.fixture
def busy_core() -> Iterator[subprocess.Popen[bytes]]:
    """A CPU-bound process spinning beside the demo for the whole test."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(10)


def test_a_bad_command_fails_its_job_and_the_demo_stops_on_time_under_load(
    tmp_path: Path, busy_core: subprocess.Popen[bytes]
) -> None:
    demo = Demo(tmp_path, BAD_COMMAND, DURATION_S)
    try:
        running = demo.wait_line(RUNNING, 120)
        code = demo.wait_exit(DURATION_S + 60)
        took = time.monotonic() - running
    finally:
        demo.kill()
    print(f"scenario clock to exit: {took:.2f} s (duration {DURATION_S:g} s)")
    assert code == 0, demo.tail()
    doc = json.loads(demo.report.read_text())
    print("stop_lag_s:", doc["stop_lag_s"], "stopped_by:", doc["stopped_by"])
    assert took <= DURATION_S + 5.0, demo.tail()  # the acceptance: within 5 s of it
    assert doc["stopped_by"] == "duration"
    assert isinstance(doc["stop_lag_s"], float)
    assert isinstance(doc["stop_forced"], bool)
    (job,) = doc["jobs"]
    assert job["state"] == "failed", demo.tail()
    assert "cannot run 'examples/trainer.py'" in job["reason"]
    assert "No such file or directory" in job["reason"]
    assert job["restarts"] <= 3  # at once for this permanent cause: 0
    assert doc["ok"] is False  # a failed job is never ok
    refusals = [line for line in demo.output if "start refused by" in line]
    assert len(refusals) == 1, refusals  # two members refused: one line
    assert "report written to" in demo.tail()


def test_sigint_mid_run_writes_the_report_and_exits_0(tmp_path: Path) -> None:
    demo = Demo(tmp_path, 'description = "healthy"\n', 120)
    try:
        demo.wait_line(RUNNING, 120)
        asked = time.monotonic()
        demo.proc.send_signal(signal.SIGINT)
        code = demo.wait_exit(30)
        print(f"SIGINT to exit: {time.monotonic() - asked:.2f} s")
    finally:
        demo.kill()
    assert code == 0, demo.tail()
    doc = json.loads(demo.report.read_text())
    assert doc["stopped_by"] == "signal"
    assert doc["ok"] is True
    assert len(doc["nodes"]) == 6


def test_a_second_sigint_exits_at_once_non_zero(tmp_path: Path) -> None:
    demo = Demo(tmp_path, 'description = "healthy"\n', 120)
    try:
        demo.wait_line(RUNNING, 120)
        asked = time.monotonic()
        demo.proc.send_signal(signal.SIGINT)
        # two signals sent back to back reach Python as one: the second once it stops
        demo.wait_line("stopping (a signal", 30)
        demo.proc.send_signal(signal.SIGINT)
        code = demo.wait_exit(30)
        print(f"two SIGINTs to exit: {time.monotonic() - asked:.2f} s")
    finally:
        demo.kill()
    assert code == 130, demo.tail()
