"""systemd/metalguard-cache@.service: the directives the dataset cache relies on
(systemd-analyze verify: tests/integration/test_systemd_cache_verify.py)."""

from __future__ import annotations

from pathlib import Path

from tests.support.systemd_units import parse_unit

UNIT = Path(__file__).parents[2] / "systemd" / "metalguard-cache@.service"

MOUNT_NAMESPACE_OPTIONS = (
    "PrivateTmp",
    "PrivateDevices",
    "PrivateMounts",
    "ProtectSystem",
    "ProtectHome",
    "ProtectKernelTunables",
    "ProtectKernelModules",
    "ProtectControlGroups",
    "ReadWritePaths",
    "ReadOnlyPaths",
    "InaccessiblePaths",
    "TemporaryFileSystem",
    "BindPaths",
    "MountFlags",
)
"""Each gives the service its own mount namespace: the FUSE mount would be invisible to
the node's jobs."""


def test_key_directives() -> None:
    unit = parse_unit(UNIT.read_text())
    service = unit["Service"]
    assert service["Type"] == ["notify"]
    assert service["NotifyAccess"] == ["main"]
    assert service["Restart"] == ["on-failure"]
    assert service["KillMode"] == ["mixed"]
    exec_start = service["ExecStart"][0]
    assert exec_start.endswith("cache mount --config /etc/metalguard/agent.toml --dataset %i")
    assert set(service["CapabilityBoundingSet"][0].split()) == {
        "CAP_SYS_ADMIN",
        "CAP_DAC_READ_SEARCH",
    }
    assert "/dev/fuse rw" in service["DeviceAllow"]
    assert "@mount" in service["SystemCallFilter"][0]
    assert service["UMask"] == ["0022"]
    assert "network-online.target" in unit["Unit"]["After"][0]


def test_no_private_mount_namespace() -> None:
    service = parse_unit(UNIT.read_text())["Service"]
    found = sorted(set(service) & set(MOUNT_NAMESPACE_OPTIONS))
    assert not found, f"these hide the FUSE mount from the node: {found}"
