"""The IPMI collector's subprocess side: a missing tool, a timeout, a failing exit, and
a stand-in ``ipmitool`` script that prints a real captured output (this machine has no
BMC); plus the real ipmitool against a port nobody answers, when it is installed."""

from __future__ import annotations

import shutil
import socket
import time
from pathlib import Path

import pytest

from metalguard.agent.bmc import ipmi
from metalguard.agent.bmc.targets import BmcTarget
from tests.support import FIXTURES

ELIST = FIXTURES / "bmc" / "telegraf_ipmitool_sdr_elist_v2_with_errors.txt"


def fake_tool(tmp_path: Path, body: str, name: str = "ipmitool") -> Path:
    """An executable stand-in that logs its argv and IPMI_PASSWORD, then runs ``body``."""
    script = tmp_path / name
    log = tmp_path / "calls.log"
    script.write_text(
        f'#!/bin/sh\necho "$* | pw=$IPMI_PASSWORD" >> {log}\n'
        f'[ -n "$3" ] && for a in "$@"; do case $a in *.conf) cat "$a" >> {log};; esac; done\n'
        f"{body}\n"
    )
    script.chmod(0o755)
    return script


def target(tmp_path: Path, **kw: object) -> BmcTarget:
    creds = tmp_path / "creds.toml"
    creds.write_text('user = "mg"\npassword = "pa55word"\n')
    fields: dict[str, object] = {
        "node": "eu1.a.n1",
        "address": "192.0.2.7:6230",
        "protocol": "ipmi",
        "credentials": str(creds),
        "timeout_s": 1.0,
        "retries": 0,
    }
    fields.update(kw)
    return BmcTarget(**fields)  # type: ignore[arg-type]


async def test_reads_sensors_and_power_counts_noise_password_not_in_argv(tmp_path: Path) -> None:
    body = f"""case "$*" in
  *"sdr elist"*) cat {ELIST} ;;
  *"chassis power status"*) echo "Chassis Power is off" ;;
  *) echo "unexpected: $*" >&2; exit 1 ;;
esac"""
    tool = fake_tool(tmp_path, body)
    reading = await ipmi.read_bmc(target(tmp_path), tool=str(tool))
    assert reading.reachable, reading.message
    assert reading.source == "ipmi"
    assert reading.node == "eu1.a.n1"
    assert reading.power_state == "off"
    assert len(reading.sensors) == 7
    assert "skipped 2 unparsable line(s)" in reading.message
    assert reading.health == "ok"
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert calls[0].startswith("-I lanplus -H 192.0.2.7 -p 6230 ")
    assert "-U mg -E sdr elist | pw=pa55word" in calls[0]
    assert all("pa55word" not in c.split(" | ")[0] for c in calls)  # never on the argv
    assert calls[1].endswith("chassis power status | pw=pa55word")


async def test_freeipmi_profile_reads_csv_with_credentials_in_a_file(tmp_path: Path) -> None:
    body = """cat <<'EOF'
ID,Name,Type,Reading,Units,Lower NR,Lower C,Lower NC,Upper NC,Upper C,Upper NR,Event
4,CPU Temp,Temperature,44.00,C,N/A,N/A,N/A,85.00,90.00,95.00,'OK'
EOF"""
    tool = fake_tool(tmp_path, body, "ipmi-sensors")
    reading = await ipmi.read_bmc(target(tmp_path, profile="freeipmi"), tool=str(tool))
    assert reading.reachable, reading.message
    assert [(s.name, s.value, s.upper_critical) for s in reading.sensors] == [
        ("CPU Temp", 44.0, 90.0)
    ]
    log = (tmp_path / "calls.log").read_text()
    assert "-h 192.0.2.7:6230" in log
    assert "--comma-separated-output" in log
    assert "username mg" in log
    assert "password pa55word" in log  # from the 0600 config file ...
    assert "-p pa55word" not in log  # ... never the argv


async def test_missing_tool_is_an_unreachable_reading(tmp_path: Path) -> None:
    reading = await ipmi.read_bmc(target(tmp_path), tool=str(tmp_path / "no-ipmitool"))
    assert not reading.reachable
    assert "not found" in reading.message


async def test_failing_exit_and_timeout(tmp_path: Path) -> None:
    failing = fake_tool(
        tmp_path, 'echo "Error: Unable to establish IPMI v2 / RMCP+ session" >&2; exit 1'
    )
    reading = await ipmi.read_bmc(target(tmp_path), tool=str(failing))
    assert not reading.reachable
    assert reading.message.endswith("exited 1: Error: Unable to establish IPMI v2 / RMCP+ session")

    hanging = fake_tool(tmp_path, "exec sleep 30", "slow-ipmitool")
    started = time.monotonic()
    result = await ipmi.run_tool([str(hanging)], 0.5)
    assert not result.ok
    assert "timed out after 0.5s" in result.message
    assert time.monotonic() - started < 5


async def test_bad_credentials_file_is_a_reading(tmp_path: Path) -> None:
    t = target(tmp_path)
    (tmp_path / "creds.toml").write_text("user = 3\n")  # not a string
    reading = await ipmi.read_bmc(t, tool="true")
    assert not reading.reachable
    assert "creds.toml" in reading.message
    assert "user" in reading.message


@pytest.mark.skipif(shutil.which("ipmitool") is None, reason="ipmitool not installed")
async def test_real_ipmitool_against_a_silent_port(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # bound, never answers
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        t = target(tmp_path, address=f"127.0.0.1:{port}", timeout_s=1.0, retries=0)
        started = time.monotonic()
        reading = await ipmi.read_bmc(t)
    assert not reading.reachable
    assert reading.message.startswith("ipmitool ")
    assert time.monotonic() - started <= t.timeout_s * (t.retries + 1) + 1.5
