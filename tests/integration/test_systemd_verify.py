"""``systemd-analyze verify`` accepts the agent's and the controller's units (their
directives are checked without systemd by tests/unit/test_systemd_unit.py and
tests/unit/test_controller_config.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SYSTEMD = Path(__file__).parents[2] / "systemd"


@pytest.mark.parametrize("name", ["metalguard-agent.service", "metalguard-controller.service"])
def test_systemd_analyze_verify(tmp_path: Path, name: str) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed: the unit tests of the directives still ran")
    metalguard = Path(sys.executable).parent / "metalguard"
    unit = tmp_path / name
    text = (SYSTEMD / name).read_text()
    unit.write_text(text.replace("/opt/metalguard/bin/metalguard", str(metalguard)))
    result = subprocess.run(
        [analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert name not in result.stderr, result.stderr
