"""bench/api_bench.py runs and prints its figures (no timing is asserted)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

# A deadline for a hang, not a speed check: a bench child on a busy host takes minutes.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

BENCH = Path(__file__).resolve().parents[2] / "bench" / "api_bench.py"
ROW = re.compile(  # case, p50, p99, p99/healthz, bytes
    r"^(healthz|page[\w =+()-]*|summary by=\w+(?: rebuilt)?)"
    r"\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x\s+([\d,]+)$"
)


def test_api_bench_quick_prints_the_table() -> None:
    result = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--no-browser"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    rows = {m.group(1).strip(): m for line in out.splitlines() if (m := ROW.match(line))}
    assert {"healthz", "page", "page grade=FAILING", "summary by=rack rebuilt"} <= set(rows), out
    assert float(rows["healthz"].group(4)) == 1.0, "healthz is the baseline"
    assert int(rows["page"].group(5).replace(",", "")) > 10_000, "a page of 500 lines"
    assert re.search(r"^goal: page of 500 p99 <= 100 ms: worst page p99 [\d.]+ ms", out, re.M)
    assert re.search(r"^legacy GET /v1/nodes \(no index, unpaged\) at 5,000 nodes", out, re.M)
    assert re.search(r"^record write \(liveness\): dict [\d.]+ us, with the index", out, re.M)
    assert "dashboard: skipped (--no-browser)" in out
