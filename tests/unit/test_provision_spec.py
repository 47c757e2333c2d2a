"""Validating provisioning input (controller/provision/spec.py, the ``[provision]``
config section) and the boot chain the boot server emits (bootserver.py's pure parts)."""

from __future__ import annotations

import dataclasses

import pytest

from metalguard.controller.config import ConfigError, parse_config
from metalguard.controller.provision import spec
from metalguard.controller.provision.bootserver import (
    NO_INSTANCE,
    chain_script,
    instance_script,
    parse_report,
)
from metalguard.controller.provision.manager import ProvisionSettings, public
from metalguard.proto.provision import Instance


def test_a_good_request_is_decoded() -> None:
    req = spec.parse_request(
        {"tenant": "acme", "image": "base", "node": "r1.c1.n01", "user_data": "echo hi"}
    )
    assert (req.tenant, req.image, req.node, req.user_data) == (
        "acme",
        "base",
        "r1.c1.n01",
        "echo hi",
    )
    assert spec.request_problems(req) == []


def test_every_problem_of_a_request_at_once() -> None:
    with pytest.raises(spec.SpecError) as caught:
        spec.parse_request({"tenant": "no spaces", "image": 7, "colour": "red", "node": 1})
    reasons = caught.value.reasons
    assert "colour: unknown key" in reasons
    assert any(r.startswith("tenant:") for r in reasons)
    assert any(r.startswith("image:") for r in reasons)
    assert any(r.startswith("node:") for r in reasons)
    assert len(reasons) == 4


def test_missing_keys_and_non_objects() -> None:
    with pytest.raises(spec.SpecError) as caught:
        spec.parse_request({})
    assert caught.value.reasons == ["tenant: missing (required)", "image: missing (required)"]
    with pytest.raises(spec.SpecError, match="must be an object"):
        spec.parse_request(["tenant"])


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("node", "r1.c1", "not a node handle"),
        ("node", "r1.c1.n*", "not a node handle"),
        ("instance_id", "-bad", "instance_id:"),
        ("volume", "../etc", "volume:"),
        ("user_data", "x" * (spec.MAX_USER_DATA + 1), "at most"),
        ("user_data", "a\x00b", "NUL"),
    ],
)
def test_semantic_problems(field: str, value: str, reason: str) -> None:
    with pytest.raises(spec.SpecError) as caught:
        spec.parse_request({"tenant": "acme", "image": "base", field: value})
    assert any(reason in r for r in caught.value.reasons), caught.value.reasons


def test_a_switch_body() -> None:
    sw = spec.parse_switch({"tenant": "beta", "image": "base", "volume": "beta-keep"})
    assert (sw.tenant, sw.image, sw.volume, sw.user_data) == ("beta", "base", "beta-keep", "")
    with pytest.raises(spec.SpecError) as caught:
        spec.parse_switch({"tenant": "", "node": "x"})
    assert "node: unknown key" in caught.value.reasons
    assert "image: missing (required)" in caught.value.reasons
    assert any(r.startswith("tenant:") for r in caught.value.reasons)


def test_macs() -> None:
    assert spec.normalize_mac("52-54-00-12-34-0A") == "52:54:00:12:34:0a"
    assert spec.mac_path("52:54:00:12:34:01") == "52-54-00-12-34-01"
    with pytest.raises(ValueError, match="not a MAC"):
        spec.normalize_mac("52:54:00:12:34")


def test_the_nodes_table() -> None:
    good = [("r1.c1.n01", "52:54:00:12:34:01"), ("r1.c1.n02", "52:54:00:12:34:02")]
    assert spec.node_problems(good) == []
    bad = [
        ("r1.c1.n01", "52:54:00:12:34:01"),
        ("r1.c1.n01", "52-54-00-12-34-01"),
        ("n03", "zz"),
    ]
    problems = spec.node_problems(bad)
    assert "nodes[1].node: r1.c1.n01 is listed twice" in problems
    assert "nodes[1].mac: 52:54:00:12:34:01 is also r1.c1.n01's" in problems
    assert any(p.startswith("nodes[2].node:") for p in problems)
    assert any(p.startswith("nodes[2].mac:") for p in problems)


CONFIG = """
region = "r1"
[provision]
enabled = true
data_dir = "/srv/provision"
boot_listen = "127.0.0.1:8490"
boot_url = "http://10.0.2.100/"
nbd_listen = "127.0.0.1:10809"
nbd_host = "10.0.2.101"
kernel = "/srv/vmlinuz"
initrd = "/srv/initrd"
kernel_args = "quiet  acpi=off"
deploy_timeout_s = 60
max_failures = 2
[[provision.nodes]]
node = "r1.c1.n01"
mac = "52:54:00:12:34:01"
"""


def test_the_provision_section() -> None:
    section = parse_config(CONFIG).provision
    assert section.enabled
    assert section.base_url == "http://10.0.2.100"
    assert section.nbd_endpoint == ("10.0.2.101", 10809)
    settings = ProvisionSettings.from_section(section)
    assert settings.macs == {"r1.c1.n01": "52:54:00:12:34:01"}
    assert (settings.deploy_timeout_s, settings.max_failures) == (60.0, 2)
    assert (settings.kernel, settings.initrd) == ("/srv/vmlinuz", "/srv/initrd")
    assert settings.kernel_args == "quiet  acpi=off"
    default = parse_config('region = "r1"\n').provision
    assert not default.enabled
    assert default.base_url == "http://127.0.0.1:8490"


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ('boot_listen = "nowhere"', "boot_listen"),
        ('boot_url = "ftp://x"', "boot_url"),
        ("max_failures = -1", "max_failures"),
        ('colour = "red"', "colour"),
    ],
)
def test_a_bad_provision_section_names_the_key(line: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        parse_config(f'region = "r1"\n[provision]\n{line}\n')


def test_the_nodes_table_is_checked_at_load() -> None:
    text = CONFIG + '[[provision.nodes]]\nnode = "r1.c1.n02"\nmac = "52:54:00:12:34:01"\n'
    with pytest.raises(ConfigError, match=r"nodes\[1\]\.mac: .* is also r1\.c1\.n01's"):
        parse_config(text)


# --- the boot chain ----------------------------------------------------------------------

SETTINGS = ProvisionSettings(boot_url="http://10.0.2.100", nbd_host="10.0.2.101", nbd_port=10809)
INST = Instance(
    instance_id="i-1",
    tenant="acme",
    image="base",
    volume="acme-i-1",
    state="deploying",
    node="r1.c1.n01",
    export="0123456789abcdef0123456789abcdef",
)


def test_the_dhcp_bootfile_chains_by_mac() -> None:
    assert chain_script("http://10.0.2.100") == (
        "#!ipxe\nchain http://10.0.2.100/boot/${net0/mac:hexhyp}.ipxe\n"
    )


def test_the_node_script_attaches_the_current_export() -> None:
    token = "i-1/0123456789abcdef0123456789abcdef"
    assert instance_script(INST, SETTINGS) == (
        "#!ipxe\n"
        "kernel http://10.0.2.100/files/vmlinuz console=ttyS0 panic=-1 ip=dhcp "
        "nbdroot=10.0.2.101,10809,0123456789abcdef0123456789abcdef root=/dev/nbd0 rw "
        f"mg.instance=i-1 mg.ready=http://10.0.2.100/ready/{token} "
        f"mg.userdata=http://10.0.2.100/userdata/{token}\n"
        "initrd http://10.0.2.100/files/initrd\n"
        "boot\n"
    )


def test_the_node_script_ends_with_the_configured_kernel_args() -> None:
    settings = dataclasses.replace(SETTINGS, kernel_args=" quiet  rodata=off ")
    kernel_line = instance_script(INST, settings).splitlines()[1]
    assert kernel_line.endswith("/userdata/i-1/0123456789abcdef0123456789abcdef quiet rodata=off")


def test_no_instance_falls_through() -> None:
    assert NO_INSTANCE == "#!ipxe\necho metalguard: no instance for this node\nexit 1\n"


def test_ready_reports() -> None:
    assert parse_report(b"") == {}
    assert parse_report(b'{"boot_id": "b1", "kernel": "6.1"}') == {"boot_id": "b1", "kernel": "6.1"}
    assert parse_report(b'{"output": "' + b"x" * 5000 + b'"}')["output"] == "x" * 4096
    for body, problem in [
        (b"[1]", "JSON object"),
        (b"{nope", "not JSON"),
        (b'{"n": 1}', "values must be strings: n"),
    ]:
        with pytest.raises(ValueError, match=problem):
            parse_report(body)


def test_public_hides_the_secret() -> None:
    assert public(INST).export == ""
    assert public(INST).instance_id == "i-1"
