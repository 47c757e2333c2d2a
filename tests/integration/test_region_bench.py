"""bench/region_bench.py --quick runs on a 3-server cluster and prints its figures (no
timing is asserted: the guarantees are, nothing lost and isolations exactly once)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

# A deadline for a hang, not a speed check: a bench child on a busy host takes minutes.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]

BENCH = Path(__file__).resolve().parents[2] / "bench" / "region_bench.py"


def _text(data: str | bytes | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""


def test_region_bench_quick_prints_figures() -> None:
    try:
        result = subprocess.run(
            [sys.executable, str(BENCH), "--quick"],
            capture_output=True,
            text=True,
            timeout=400,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:  # where it got to: its steps are on stderr
        pytest.fail(f"the bench ran past 400 s\n{_text(exc.stdout)}\n{_text(exc.stderr)[-6000:]}")
    assert result.returncode == 0, result.stdout + result.stderr[-6000:]
    out = result.stdout
    assert re.search(r"^machine: \d+ vCPU", out, re.M), out
    rates = re.findall(
        r"^sustained ingest, (\d) shard\(s\): ([\d,]+) batches/s \(shards/raw", out, re.M
    )
    assert [n for n, _ in rates] == ["1", "2"], out
    assert re.search(
        r"^fault-to-isolation, \d+ of 200 nodes .* p50 [\d.]+ s, p99 [\d.]+ s, .*"
        r"the host's CPUs \d+% busy",
        out,
        re.M,
    ), out
    assert re.search(
        r"^shard SIGKILL mid-run .* taken over after [\d.]+ s .* exactly once each$", out, re.M
    ), out
    assert re.search(
        r"^NATS server n\d \(stream leader\) SIGKILLed .*\(nothing lost\)", out, re.M
    ), out
