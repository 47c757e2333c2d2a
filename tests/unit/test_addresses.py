"""metalguard.proto.addresses: every form each parser accepts, every refusal with its
message, and the config loaders naming file, key and problem for a bad address."""

from __future__ import annotations

import pytest

from metalguard.agent.config import ConfigError as AgentConfigError
from metalguard.agent.config import parse_config as parse_agent_config
from metalguard.controller.config import ConfigError as ControllerConfigError
from metalguard.controller.config import parse_config as parse_controller_config
from metalguard.controller.slurm.config import parse_bridge_config
from metalguard.proto.addresses import (
    AddressError,
    Endpoint,
    HostPort,
    check_nats_servers,
    parse_bmc_address,
    parse_host,
    parse_host_port,
    parse_listen,
    parse_nats_server,
)

# --- hosts ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "host"),
    [
        ("bmc-17.lab.example", "bmc-17.lab.example"),
        ("localhost", "localhost"),
        ("node.", "node."),
        ("10.0.0.5", "10.0.0.5"),
        ("fd00::5", "fd00::5"),
        ("[fd00::5]", "fd00::5"),
        ("[::1]", "::1"),
        ("1host", "1host"),
    ],
)
def test_hosts_accepted(text: str, host: str) -> None:
    assert parse_host(text) == host


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", "no host"),
        ("-bad.example", "not a valid host name"),
        ("under_score", "not a valid host name"),
        ("a..b", "not a valid host name"),
        ("999.1.1.1", "not an IPv4 address"),
        ("1.2.3", "not an IPv4 address"),
        ("[10.0.0.1]", "brackets hold an IPv6 address only"),
        ("[::1", "unbalanced brackets"),
        ("fd00:::5:x", "not an IPv6 address"),
        ("x" * 64, "not a valid host name"),
    ],
)
def test_hosts_refused(text: str, problem: str) -> None:
    with pytest.raises(AddressError) as err:
        parse_host(text)
    assert problem in str(err.value)
    assert str(err.value).startswith(repr(text))


# --- host:port --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("h", HostPort("h")),
        ("h:1", HostPort("h", 1)),
        ("10.0.0.1:65535", HostPort("10.0.0.1", 65535)),
        ("[fd00::17]:1161", HostPort("fd00::17", 1161)),
        ("[fd00::17]", HostPort("fd00::17")),
        ("fd00::17", HostPort("fd00::17")),
    ],
)
def test_host_port_accepted(text: str, parsed: HostPort) -> None:
    assert parse_host_port(text) == parsed


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", "empty"),
        ("  ", "empty"),
        (" h:1", "surrounding spaces"),
        ("h:", "port '' is not a number from 1 to 65535"),
        ("h:0", "port '0' is not a number from 1 to 65535"),
        ("h:65536", "port '65536'"),
        ("h:http", "port 'http'"),
        ("h:-1", "port '-1'"),
        ("h:\uff11\uff12", "port '\uff11\uff12'"),  # fullwidth digits
        ("h/x", "not a bare host[:port]"),
        ("u@h", "not a bare host[:port]"),
        ("[fd00::17", "unclosed '['"),
        ("[fd00::17]x", "unexpected 'x' after ']'"),
        (":80", "no host"),
    ],
)
def test_host_port_refused(text: str, problem: str) -> None:
    with pytest.raises(AddressError, match="expected host or host:port") as err:
        parse_host_port(text)
    assert problem in str(err.value)


def test_netloc_brackets_ipv6() -> None:
    assert HostPort("fd00::5", 8443).netloc == "[fd00::5]:8443"
    assert HostPort("h").netloc == "h"
    assert Endpoint("https", "::1", 8443).url == "https://[::1]:8443"


# --- BMC targets ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "protocol", "endpoint"),
    [
        ("10.0.0.5", "redfish", Endpoint("https", "10.0.0.5", 443)),
        ("10.0.0.5:8443", "redfish", Endpoint("https", "10.0.0.5", 8443)),
        ("https://bmc.lab", "redfish", Endpoint("https", "bmc.lab", 443)),
        ("HTTPS://bmc.lab:8443/", "redfish", Endpoint("https", "bmc.lab", 8443)),
        ("http://127.0.0.1:8011", "redfish", Endpoint("http", "127.0.0.1", 8011)),
        ("http://127.0.0.1", "redfish", Endpoint("http", "127.0.0.1", 80)),
        ("http://[::1]:8000", "redfish", Endpoint("http", "::1", 8000)),
        ("[::1]:8443", "redfish", Endpoint("https", "::1", 8443)),
        ("fd00::5", "redfish", Endpoint("https", "fd00::5", 443)),
        ("10.8.0.17:1161", "snmp", Endpoint("", "10.8.0.17", 1161)),
        ("10.8.0.17", "snmp", Endpoint("", "10.8.0.17", 443)),
        ("[fd00::17]:623", "ipmi", Endpoint("", "fd00::17", 623)),
    ],
)
def test_bmc_addresses_accepted(text: str, protocol: str, endpoint: Endpoint) -> None:
    assert parse_bmc_address(text, protocol, 443) == endpoint


@pytest.mark.parametrize(
    ("text", "protocol", "problem"),
    [
        ("ftp://h", "redfish", "scheme 'ftp' is not http or https"),
        ("://h", "redfish", "scheme '' is not http or https"),
        ("http://", "redfish", "empty"),
        ("http://h:x", "redfish", "port 'x'"),
        ("https://h/redfish/v1", "redfish", "a path or query is not accepted"),
        ("https://h?x=1", "redfish", "a path or query is not accepted"),
        ("https://admin:pw@h", "redfish", "credentials go in the `credentials` file"),
        ("http://http://h", "redfish", "a path or query is not accepted"),
        ("https://[::1", "redfish", "unclosed '['"),
        ("http://127.0.0.1:8011", "snmp", "a URL is for redfish targets, not snmp"),
        ("https://h", "ipmi", "a URL is for redfish targets, not ipmi"),
        ("h:99999", "snmp", "port '99999'"),
    ],
)
def test_bmc_addresses_refused(text: str, protocol: str, problem: str) -> None:
    with pytest.raises(AddressError) as err:
        parse_bmc_address(text, protocol, 443)
    assert problem in str(err.value)
    forms = "http://host[:port]" if protocol == "redfish" else "(expected host or host:port)"
    assert forms in str(err.value)


def test_bmc_url_refused_at_load_with_file_key_and_problem() -> None:
    text = (
        '[[bmc]]\nnode = "a.b.c"\naddress = "https://[http://127.0.0.1]:8011"\n'
        'protocol = "redfish"\n'
    )
    with pytest.raises(AgentConfigError) as err:
        parse_agent_config(text, "agent.toml")
    assert str(err.value).startswith(
        "agent.toml: bmc[0]: address: 'https://[http://127.0.0.1]:8011'"
    )


def test_bmc_http_url_accepted_at_load() -> None:
    text = '[[bmc]]\nnode = "a.b.c"\naddress = "http://127.0.0.1:8011"\nprotocol = "redfish"\n'
    (target,) = parse_agent_config(text, "agent.toml").bmc
    assert target.endpoint(443) == Endpoint("http", "127.0.0.1", 8011)


# --- listen addresses ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("127.0.0.1:8480", HostPort("127.0.0.1", 8480)),
        ("0.0.0.0:0", HostPort("0.0.0.0", 0)),
        ("[::]:8480", HostPort("::", 8480)),
        ("api.lab:443", HostPort("api.lab", 443)),
    ],
)
def test_listen_accepted(text: str, parsed: HostPort) -> None:
    assert parse_listen(text) == parsed


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("8480", "a port without a host"),
        ("host", "no port"),
        (":8480", "no host"),
        ("::1:8480", "an IPv6 address with a port goes in brackets"),
        ("http://h:80", "not a bare host[:port]"),
        ("h:70000", "port '70000' is not a number from 0 to 65535"),
    ],
)
def test_listen_refused(text: str, problem: str) -> None:
    with pytest.raises(AddressError, match=r"expected host:port") as err:
        parse_listen(text)
    assert problem in str(err.value)


def test_listen_refused_at_load() -> None:
    with pytest.raises(ControllerConfigError) as err:
        parse_controller_config('region = "r1"\n[http]\nlisten = "::1:80"\n', "controller.toml")
    assert str(err.value).startswith("controller.toml: http: listen: '::1:80': ")


# --- NATS servers ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "endpoint"),
    [
        ("nats://127.0.0.1:4222", Endpoint("nats", "127.0.0.1", 4222)),
        ("nats://n1", Endpoint("nats", "n1", 4222)),
        ("n1:4333", Endpoint("nats", "n1", 4333)),
        ("n1", Endpoint("nats", "n1", 4222)),
        ("tls://n1.example:4443", Endpoint("tls", "n1.example", 4443)),
        ("nats://user:secret@n1:4222", Endpoint("nats", "n1", 4222)),
        ("nats://[::1]:4222", Endpoint("nats", "::1", 4222)),
        ("ws://n1:8080/nats", Endpoint("ws", "n1", 8080)),
        ("wss://n1", Endpoint("wss", "n1", 443)),
    ],
)
def test_nats_servers_accepted(text: str, endpoint: Endpoint) -> None:
    assert parse_nats_server(text) == endpoint


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("http://n1:4222", "scheme 'http' is not one of nats, tls, ws, wss"),
        ("://n1", "no scheme before '://'"),
        ("nats://", "empty"),
        ("nats://n1:port", "port 'port'"),
        ("nats://@n1", "empty user before '@'"),
        ("nats://n1/path", "not a bare host[:port]"),
        ("nats://n 1", "not a bare host[:port]"),
    ],
)
def test_nats_servers_refused(text: str, problem: str) -> None:
    with pytest.raises(AddressError, match="nats://, tls://, ws://, wss://") as err:
        parse_nats_server(text)
    assert problem in str(err.value)


def test_nats_server_lists() -> None:
    assert len(check_nats_servers(["n1", "tls://n2:4443"])) == 2
    with pytest.raises(AddressError, match="empty"):
        check_nats_servers([])
    with pytest.raises(AddressError, match=r"^\[1\]: 'x:y'"):
        check_nats_servers(["n1", "x:y"])
    with pytest.raises(AddressError, match="cannot be mixed"):
        check_nats_servers(["nats://n1", "ws://n2"])


@pytest.mark.parametrize(
    ("load", "text", "start"),
    [
        (parse_agent_config, '[nats]\nservers = ["http://n1"]\n', "agent.toml: nats: servers[0]:"),
        (
            parse_controller_config,
            'region = "r1"\n[nats]\nservers = []\n',
            "agent.toml: nats: servers: empty",
        ),
        (
            parse_bridge_config,
            'region = "r1"\ncluster = "c1"\n[nats]\nservers = ["n1:0"]\n',
            "agent.toml: nats: servers[0]: 'n1:0': port '0'",
        ),
    ],
)
def test_nats_servers_refused_at_load(load: object, text: str, start: str) -> None:
    with pytest.raises(ValueError, match="servers") as err:
        load(text, "agent.toml")  # type: ignore[operator]
    assert str(err.value).startswith(start)


def test_agent_metrics_listen_checked_at_load() -> None:
    assert parse_agent_config('[metrics]\nlisten = "127.0.0.1:9464"\n').metrics.listen
    with pytest.raises(AgentConfigError) as err:
        parse_agent_config('[metrics]\nlisten = "127.0.0.1:99999"\n', "agent.toml")
    assert str(err.value).startswith("agent.toml: metrics: listen: '127.0.0.1:99999': port")
