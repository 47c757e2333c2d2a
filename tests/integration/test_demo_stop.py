"""`metalguard demo` stops on time and with a report, whatever happens in its run.

- the bad-command scenario (issue 16): a job whose ``command`` is a relative path the
  members cannot run ends ``failed`` with the reason in the report, and the demo, with a
  CPU-bound process busy beside it, stops within 5 s of its ``--duration`` and exits 0;
- SIGINT mid-run writes the report and exits 0; two SIGINTs exit at once, 130.
"""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import ROOT

METALGUARD = Path(sys.executable).parent / "metalguard"
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


class Demo:
    """A ``metalguard demo --headless`` child; its stdout read line by line on a thread."""

    def __init__(self, tmp: Path, scenario: str, duration_s: float) -> None:
        path = tmp / "scenario.toml"
        path.write_text(scenario)
        self.report = tmp / "report.json"
        command = [
            str(METALGUARD), "demo", "--headless", "--duration", str(duration_s),
            "--racks", "2", "--nodes-per-rack", "3", "--interval", "0.5",
            "--scenario", str(path), "--report", str(self.report), "--http", "127.0.0.1:0",
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            command,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)
            self.lines.put(line)

    def wait_line(self, text: str, timeout_s: float) -> float:
        """Wait for a line containing ``text``; the monotonic time it was read."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {text!r} within {timeout_s}s:\n{self.tail()}")
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if text in line:
                return time.monotonic()

    def wait_exit(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout_s}s:\n{self.tail()}") from None

    def tail(self) -> str:
        return "".join(self.output[-40:])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


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
