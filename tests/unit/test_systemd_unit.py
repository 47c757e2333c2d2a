"""systemd/metalguard-agent.service: the directives the agent relies on, and verify."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

UNIT = Path(__file__).parents[2] / "systemd" / "metalguard-agent.service"


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """INI-like systemd unit -> section -> key -> values (keys may repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"directive outside a section: {line}"
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def test_key_directives() -> None:
    service = parse_unit(UNIT.read_text())["Service"]
    assert service["Type"] == ["notify"]
    assert service["NotifyAccess"] == ["main"]
    assert service["WatchdogSec"] == ["30s"]
    assert service["Restart"] == ["on-failure"]
    assert service["NoNewPrivileges"] == ["yes"]
    assert service["ProtectSystem"] == ["strict"]
    assert service["ProtectHome"] == ["yes"]
    assert service["PrivateTmp"] == ["yes"]
    assert service["ReadWritePaths"] == ["/var/lib/metalguard"]
    caps = set(service["CapabilityBoundingSet"][0].split())
    assert caps == {"CAP_NET_ADMIN", "CAP_SYS_RAWIO", "CAP_SYS_ADMIN"}
    assert "AF_NETLINK" in service["RestrictAddressFamilies"][0]
    assert service["PrivateDevices"] == ["no"], "smartctl must see /dev/sd* and /dev/nvme*"
    assert "agent run --config" in service["ExecStart"][0]
    assert service["ExecReload"] == ["/bin/kill -HUP $MAINPID"]


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed: the directive test above still ran")
    metalguard = Path(sys.executable).parent / "metalguard"
    unit = tmp_path / "metalguard-agent.service"
    unit.write_text(UNIT.read_text().replace("/opt/metalguard/bin/metalguard", str(metalguard)))
    result = subprocess.run(
        [analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "metalguard-agent.service" not in result.stderr, result.stderr
