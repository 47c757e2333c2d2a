"""QosProfile decoding and semantic validation: every problem is named with its key."""

from __future__ import annotations

import json

import pytest

from metalguard.proto import codec
from metalguard.proto.qos import (
    Dcqcn,
    EcnMarking,
    InterfaceMatch,
    ProfileError,
    QosProfile,
    TrafficClass,
    decode_profile,
    profile_problems,
)

GOOD = """
version = 3
trust = "dscp"
pfc_priorities = [3]
link_rate_mbit = 1000
dscp_map = { 26 = 3, 46 = 5 }
interfaces = { names = ["eth0"] }

[[traffic_class]]
name = "default"
priorities = [0, 1, 2]
bandwidth_percent = 30

[[traffic_class]]
name = "training"
priorities = [3]
bandwidth_percent = 60
ecn = { min_kb = 150, max_kb = 1500, probability = 0.1 }

[[traffic_class]]
name = "control"
priorities = [5]
bandwidth_percent = 10
strict = true

[dcqcn]
np = { min_time_between_cnps = 4 }
rp = { rpg_time_reset = 300 }
"""


def reasons(text: str | bytes, fmt: str = "toml") -> list[str]:
    with pytest.raises(ProfileError) as info:
        decode_profile(text, fmt)  # type: ignore[arg-type]
    assert info.value.reasons, "a ProfileError always carries reasons"
    assert str(info.value) == "; ".join(info.value.reasons)
    return info.value.reasons


def test_good_profile_decodes_from_toml_and_json() -> None:
    profile = decode_profile(GOOD, "toml")
    assert profile.version == 3
    assert profile.dscp_map == {26: 3, 46: 5}
    assert [tc.name for tc in profile.traffic_class] == ["default", "training", "control"]
    assert profile.traffic_class[1].ecn == EcnMarking(min_kb=150, max_kb=1500, probability=0.1)
    assert profile.dcqcn == Dcqcn(np={"min_time_between_cnps": 4}, rp={"rpg_time_reset": 300})
    assert profile_problems(profile) == []
    as_json = codec.encode_json(profile)
    assert decode_profile(as_json, "json") == profile
    assert decode_profile(as_json.decode(), "json") == profile
    # The wire codec round-trips it too (what the KV bucket holds).
    assert codec.decode(codec.encode(profile), QosProfile) == profile


def test_minimal_profile_is_valid() -> None:
    assert decode_profile("version = 0", "toml") == QosProfile(version=0)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("version = 1\nbogus = 1", "bogus: unknown key"),
        ("trust = 'dscp'", "version: missing (required)"),
        ("version = -1", "version: Expected `int` >= 0"),
        ("version = 'one'", "version: Expected `int`, got `str`"),
        ("version = 1\ntrust = 'vlan'", "trust: Invalid enum value 'vlan'"),
        ("version = 1\npfc_priorities = [3, 8]", "pfc_priorities[1]: Expected `int` <= 7"),
        ("version = 1\ndscp_map = { 64 = 1 }", "dscp_map[64]: key: Expected `int` <= 63"),
        ("version = 1\ndscp_map = { x = 1 }", "dscp_map[x]: key: Expected `int`, got `str`"),
        ("version = 1\ndscp_map = { 26 = 8 }", "dscp_map[26]: Expected `int` <= 7"),
        ("version = 1\nlink_rate_mbit = 0", "link_rate_mbit: Expected `int` >= 1"),
        ("version = 1\ninterfaces = { nmes = ['a'] }", "interfaces.nmes: unknown key"),
        (
            "version = 1\n[[traffic_class]]\nname = 'a'\npriorities = [0]\nbandwidth_percent = 101",
            "traffic_class[0].bandwidth_percent: Expected `float` <= 100.0",
        ),
        (
            "version = 1\n[[traffic_class]]\nname = 'a'\npriorities = [0]",
            "traffic_class[0].bandwidth_percent: missing (required)",
        ),
        (
            "version = 1\n[[traffic_class]]\nname = 'a'\npriorities = [0]\n"
            "bandwidth_percent = 100\nweight = 1",
            "traffic_class[0].weight: unknown key",
        ),
        (
            "version = 1\n[[traffic_class]]\nname = 'a'\npriorities = [0]\n"
            "bandwidth_percent = 100\necn = { min_kb = 1, max_kb = 2, probability = 2 }",
            "traffic_class[0].ecn.probability: Expected `float` <= 1.0",
        ),
        (
            "version = 1\n[[traffic_class]]\nname = 'a'\npriorities = [0]\n"
            "bandwidth_percent = 100\necn = { min_kb = 0, max_kb = 2 }",
            "traffic_class[0].ecn.min_kb: Expected `int` >= 1",
        ),
        ("version = 1\n[dcqcn]\nnp = { x = -1 }", "dcqcn.np[x]: Expected `int` >= 0"),
        ("version = 1\n[dcqcn]\nxp = {}", "dcqcn.xp: unknown key"),
        ("version = [", "not valid TOML"),
    ],
)
def test_type_errors_name_the_key(text: str, expected: str) -> None:
    assert any(r.startswith(expected) for r in reasons(text)), reasons(text)


def test_every_type_error_is_reported_not_just_the_first() -> None:
    text = """
version = 1
bogus = 2
pfc_priorities = [9]
[[traffic_class]]
name = 5
priorities = [0]
bandwidth_percent = 150
ecn = { min_kb = 0, max_kb = 2, extra = 1 }
"""
    assert reasons(text) == [
        "bogus: unknown key",
        "pfc_priorities[0]: Expected `int` <= 7",
        "traffic_class[0].name: Expected `str`, got `int`",
        "traffic_class[0].bandwidth_percent: Expected `float` <= 100.0",
        "traffic_class[0].ecn.extra: unknown key",
        "traffic_class[0].ecn.min_kb: Expected `int` >= 1",
    ]


def test_json_errors() -> None:
    assert reasons("{", "json")[0].startswith("not valid JSON")
    assert reasons("[1]", "json") == ["a profile must be a table/object, not list"]
    assert reasons(json.dumps({"type": "job", "version": 1}), "json") == [
        "type: must be 'qos_profile' (got 'job')"
    ]
    assert reasons(json.dumps({"version": 1, "dscp_map": {"26": 9}}), "json") == [
        "dscp_map[26]: Expected `int` <= 7"
    ]
    assert reasons(b"\xff", "json")[0].startswith("not UTF-8 text")
    assert reasons(json.dumps({"v": 2, "version": 1}), "json") == [
        "v: schema version 2 is newer than the supported 1"
    ]
    assert reasons("version = 1", "yaml") == ["unknown profile format 'yaml'"]


def _classes(*specs: tuple[str, tuple[int, ...], float]) -> str:
    return "".join(
        f"[[traffic_class]]\nname = '{n}'\npriorities = {list(p)}\nbandwidth_percent = {b}\n"
        for n, p, b in specs
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "version = 1\n" + _classes(("a", (0,), 40), ("b", (3,), 50)),
            ["traffic_class: bandwidth_percent shares sum to 90, must be 100"],
        ),
        (
            "version = 1\n" + _classes(("a", (0, 3), 50), ("b", (3,), 50)),
            ["traffic_class[1].priorities: priority 3 is already in class 'a'"],
        ),
        (
            "version = 1\n" + _classes(("a", (0,), 50), ("a", (3,), 50)),
            ["traffic_class[1].name: class name 'a' is used twice"],
        ),
        (
            "version = 1\n" + _classes(("a", (0,), 50), (" ", (3,), 50)),
            ["traffic_class[1].name: must not be empty"],
        ),
        (
            "version = 1\n" + _classes(("a", (0,), 50), ("b", (), 50)),
            ["traffic_class[1].priorities: must list at least one priority"],
        ),
        (
            "version = 1\n" + _classes(("a", (1,), 100)),
            ["traffic_class: priority 0 (unmapped DSCP) is in no class"],
        ),
        (
            "version = 1\ndscp_map = { 26 = 3 }\n" + _classes(("a", (0,), 100)),
            ["dscp_map[26]: priority 3 is in no traffic_class"],
        ),
        (
            "version = 1\n" + _classes(("a", (0,), 100)) + "ecn = { min_kb = 400, max_kb = 200 }",
            ["traffic_class[0].ecn: min_kb (400) must be < max_kb (200)"],
        ),
        (
            "version = 1\n" + _classes(("a", (0,), 100)) + "ecn = { min_kb = 200, max_kb = 200 }",
            ["traffic_class[0].ecn: min_kb (200) must be < max_kb (200)"],
        ),
        ("version = 1\npfc_priorities = [3, 3]", ["pfc_priorities[1]: priority 3 is listed twice"]),
        (
            "version = 1\ninterfaces = { names = ['a/b', 'x' ] }",
            ["interfaces.names[0]: 'a/b' is not an interface name"],
        ),
        (
            "version = 1\n[dcqcn]\nrp = { '../x' = 1 }",
            ["dcqcn.rp.../x: not a parameter name ([a-z0-9_])"],
        ),
    ],
)
def test_semantic_errors(text: str, expected: list[str]) -> None:
    assert reasons(text) == expected


def test_semantic_errors_all_reported_together() -> None:
    text = (
        "version = 1\npfc_priorities = [3, 3]\ndscp_map = { 46 = 5 }\n"
        + _classes(("a", (0, 3), 40), ("a", (3,), 50))
        + "ecn = { min_kb = 9, max_kb = 2 }"
    )
    assert reasons(text) == [
        "pfc_priorities[1]: priority 3 is listed twice",
        "traffic_class[1].name: class name 'a' is used twice",
        "traffic_class[1].priorities: priority 3 is already in class 'a'",
        "traffic_class[1].ecn: min_kb (9) must be < max_kb (2)",
        "traffic_class: bandwidth_percent shares sum to 90, must be 100",
        "dscp_map[46]: priority 5 is in no traffic_class",
    ]


def test_problems_of_a_struct_built_in_code_recheck_ranges() -> None:
    """Structs built in code skip msgspec validation; profile_problems still catches it."""
    profile = QosProfile(
        version=-1,
        interfaces=InterfaceMatch(names=("ok", "bad name")),
        pfc_priorities=(9,),
        dscp_map={64: 1, 1: 9},
        link_rate_mbit=0,
        traffic_class=(
            TrafficClass(
                name="a",
                priorities=(0, 8),
                bandwidth_percent=100,
                ecn=EcnMarking(min_kb=1, max_kb=2, probability=1.5),
            ),
        ),
        dcqcn=Dcqcn(np={"x": -1}),
    )
    assert profile_problems(profile) == [
        "version: must be >= 0 (got -1)",
        "interfaces.names[1]: 'bad name' is not an interface name",
        "link_rate_mbit: must be >= 1 (got 0)",
        "pfc_priorities[0]: priority 9 is outside 0-7",
        "dscp_map[1]: priority 9 is outside 0-7",
        "dscp_map[64]: DSCP 64 is outside 0-63",
        "traffic_class[0].priorities: priority 8 is outside 0-7",
        "traffic_class[0].ecn.probability: 1.5 is outside 0-1",
        "dscp_map[64]: priority 1 is in no traffic_class",
        "dcqcn.np.x: must be an integer >= 0 (got -1)",
    ]


def test_profile_error_is_a_value_error() -> None:
    err = ProfileError(["a: b", "c: d"])
    assert isinstance(err, ValueError)
    assert err.reasons == ["a: b", "c: d"]
    assert str(err) == "a: b; c: d"
