"""``metalguard twin run|compare --placement topology|blind`` as real processes: the
report's ``placement`` and ``sync`` keys, topology-aware placement synchronising no more
than blind placement of the same workload on a 4-rack fleet, and a bad value (exit 2).
A few seconds in all."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.support.twin_report_keys import REPORT_KEYS

GANGS = """\
duration_median_days = 0.25
duration_min_days = 0.05
duration_max_days = 1.0
checkpoint_interval_s = 1800.0
[sizes]
16 = 2.0
32 = 2.0
64 = 1.0
128 = 1.0
"""
"""Gangs of 2 to 16 nodes, a few hours each: dozens come and go on 4 racks in 2 days."""
FLEET = ["--nodes", "64", "--days", "2", "--seed", "1", "--gangs", "gangs.toml"]
"""64 nodes: 4 racks of 16 (one leaf each) in one cluster."""
SYNC_KEYS = {
    "gangs",
    "gpu_hours",
    "sync_time_share",
    "scaling_efficiency",
    "step_time_s",
    "sync_time_s",
    "bound_by",
    "spread",
    "by_class",
    "by_gang_gpus",
    "model",
    "definition",
}


def twin(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    (cwd / "gangs.toml").write_text(GANGS)
    return subprocess.run(
        [sys.executable, "-m", "metalguard", "twin", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def run_report(placement: str, cwd: Path) -> dict[str, Any]:
    proc = twin("run", *FLEET, "--placement", placement, "--report", "-", cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    report: dict[str, Any] = json.loads(proc.stdout)
    return report


def test_topology_synchronises_no_more_than_blind(tmp_path: Path) -> None:
    topology = run_report("topology", tmp_path)
    blind = run_report("blind", tmp_path)
    for report, placement in ((topology, "topology"), (blind, "blind")):
        assert set(report) == REPORT_KEYS
        assert report["placement"] == placement
        assert set(report["sync"]) == SYNC_KEYS
        assert report["sync"]["gangs"] > 0
        assert set(report["sync"]["step_time_s"]) == {"p50", "p90"}
    assert topology["jobs"]["submitted"] == blind["jobs"]["submitted"]  # the same workload
    t, b = topology["sync"], blind["sync"]
    assert t["sync_time_share"] <= b["sync_time_share"]
    assert t["scaling_efficiency"] >= b["scaling_efficiency"]
    assert t["sync_time_s"]["mean"] <= b["sync_time_s"]["mean"]
    assert t["spread"]["one_leaf"] >= b["spread"]["one_leaf"]
    assert 0 < b["scaling_efficiency"] <= 1


def test_the_default_is_topology_and_compare_takes_the_flag(tmp_path: Path) -> None:
    proc = twin("run", *FLEET, "--report", "-", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["placement"] == "topology"
    proc = twin("compare", *FLEET, "--placement", "blind", "--report-dir", "out", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "scaling efficiency" in proc.stdout
    for policy in ("static", "reactive", "metalguard"):
        report = json.loads((tmp_path / "out" / f"{policy}.json").read_text())
        assert report["placement"] == "blind"


def test_an_unknown_placement_exits_2(tmp_path: Path) -> None:
    proc = twin("run", *FLEET, "--placement", "random", cwd=tmp_path)
    assert proc.returncode == 2
    assert "--placement" in proc.stderr
    assert "invalid choice: 'random'" in proc.stderr
