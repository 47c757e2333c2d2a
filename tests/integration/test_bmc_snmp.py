"""The SNMP collector against a real SNMP agent on loopback (pysnmp's command responder
serving the recorded .snmprec datasets in tests/fixtures/snmp), v2c and v3 authPriv."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from metalguard.agent.bmc.credentials import parse_credentials
from metalguard.agent.bmc.snmp import SnmpReader, read_bmc
from metalguard.agent.bmc.snmp_responder import (
    SnmprecError,
    SnmpResponder,
    load_snmprec,
    parse_snmprec,
)
from metalguard.agent.bmc.targets import BmcTarget
from metalguard.proto.telemetry import BmcSensor

FIXTURES = Path(__file__).parents[1] / "fixtures" / "snmp"
ENTITY = FIXTURES / "entity-sensor-bmc.snmprec"
IDRAC = FIXTURES / "idrac-bmc.snmprec"
V3_SECRETS = """
user = "mgmon"
auth_protocol = "sha256"
auth_key = "auth-pass-phrase"
priv_protocol = "aes"
priv_key = "priv-pass-phrase"
"""

EXPECTED = {
    "Fan 1": BmcSensor(name="Fan 1", kind="fan", value=5400.0, unit="rpm", status="ok"),
    "Fan 2": BmcSensor(name="Fan 2", kind="fan", value=5300.0, unit="rpm", status="ok"),
    "Fan 3": BmcSensor(name="Fan 3", kind="fan", value=0.0, unit="rpm", status="critical"),
    "CPU1 Temp": BmcSensor(
        name="CPU1 Temp", kind="temperature", value=45.2, unit="C", status="ok"
    ),  # precision 1
    "Inlet Temp": BmcSensor(
        name="Inlet Temp", kind="temperature", value=23.5, unit="C", status="ok"
    ),  # scale milli
    "P12V": BmcSensor(name="P12V", kind="voltage", value=12.15, unit="V", status="ok"),
    "PSU1 Input Power": BmcSensor(
        name="PSU1 Input Power", kind="power", value=1250.0, unit="W", status="ok"
    ),  # scale kilo, precision 2
    "PSU2 Status": BmcSensor(name="PSU2 Status", kind="psu", value=1.0, unit="", status="absent"),
}


@pytest.fixture
async def responder(tmp_path: Path) -> AsyncIterator[SnmpResponder]:
    sim = SnmpResponder()
    sim.add_community("public", load_snmprec(ENTITY))
    sim.add_community("dell", load_snmprec(IDRAC))
    sim.add_user(parse_credentials(V3_SECRETS), load_snmprec(ENTITY))
    try:
        yield sim
    finally:
        sim.close()


def _v3_target(tmp_path: Path, address: str, secrets: str = V3_SECRETS) -> BmcTarget:
    path = tmp_path / "gpu017-snmpv3.toml"
    path.write_text(secrets)
    return BmcTarget(
        node="eu1.trainA.gpu017",
        address=address,
        protocol="snmp",
        credentials=str(path),
        timeout_s=0.5,
        retries=0,
    )


def _check_entity_reading(sensors: tuple[BmcSensor, ...]) -> None:
    by_name = {s.name: s for s in sensors}
    assert set(by_name) == set(EXPECTED)
    for name, expected in EXPECTED.items():
        got = by_name[name]
        assert got.value == pytest.approx(expected.value), name
        assert (got.kind, got.unit, got.status) == (expected.kind, expected.unit, expected.status)


async def test_v2c_reads_every_sensor_with_value_and_scale(responder: SnmpResponder) -> None:
    target = BmcTarget(
        node="eu1.trainA.gpu017", address=responder.address, protocol="snmp", community="public"
    )
    reading = await read_bmc(target)
    assert reading.reachable, reading.message
    assert (reading.node, reading.source, reading.health) == (
        "eu1.trainA.gpu017",
        "snmp",
        "critical",
    )
    _check_entity_reading(reading.sensors)


async def test_v3_auth_priv_reads_the_same_sensors(
    responder: SnmpResponder, tmp_path: Path
) -> None:
    reading = await read_bmc(_v3_target(tmp_path, responder.address))
    assert reading.reachable, reading.message
    _check_entity_reading(reading.sensors)


async def test_v3_wrong_priv_key_is_unreachable_with_the_reason(
    responder: SnmpResponder, tmp_path: Path
) -> None:
    wrong = V3_SECRETS.replace("priv-pass-phrase", "not-the-phrase")
    reading = await read_bmc(_v3_target(tmp_path, responder.address, wrong))
    assert not reading.reachable
    assert reading.sensors == ()
    assert "wrong priv_key or priv_protocol?" in reading.message


async def test_v3_wrong_auth_key_is_a_wrong_digest(
    responder: SnmpResponder, tmp_path: Path
) -> None:
    wrong = V3_SECRETS.replace("auth-pass-phrase", "not-the-phrase")
    reading = await read_bmc(_v3_target(tmp_path, responder.address, wrong))
    assert not reading.reachable
    assert "wrong auth_key or auth_protocol?" in reading.message


async def test_vendor_profile_idrac(responder: SnmpResponder) -> None:
    target = BmcTarget(
        node="eu1.trainA.gpu017",
        address=responder.address,
        protocol="snmp",
        community="dell",
        profile="idrac",
    )
    reading = await read_bmc(target)
    assert reading.reachable, reading.message
    assert (reading.power_state, reading.health) == ("on", "warning")
    by_name = {s.name: s for s in reading.sensors}
    fan2 = by_name["System Board Fan2"]
    assert (fan2.value, fan2.status, fan2.lower_critical, fan2.upper_critical) == (
        720.0,
        "warning",
        600.0,
        17040.0,
    )
    inlet = by_name["System Board Inlet Temp"]
    assert (inlet.value, inlet.lower_critical, inlet.upper_critical) == (24.5, -7.0, 47.0)
    assert by_name["System Board 12V"].value == pytest.approx(12.096)
    assert by_name["PS2 Status"].status == "critical"


def _silent_udp_port() -> tuple[socket.socket, int]:
    """A bound UDP socket that never answers: the address of a dead BMC."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    return sock, sock.getsockname()[1]


async def test_unreachable_address_is_a_reading_within_its_timeout() -> None:
    sock, port = _silent_udp_port()
    target = BmcTarget(
        node="eu1.trainA.gpu099",
        address=f"127.0.0.1:{port}",
        protocol="snmp",
        community="public",
        timeout_s=0.4,
        retries=1,
    )
    reader = SnmpReader()  # engine start-up outside the timed part
    try:
        started = time.monotonic()
        reading = await reader(target)
        elapsed = time.monotonic() - started
    finally:
        reader.close()
        sock.close()
    assert not reading.reachable
    assert reading.node == "eu1.trainA.gpu099"
    assert "no answer within 0.4 s x 2 tries" in reading.message
    budget = target.timeout_s * (target.retries + 1)
    print(f"unreachable after {elapsed:.2f}s (timeout x tries = {budget:.2f}s)")
    assert elapsed < budget + 1.0


async def test_wrong_community_is_unreachable(responder: SnmpResponder) -> None:
    target = BmcTarget(
        node="eu1.trainA.gpu017",
        address=responder.address,
        protocol="snmp",
        community="not-it",
        timeout_s=0.3,
        retries=0,
    )
    reading = await read_bmc(target)
    assert not reading.reachable
    assert "no answer" in reading.message


async def test_missing_credentials_file_is_a_reading(tmp_path: Path) -> None:
    target = BmcTarget(
        node="a.b.c", address="127.0.0.1:1", protocol="snmp", credentials=str(tmp_path / "nope")
    )
    reading = await read_bmc(target)
    assert not reading.reachable
    assert "cannot read" in reading.message


async def test_unresolvable_host_is_a_reading() -> None:
    target = BmcTarget(
        node="a.b.c", address="bmc.invalid:161", protocol="snmp", community="p", timeout_s=0.5
    )
    reading = await read_bmc(target)
    assert not reading.reachable
    assert reading.message


def test_snmprec_parsing_types_and_errors() -> None:
    records = dict(parse_snmprec("# c\n1.3.6.1.2|4x|414243\n1.3.6.1.1|2|-5\n1.3.6.1.3|66|7\n\n"))
    assert [str(v) for v in records.values()] == ["-5", "ABC", "7"]
    with pytest.raises(SnmprecError, match=r"x.snmprec:1: cannot serve"):
        parse_snmprec("1.3.6.1|99|1", "x.snmprec")


async def test_same_v3_user_with_other_keys_on_two_bmcs_through_one_reader(
    tmp_path: Path,
) -> None:
    """pysnmp keeps one USM entry per user name in an engine: the reader must not let
    one BMC's keys replace the other's."""
    other = V3_SECRETS.replace("auth-pass-phrase", "other-auth-pp").replace(
        "priv-pass-phrase", "other-priv-pp"
    )
    first, second = SnmpResponder(), SnmpResponder()
    first.add_user(parse_credentials(V3_SECRETS), load_snmprec(ENTITY))
    second.add_user(parse_credentials(other), load_snmprec(ENTITY))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    targets = [
        _v3_target(tmp_path / "a", first.address),
        _v3_target(tmp_path / "b", second.address, other),
    ]
    reader = SnmpReader()
    try:
        for _ in range(2):
            readings = await asyncio.gather(*(reader(t) for t in targets))
            assert [(r.reachable, r.message) for r in readings] == [(True, ""), (True, "")]
    finally:
        reader.close()
        first.close()
        second.close()
