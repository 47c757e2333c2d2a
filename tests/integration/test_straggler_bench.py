"""bench/straggler_bench.py --quick runs the detector on its simulated 64-rank trainer and
prints its figures (no timing is asserted: the guarantees are, nobody marked in the
healthy runs, the congestion reported as a whole-job slowdown, and a 20 % straggler named
first in every trial)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

# A deadline for a hang, not a speed check: simulated time, a few seconds on an idle host.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

BENCH = Path(__file__).resolve().parents[2] / "bench" / "straggler_bench.py"

STRAGGLER = re.compile(
    r"^straggler (\d+)% (on a random rank|in a 4-stage pipeline \(stage 3 at 1\.3x\)): "
    r"named in (\d+) of (\d+) trials, slowdown start to named "
    r"(?:p50 ([\d.]+) min, p90 ([\d.]+) min|p50 -, p90 -) \(simulated\); "
    r"top-1 (\d+)% \((\d+)/(\d+)\) within 30 min, (\d+)% \((\d+)/(\d+)\) within 5 min; "
    r"other nodes named (\d+)(.*)$",
    re.M,
)
HEALTHY = re.compile(
    r"^healthy, (.+): ([\d,]+) node-hours, (\d+) false marks, "
    r"whole-job slowdown in (\d+) of (\d+) windows$",
    re.M,
)


def test_straggler_bench_quick_prints_figures() -> None:
    result = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--seed", "7"],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-6000:]
    out = result.stdout
    assert re.search(r"^machine: \d+ vCPU", out, re.M), out
    assert re.search(r"^job: 64 ranks on 64 nodes, .*threshold 8%, persistence 4", out, re.M)

    rows = {(int(m[1]), m[2]): m for m in STRAGGLER.finditer(out)}
    assert sorted(rows) == sorted(
        [(p, "on a random rank") for p in (2, 5, 10, 20)]
        + [(10, "in a 4-stage pipeline (stage 3 at 1.3x)")]
    ), out
    for m in rows.values():
        named, trials, right = int(m[3]), int(m[4]), int(m[8])
        assert trials == 5, m[0]
        assert int(m[9]) == trials, m[0]
        assert right <= named <= trials, m[0]
        assert int(m[11]) <= right, m[0]
    # below the 8 % threshold: the line says so (and 2 % is named nowhere)
    for pct in (2, 5):
        assert "expected: below the 8% threshold" in rows[pct, "on a random rank"][14], out
    assert int(rows[2, "on a random rank"][3]) == 0, out
    # 20 %: named first in every trial, nobody else named
    top = rows[20, "on a random rank"]
    assert (int(top[3]), int(top[8]), int(top[13])) == (5, 5, 0), top[0]
    assert "goal: named first within 5 min" in rows[10, "on a random rank"][14]

    healthy = {m[1]: m for m in HEALTHY.finditer(out)}
    assert len(healthy) == 8, out
    assert all(int(m[3]) == 0 for m in healthy.values()), out  # no false marks
    total = sum(float(m[2].replace(",", "")) for m in healthy.values())
    assert total == 8 * 64 * 0.5  # 8 runs of 0.5 simulated hours on 64 nodes
    assert re.search(
        rf"^false marks: 0 in {total:,.0f} node-hours of healthy runs = 0\.00 per 1,000 "
        r"node-hours \(goal: 0\)$",
        out,
        re.M,
    ), out
    congestion = re.search(
        r"^congestion: whole-job slowdown reported in (\d+) of (\d+) windows after it began "
        r"\(up to \+(\d+)%\), (\d+) of (\d+) before; suspects named 0$",
        out,
        re.M,
    )
    assert congestion, out
    assert int(congestion[1]) > 0, congestion[0]  # the congestion: a whole-job slowdown
    assert int(congestion[4]) == 0, congestion[0]  # and none before it began
