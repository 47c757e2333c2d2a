"""The Redfish collector against the mockup emulator over HTTPS on loopback."""

from __future__ import annotations

import socket
import time
from pathlib import Path

from metalguard.agent.bmc import redfish
from metalguard.proto.telemetry import BmcReading, BmcSensor
from tests.support.harness.bmc_client import credentials, target
from tests.support.harness.redfish_emulator import (
    USER,
    Certificate,
    RedfishEmulator,
    RunningEmulator,
    start_emulator,
)


def by_name(reading: BmcReading) -> dict[str, BmcSensor]:
    return {s.name: s for s in reading.sensors}


async def test_reads_power_fans_temperatures_psus_with_session(
    bmc: RunningEmulator, tmp_path: Path
) -> None:
    t = target(bmc.address, credentials(tmp_path))
    reading = await redfish.read_bmc(t, cafile=str(bmc.certificate.cert))

    assert reading.reachable, reading.message
    assert reading.source == "redfish"
    assert reading.node == "eu1.trainA.gpu017"
    assert reading.power_state == "on"
    assert reading.health == "critical"  # system OK, but fan bay 2 is critical
    sensors = by_name(reading)
    assert sensors["Fan Bay 1"] == BmcSensor(
        name="Fan Bay 1", kind="fan", value=2200.0, unit="rpm", status="ok"
    )
    assert sensors["Fan Bay 2"].status == "critical"
    assert sensors["Fan Bay 2"].value == 0.0
    intake = sensors["Front Panel Intake Temperature"]
    assert (intake.kind, intake.value, intake.unit) == ("temperature", 24.8, "C")
    assert (intake.lower_critical, intake.upper_critical) == (5.0, 40.0)
    assert sensors["Rear Exhaust Temperature"].upper_critical == 45.0
    psu1 = sensors["Power Supply Bay 1"]
    assert (psu1.kind, psu1.value, psu1.unit, psu1.status) == ("psu", 325.0, "W", "warning")
    assert sensors["Power Supply Bay 2"].status == "absent"
    # session auth: logged in once, logged out at the end
    assert bmc.emulator.auth_seen == {"session"}
    assert bmc.emulator.sessions_created == 1
    assert bmc.emulator.sessions_deleted == 1
    assert bmc.emulator.sessions == {}


async def test_legacy_thermal_and_power_with_basic_auth(
    certificate: Certificate, tmp_path: Path
) -> None:
    emulator = RedfishEmulator(legacy_only=True)
    runner, address = await start_emulator(emulator, certificate)
    try:
        t = target(address, credentials(tmp_path), profile="basic")
        reading = await redfish.read_bmc(t, cafile=str(certificate.cert))
    finally:
        await runner.cleanup()

    assert reading.reachable, reading.message
    assert emulator.auth_seen == {"basic"}
    assert emulator.sessions_created == 0
    sensors = by_name(reading)
    cpu1 = sensors["CPU1 Temp"]
    assert (cpu1.value, cpu1.unit, cpu1.upper_critical, cpu1.status) == (41.0, "C", 45.0, "ok")
    assert sensors["CPU2 Temp"].value is None  # disabled sensor, no reading
    intake = sensors["Chassis Intake Temp"]
    assert (intake.lower_critical, intake.upper_critical) == (5.0, 40.0)
    fan = sensors["BaseBoard System Fan"]
    assert (fan.kind, fan.value, fan.unit) == ("fan", 2100.0, "rpm")
    assert sensors["BaseBoard System Fan Backup"].value == 2050.0
    assert sensors["VRM1 Voltage"].lower_critical == 11.0
    assert sensors["Power Supply Bay"].kind == "psu"
    assert reading.health == "warning"  # the PSU's warning


async def test_wrong_password_is_a_clear_401(bmc: RunningEmulator, tmp_path: Path) -> None:
    for profile in ("", "basic", "session"):
        t = target(bmc.address, credentials(tmp_path, password="wrong"), profile=profile)
        reading = await redfish.read_bmc(t, cafile=str(bmc.certificate.cert))
        assert not reading.reachable
        assert "401" in reading.message, reading.message
        assert "authentication failed" in reading.message
        assert USER in reading.message or "GET" in reading.message


async def test_tls_verification_is_on_by_default(bmc: RunningEmulator, tmp_path: Path) -> None:
    creds = credentials(tmp_path)
    refused = await redfish.read_bmc(target(bmc.address, creds))  # self-signed, not trusted
    assert not refused.reachable
    assert "certificate" in refused.message.lower(), refused.message
    assert bmc.emulator.sessions_created == 0

    relaxed = await redfish.read_bmc(target(bmc.address, creds, verify_tls=False))
    assert relaxed.reachable, relaxed.message
    assert relaxed.power_state == "on"


async def test_unreachable_bmc_is_a_reading_within_its_timeout(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t = target(f"127.0.0.1:{port}", credentials(tmp_path), timeout_s=1.0, retries=1)
    started = time.monotonic()
    reading = await redfish.read_bmc(t)
    assert not reading.reachable
    assert reading.message
    assert time.monotonic() - started < 1.0 * 2 * 4

    missing = await redfish.read_bmc(target("127.0.0.1:1", str(tmp_path / "nope.toml")))
    assert not missing.reachable
    assert missing.node == "eu1.trainA.gpu017"
    assert "nope.toml" in missing.message


async def test_through_the_shared_reader_registry(bmc: RunningEmulator, tmp_path: Path) -> None:
    """What the bmc-proxy and `agent collect` call: targets.read_target -> redfish.read_bmc."""
    from metalguard.agent.bmc.targets import read_target

    t = target(bmc.address, credentials(tmp_path), verify_tls=False)
    reading = await read_target(t)
    assert reading.reachable, reading.message
    assert (reading.source, reading.node, reading.power_state) == ("redfish", t.node, "on")
    assert any(s.kind == "fan" for s in reading.sensors)


async def test_plain_http_url_from_the_config_file(tmp_path: Path) -> None:
    """``address = "http://127.0.0.1:PORT"`` (how sushy-tools prints itself) in agent.toml
    reads the emulator over plain HTTP; the same emulator behind ``https://`` is refused
    by the TLS handshake, not misread as a host name."""
    from metalguard.agent.config import parse_config

    emulator = RedfishEmulator()
    runner, address = await start_emulator(emulator, None)
    try:
        creds = credentials(tmp_path)
        text = (
            f'[[bmc]]\nnode = "eu1.trainA.gpu017"\naddress = "http://{address}"\n'
            f'protocol = "redfish"\ncredentials = "{creds}"\ntimeout_s = 2.0\nretries = 0\n'
        )
        (t,) = parse_config(text, "agent.toml").bmc
        assert redfish.base_url(t) == f"http://{address}"
        reading = await redfish.read_bmc(t)
        assert reading.reachable, reading.message
        assert (reading.power_state, reading.health) == ("on", "critical")
        assert by_name(reading)["Fan Bay 1"].value == 2200.0
        assert emulator.auth_seen == {"session"}

        tls = target(f"https://{address}", creds, verify_tls=False)
        refused = await redfish.read_bmc(tls)
        assert not refused.reachable
        assert "InvalidUrl" not in refused.message
    finally:
        await runner.cleanup()
