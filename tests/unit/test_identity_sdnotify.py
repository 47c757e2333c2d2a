"""Node identity defaults and the sd_notify watchdog interval (the datagrams themselves:
tests/integration/test_sdnotify_socket.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from metalguard.agent.identity import parse_uuid, read_node_uuid, token_from_hostname
from metalguard.agent.sdnotify import watchdog_interval_s


@pytest.mark.parametrize(
    ("hostname", "token"),
    [
        ("gpu-17.dc1.example", "gpu-17"),
        ("node_3", "node_3"),
        ("we ird*>", "we-ird"),
        ("...", "node"),
    ],
)
def test_token_from_hostname(hostname: str, token: str) -> None:
    assert token_from_hostname(hostname) == token


def test_uuid_prefers_dmi_then_machine_id(tmp_path: Path) -> None:
    dmi = tmp_path / "sys/class/dmi/id"
    dmi.mkdir(parents=True)
    machine_id = tmp_path / "machine-id"
    machine_id.write_text("0123456789abcdef0123456789abcdef\n")
    (dmi / "product_uuid").write_text("00000000-0000-0000-0000-000000000000\n")
    assert read_node_uuid(tmp_path / "sys", machine_id) == "0123456789abcdef0123456789abcdef"
    (dmi / "product_uuid").write_text("4C4C4544-0042-3510-8052-B4C04F4E4B32\n")
    assert read_node_uuid(tmp_path / "sys", machine_id) == "4c4c4544-0042-3510-8052-b4c04f4e4b32"
    assert read_node_uuid(tmp_path / "nowhere", tmp_path / "none") == ""
    assert parse_uuid("ffffffff-ffff-ffff-ffff-ffffffffffff") == ""


def test_watchdog_interval_is_half_and_honours_pid() -> None:
    me = str(os.getpid())
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": me}) == 15.0
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "junk"}) is None
    assert watchdog_interval_s({}) is None
