"""Running Slurm's tools (controller/slurm/runner.py): retries with backoff, timeouts,
failures reported as SlurmCommandError, never an escaping OSError.

The failing "tools" are tiny shell scripts in a temp ``bin_dir``: a slow or flaky
``sinfo`` cannot be had on demand from a real Slurm (the real tools run in
tests/integration/test_slurm_bridge.py).
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from metalguard.controller.slurm.config import SlurmSection
from metalguard.controller.slurm.runner import SlurmCommandError, SlurmRunner


class Sleeps:
    """An injected sleep that records the delays and does not wait."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)


def tool(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


async def test_a_missing_tool_is_retried_with_backoff_then_reported(tmp_path: Path) -> None:
    sleeps = Sleeps()
    cfg = SlurmSection(bin_dir=str(tmp_path), attempts=4, backoff_s=0.5, backoff_max_s=1.0)
    runner = SlurmRunner(cfg, sleep=sleeps, rng=random.Random(1))
    with pytest.raises(SlurmCommandError) as info:
        await runner.run("scontrol", "update", "NodeName=g1", "State=RESUME")
    assert info.value.attempts == 4
    assert "exit 127: cannot run" in info.value.detail
    assert info.value.argv == (str(tmp_path / "scontrol"), "update", "NodeName=g1", "State=RESUME")
    assert len(sleeps.delays) == 3
    for delay, ceiling in zip(sleeps.delays, (0.5, 1.0, 1.0), strict=True):
        assert 0 <= delay <= ceiling
    assert runner.failures == 4


async def test_a_flaky_tool_succeeds_on_retry(tmp_path: Path) -> None:
    count = tmp_path / "count"
    tool(
        tmp_path,
        "sinfo",
        f"n=$(cat {count} 2>/dev/null || echo 0); echo $((n+1)) > {count}\n"
        '[ "$n" -ge 1 ] || { echo "slurm_load_node error: Unable to contact" >&2; exit 1; }\n'
        'echo "conf=$SLURM_CONF args=$*"',
    )
    cfg = SlurmSection(bin_dir=str(tmp_path), conf="/etc/x/slurm.conf", attempts=3)
    runner = SlurmRunner(cfg, sleep=Sleeps())
    assert await runner.run("sinfo", "--json") == "conf=/etc/x/slurm.conf args=--json\n"
    assert runner.failures == 1


async def test_a_hung_tool_is_killed_at_its_timeout(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    tool(tmp_path, "squeue", f"echo $$ > {pid_file}; exec sleep 30")
    cfg = SlurmSection(bin_dir=str(tmp_path), command_timeout_s=0.2, attempts=1)
    runner = SlurmRunner(cfg, sleep=Sleeps())
    started = time.monotonic()
    with pytest.raises(SlurmCommandError, match=r"timed out after 0\.2s"):
        await runner.run("squeue", "--json")
    assert time.monotonic() - started < 5
    assert _gone(int(pid_file.read_text()))


def _gone(pid: int) -> bool:
    """The process has exited (or is a zombie nobody reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True
