"""``[[bmc]]`` targets, credentials files, reader dispatch, out-of-band batches."""

from __future__ import annotations

from pathlib import Path

import pytest

from metalguard.agent.bmc import targets as targets_module
from metalguard.agent.bmc.credentials import CredentialsError, load_credentials, parse_credentials
from metalguard.agent.bmc.proxy import BmcProxy, oob_msg_id, reading_batch
from metalguard.agent.bmc.targets import UNAVAILABLE, BmcTarget, read_target, reader_for
from metalguard.agent.config import ConfigError, parse_config
from metalguard.agent.publisher import batch_msg_id
from metalguard.proto.codec import decode, encode
from metalguard.proto.telemetry import BmcReading, BmcSensor, TelemetryBatch

SNMP = """
[[bmc]]
node = "eu1.trainA.gpu017"
address = "10.8.0.17:1161"
protocol = "snmp"
profile = "idrac"
community = "public"
timeout_s = 1.5
retries = 2

[[bmc]]
node = "eu1.trainA.gpu018"
address = "10.8.0.18"
protocol = "redfish"
credentials = "/etc/metalguard/bmc/gpu018.toml"
verify_tls = false

[bmc_proxy]
interval_s = 10
concurrency = 8
"""


def test_config_reads_bmc_targets_and_proxy_section() -> None:
    config = parse_config(SNMP, "agent.toml")
    first, second = config.bmc
    assert first.region_cluster_node() == ("eu1", "trainA", "gpu017")
    assert first.host_port(161) == ("10.8.0.17", 1161)
    assert (first.profile, first.community, first.timeout_s, first.retries) == (
        "idrac",
        "public",
        1.5,
        2,
    )
    assert second.host_port(443) == ("10.8.0.18", 443)
    assert second.verify_tls is False
    assert (config.bmc_proxy.interval_s, config.bmc_proxy.concurrency) == (10.0, 8)


def test_config_without_bmc_has_no_targets() -> None:
    config = parse_config("", "agent.toml")
    assert config.bmc == ()
    assert config.bmc_proxy.concurrency == 32


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ('node = "eu1.gpu1"\naddress = "x"\nprotocol = "snmp"\ncommunity = "p"', "bmc[0]: node:"),
        ('node = "a.b.c"\naddress = "x"\nprotocol = "snmp"', "needs `community`"),
        (
            'node = "a.b.c"\naddress = "x"\nprotocol = "snmp"\ncommunity = "p"\nprofile = "zz"',
            "unknown SNMP profile 'zz'",
        ),
        ('node = "a.b.c"\naddress = "x"\nprotocol = "telnet"', "bmc[0].protocol"),
        ('node = "a.b.c"\naddress = " "\nprotocol = "ipmi"', "address: empty"),
        ('node = "a.b.c"\naddress = "x"\nprotocol = "ipmi"\ntimeout_s = 0', "timeout_s"),
        ('node = "a.b.c"\naddress = "x"\nprotocol = "ipmi"\nport = 1', "port: unknown key"),
    ],
)
def test_bad_targets_name_file_key_and_problem(body: str, problem: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(f"[[bmc]]\n{body}\n", "agent.toml")
    assert str(err.value).startswith("agent.toml: bmc[0]")
    assert problem in str(err.value)


def test_host_port_ipv6_and_bare_host() -> None:
    target = BmcTarget(node="a.b.c", address="[fd00::17]:1161", protocol="snmp", community="p")
    assert target.host_port(161) == ("fd00::17", 1161)
    bare = BmcTarget(node="a.b.c", address="fd00::17", protocol="ipmi")
    assert bare.host_port(623) == ("fd00::17", 623)


def test_credentials_v3_levels() -> None:
    v3 = parse_credentials('user = "mg"\nauth_key = "authpass1"\npriv_key = "privpass1"')
    assert (v3.auth, v3.priv, v3.security_level()) == ("sha", "aes", "authPriv")
    auth_only = parse_credentials('user = "mg"\nauth_protocol = "sha256"\nauth_key = "authpass1"')
    assert (auth_only.auth, auth_only.security_level()) == ("sha256", "authNoPriv")
    assert parse_credentials('user = "mg"').security_level() == "noAuthNoPriv"
    basic = parse_credentials('user = "admin"\npassword = "pw"')
    assert (basic.user, basic.password) == ("admin", "pw")


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('auth_key = "short"', "auth_key: shorter than 8"),
        ('auth_key = "authpass1"\npriv_protocol = "rot13"', "priv_protocol"),
        ('priv_key = "privpass1"', "priv_key: needs auth_key"),
        ('usr = "x"', "usr: unknown key"),
        ("user = ", "not valid TOML"),
    ],
)
def test_bad_credentials_name_file_and_key(text: str, problem: str) -> None:
    with pytest.raises(CredentialsError) as err:
        parse_credentials(text, "gpu017.toml")
    assert str(err.value).startswith("gpu017.toml: ")
    assert problem in str(err.value)


def test_missing_credentials_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(CredentialsError, match=r"missing\.toml: cannot read"):
        load_credentials(tmp_path / "missing.toml")


def test_snmp_reader_is_found() -> None:
    from metalguard.agent.bmc.snmp import read_bmc

    assert reader_for("snmp") is read_bmc
    assert reader_for("telnet") is None


async def test_missing_protocol_module_reads_not_available(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(targets_module.READERS, "ipmi", "metalguard.agent.bmc.no_such_module")
    target = BmcTarget(node="r.c.n", address="10.0.0.1", protocol="ipmi")
    reading = await read_target(target)
    assert reading == BmcReading(
        node="r.c.n", source="ipmi", reachable=False, message="protocol not available"
    )
    assert reading.message == UNAVAILABLE


def _reading() -> BmcReading:
    return BmcReading(
        node="eu1.trainA.gpu017",
        source="snmp",
        reachable=True,
        health="ok",
        sensors=(BmcSensor(name="Fan 1", kind="fan", value=5400.0, unit="rpm", status="ok"),),
    )


def test_reading_batch_is_out_of_band_on_the_targets_node() -> None:
    target = BmcTarget(node="eu1.trainA.gpu017", address="x", protocol="snmp", community="p")
    batch = reading_batch(target, _reading(), seq=7, ts=100.0, started_ts=99.5, interval_s=30)
    assert (batch.node.region, batch.node.cluster, batch.node.node) == ("eu1", "trainA", "gpu017")
    assert batch.out_of_band is True
    assert batch.bmc == (_reading(),)
    assert [batch.edac, batch.pcie, batch.hwmon, batch.smart, batch.gpu] == [()] * 5
    assert decode(encode(batch), TelemetryBatch) == batch
    assert oob_msg_id(batch) == "eu1.trainA.gpu017:oob:7"
    assert oob_msg_id(batch) != batch_msg_id(batch)


async def test_oob_seq_rises_per_node_from_the_start_time() -> None:
    async def publish(batch: TelemetryBatch) -> None:
        raise AssertionError("not published in this test")

    proxy = BmcProxy((), publish, wall_clock=lambda: 1_700_000_000.5)
    assert [proxy.next_seq("a.b.c"), proxy.next_seq("a.b.c"), proxy.next_seq("a.b.d")] == [
        1_700_000_000_501,
        1_700_000_000_502,
        1_700_000_000_501,
    ]
