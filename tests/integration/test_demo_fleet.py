"""`metalguard demo --headless`: a fleet plays a scenario; the report says what happened."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(240)  # its child's own deadline is 120 s

METALGUARD = Path(sys.executable).parent / "metalguard"


def test_headless_demo_plays_a_scenario_and_reports(tmp_path: Path) -> None:
    scenario = tmp_path / "s.toml"
    scenario.write_text(
        'description = "one ECC error"\n[[fault]]\nat = 2\nnode = "r1c1k1n2"\nkind = "ecc_ue"\n'
    )
    report = tmp_path / "report.json"
    result = subprocess.run(
        [
            str(METALGUARD), "--log-level", "warning", "demo", "--headless",
            "--duration", "8", "--racks", "1", "--nodes-per-rack", "4",
            "--scenario", str(scenario), "--report", str(report), "--http", "127.0.0.1:0",
        ],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "nats://" in result.stdout
    assert "agents up: 4/4" in result.stdout
    doc = json.loads(report.read_text())
    assert sorted(n["node"] for n in doc["nodes"]) == [f"r1c1k1n{i}" for i in range(1, 5)]
    assert [(f["node"], f["kind"]) for f in doc["faults"]] == [("r1c1k1n2", "ecc_ue")]
    grades = {n["node"]: n["grade"] for n in doc["nodes"]}
    assert grades["r1c1k1n2"] == "FAILING"
    assert {grades[f"r1c1k1n{i}"] for i in (1, 3, 4)} == {"HEALTHY"}
    isolated = [e for e in doc["events"] if e["kind"] == "node.isolated"]
    assert [e["node"] for e in isolated] == ["r1c1k1n2"]
    assert isolated[0]["t"] >= doc["faults"][0]["t"]
    assert isolated[0]["reasons"][0]["rule"] == "ecc_uncorrectable"


def test_bad_scenario_exits_2_naming_file_and_key(tmp_path: Path) -> None:
    scenario = tmp_path / "s.toml"
    scenario.write_text('[[fault]]\nat = 2\nnode = "r1c1k1n2"\nkind = "meteor"\n')
    result = subprocess.run(
        [str(METALGUARD), "demo", "--headless", "--scenario", str(scenario)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert f"{scenario}: fault[0].kind" in result.stderr
