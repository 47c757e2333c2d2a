"""``systemd-analyze verify`` accepts the dataset cache's template unit, as an instance
(its directives: tests/unit/test_systemd_cache_unit.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TEMPLATE = Path(__file__).parents[2] / "systemd" / "metalguard-cache@.service"


def test_systemd_analyze_verify_an_instance(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed: the unit tests of the directives still ran")
    metalguard = Path(sys.executable).parent / "metalguard"
    text = TEMPLATE.read_text().replace("/opt/metalguard/bin/metalguard", str(metalguard))
    (tmp_path / TEMPLATE.name).write_text(text)
    instance = tmp_path / "metalguard-cache@imagenet.service"
    instance.write_text(text)
    result = subprocess.run(
        [analyze, "verify", str(instance)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "metalguard-cache" not in result.stderr, result.stderr
