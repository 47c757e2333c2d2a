"""`metalguard demo --headless` with a ``kind = "straggler"`` fault (docs/simulation.md
"Faults"): the node's trainer computes slower with no error anywhere; the job manager
names the node from the ranks' timings, and the report's fault row shows it SUB_HEALTHY."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support import ROOT

METALGUARD = Path(sys.executable).parent / "metalguard"
STEPS = 400

SCENARIO = f"""\
description = "a node that slows its job without failing"

[[job]]
at = 0
name = "synced"
nodes = 3
args = ["examples/trainer.py", "--steps", "{STEPS}", "--step-seconds", "0.05", "--sync"]
checkpoint_every = 2
timing_window_s = 1

[[fault]]
at = 2
node = "r1c1k1n2"
kind = "straggler"
slowdown = 1.0
expect = "SUB_HEALTHY"
"""


def test_a_straggler_fault_is_named_from_the_timings_and_its_node_sub_healthy(
    tmp_path: Path,
) -> None:
    scenario = tmp_path / "s.toml"
    scenario.write_text(SCENARIO)
    report = tmp_path / "report.json"
    command = [
        str(METALGUARD), "demo", "--headless", "--duration", "20",
        "--racks", "2", "--nodes-per-rack", "3", "--interval", "0.5",
        "--scenario", str(scenario), "--report", str(report), "--http", "127.0.0.1:0",
    ]  # fmt: skip
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=120, check=False, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    doc = json.loads(report.read_text())
    (job,) = doc["jobs"]
    assert "r1.c1.r1c1k1n2" in job["placement"], doc["jobs"]
    stragglers = [e for e in doc["events"] if e["kind"] == "node.straggler"]
    assert [e["node"] for e in stragglers] == ["r1c1k1n2"], result.stdout
    assert stragglers[0]["reasons"][0]["signal"] == "jobs.straggler"
    (fault,) = doc["faults"]
    assert fault["kind"] == "straggler"
    assert fault["expected"] == "SUB_HEALTHY", fault
    assert fault["got"] == "SUB_HEALTHY", fault
    assert doc["ok"] is True
    assert "node.straggler r1c1k1n2" in result.stdout
