"""A ``metalguard demo --headless`` child process for the tests, its output read line by
line on a thread (waits with deadlines on its lines)."""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.support import ROOT

METALGUARD = Path(sys.executable).parent / "metalguard"


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
        self.wait_for(text, timeout_s)
        return time.monotonic()

    def wait_for(self, text: str, timeout_s: float) -> str:
        """Wait for a line containing ``text``; the line."""
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
                return line

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
