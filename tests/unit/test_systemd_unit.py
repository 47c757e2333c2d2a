"""systemd/metalguard-agent.service: the directives the agent relies on (systemd-analyze
verify: tests/integration/test_systemd_verify.py)."""

from __future__ import annotations

from pathlib import Path

from tests.support.systemd_units import parse_unit

UNIT = Path(__file__).parents[2] / "systemd" / "metalguard-agent.service"


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
