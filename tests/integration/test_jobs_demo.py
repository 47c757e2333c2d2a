"""`metalguard demo --headless` with a ``[[job]]`` scenario: the job is submitted, moved off
the node a fault hits, finishes, and the report's ``jobs`` list says so."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support import ROOT
from tests.support.harness.jobs_env import expected_digest

METALGUARD = Path(sys.executable).parent / "metalguard"
STEPS = 100

SCENARIO = f"""\
description = "one job, one fault on its node"

[[job]]
at = 0
name = "demo-job"
nodes = 2
args = ["examples/trainer.py", "--steps", "{STEPS}"]
checkpoint_every = 1

[[fault]]
at = 3
node = "r1c1k1n1"
kind = "ecc_ue"
"""


def test_demo_runs_the_scenarios_jobs_and_reports_them(tmp_path: Path) -> None:
    scenario = tmp_path / "s.toml"
    scenario.write_text(SCENARIO)
    report = tmp_path / "report.json"
    command = [
        str(METALGUARD), "demo", "--headless", "--duration", "12",
        "--racks", "2", "--nodes-per-rack", "3", "--interval", "0.5",
        "--scenario", str(scenario), "--report", str(report), "--http", "127.0.0.1:0",
    ]  # fmt: skip
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
        cwd=ROOT,  # the scenario's relative paths (examples/trainer.py) are from here
    )
    assert result.returncode == 0, result.stderr
    assert "job demo-job submitted as" in result.stdout
    jobs = json.loads(report.read_text())["jobs"]
    assert len(jobs) == 1
    job = jobs[0]
    assert set(job) == {
        "id", "name", "state", "placement", "restarts", "resumed_from_step",
        "steps_redone", "downtime_s", "digest", "reason",
    }  # fmt: skip
    assert job["name"] == "demo-job"
    assert job["state"] == "succeeded", result.stdout
    assert job["restarts"] == 1
    assert job["resumed_from_step"] > 0
    assert "r1.c1.r1c1k1n1" not in job["placement"]
    assert job["digest"] == expected_digest(STEPS)
