"""Profile -> plan per interface: pure translation (agent/qos/plan.py)."""

from __future__ import annotations

import pytest

from metalguard.agent.qos.apply import PartResult, judge
from metalguard.agent.qos.dcb_backend import DcbState, _tc_bw, expected_state
from metalguard.agent.qos.dcb_backend import differences as dcb_differences
from metalguard.agent.qos.plan import (
    InterfaceInfo,
    plan_all,
    plan_interface,
    render_plan,
    select_interfaces,
    u32_ipv4_key,
    u32_ipv6_key,
)
from metalguard.agent.qos.tc_backend import TcState, _dscp_of, differences
from metalguard.agent.qos.tc_backend import expected_state as tc_expected
from metalguard.proto.qos import decode_profile

PROFILE = decode_profile(
    """
version = 7
link_rate_mbit = 1000
pfc_priorities = [3]
dscp_map = { 26 = 3, 46 = 5, 0 = 0 }

[[traffic_class]]
name = "default"
priorities = [0, 1, 2]
bandwidth_percent = 40

[[traffic_class]]
name = "training"
priorities = [3]
bandwidth_percent = 50
ecn = { min_kb = 100, max_kb = 400, probability = 0.5 }

[[traffic_class]]
name = "control"
priorities = [5]
bandwidth_percent = 10
strict = true

[dcqcn]
np = { min_time_between_cnps = 4 }
rp = { rpg_time_reset = 300 }
""",
    "toml",
)
ETH = InterfaceInfo(name="eth0", driver="mlx5_core", pci_class="0x020000", speed_mbit=100000)
VETH = InterfaceInfo(name="v0")


def test_tc_plan_rates_from_shares_and_speed() -> None:
    plan = plan_interface(PROFILE, ETH)
    assert plan.problems == ()
    tc = plan.tc
    assert tc is not None
    assert tc.link_kbit == 100_000_000  # the reported speed wins over link_rate_mbit
    assert [(c.classid, c.rate_kbit, c.ceil_kbit, c.prio) for c in tc.classes] == [
        ("1:10", 40_000_000, 100_000_000, 1),
        ("1:11", 50_000_000, 100_000_000, 1),
        ("1:12", 10_000_000, 100_000_000, 0),
    ]
    assert tc.default_classid == "1:10"  # the class serving priority 0
    assert [(f.dscp, f.classid) for f in tc.filters] == [(0, "1:10"), (26, "1:11"), (46, "1:12")]
    red = tc.classes[1].red
    assert red is not None
    assert (red.min_bytes, red.max_bytes, red.probability) == (102400, 409600, 0.5)
    assert tc.classes[0].red is None


def test_link_rate_from_the_profile_when_no_speed() -> None:
    tc = plan_interface(PROFILE, VETH).tc
    assert tc is not None
    assert tc.link_kbit == 1_000_000
    assert tc.classes[2].rate_kbit == 100_000


def test_no_speed_and_no_link_rate_is_a_problem_not_a_crash() -> None:
    profile = decode_profile(
        "version = 1\n[[traffic_class]]\nname = 'a'\npriorities = [0]\nbandwidth_percent = 100",
        "toml",
    )
    plan = plan_interface(profile, VETH)
    assert plan.tc is None
    assert plan.problems == (
        "v0: tc: the interface reports no speed and the profile sets no link_rate_mbit",
    )


def test_dcb_and_mlx5_parts() -> None:
    plan = plan_interface(PROFILE, ETH)
    assert plan.dcb is not None
    assert plan.dcb.pfc_priorities == (3,)
    assert plan.dcb.prio_tc == {0: 0, 1: 0, 2: 0, 3: 1, 5: 2}
    assert plan.dcb.dscp_prio == {0: 0, 26: 3, 46: 5}
    assert plan.mlx5 is not None
    assert plan.mlx5.np == {"min_time_between_cnps": 4}
    assert plan.mlx5.rp == {"rpg_time_reset": 300}
    # ETS shares: strict classes get none, the others are scaled to 100.
    assert _tc_bw(plan.dcb) == (44, 56, 0, 0, 0, 0, 0, 0)
    state = expected_state(plan.dcb)
    assert state.pfc == (False, False, False, True, False, False, False, False)
    assert state.prio_tc == (0, 0, 0, 1, 0, 2, 0, 0)
    assert dcb_differences(state, state) == []
    assert dcb_differences(state, DcbState(pfc=(False,) * 8)) == [
        "dcb pfc: expected [False, False, False, True, False, False, False, False], "
        "found [False, False, False, False, False, False, False, False]",
        "dcb prio_tc: expected [0, 0, 0, 1, 0, 2, 0, 0], found []",
        "dcb tc_bw: expected [44, 56, 0, 0, 0, 0, 0, 0], found []",
        "dcb app dscp-prio: expected [(0, 0), (26, 3), (46, 5)], found []",
    ]


def test_empty_profile_plans_nothing() -> None:
    plan = plan_interface(decode_profile("version = 1", "toml"), ETH)
    assert (plan.tc, plan.dcb, plan.mlx5, plan.problems) == (None, None, None, ())


def test_trust_pcp_makes_no_dscp_filters() -> None:
    text = "version = 1\ntrust = 'pcp'\nlink_rate_mbit = 10\ndscp_map = { 26 = 0 }\n"
    text += "[[traffic_class]]\nname = 'a'\npriorities = [0]\nbandwidth_percent = 100"
    tc = plan_interface(decode_profile(text, "toml"), VETH).tc
    assert tc is not None
    assert tc.filters == ()


def test_interface_selection() -> None:
    ib = InterfaceInfo(name="ib0", driver="mlx5_core", pci_class="0x020700")
    eth1 = InterfaceInfo(name="eth1", driver="ixgbe", pci_class="0x020000")
    nodes = [ETH, ib, eth1, VETH]
    by_names = decode_profile("version = 1\ninterfaces = { names = ['eth1', 'gone'] }", "toml")
    assert select_interfaces(by_names, nodes) == [eth1, InterfaceInfo(name="gone")]
    by_driver = decode_profile("version = 1\ninterfaces = { driver = 'mlx5_core' }", "toml")
    assert select_interfaces(by_driver, nodes) == [ETH, ib]
    by_class = decode_profile("version = 1\ninterfaces = { pci_class = '0x0207' }", "toml")
    assert select_interfaces(by_class, nodes) == [ib]
    both = decode_profile(
        "version = 1\ninterfaces = { driver = 'mlx5_core', pci_class = '0x0200' }", "toml"
    )
    assert select_interfaces(both, nodes) == [ETH]
    nothing = decode_profile("version = 1", "toml")
    assert select_interfaces(nothing, nodes) == []
    # The config / CLI override wins over the profile.
    assert select_interfaces(by_driver, nodes, ["v0"]) == [VETH]
    assert [p.interface for p in plan_all(by_driver, nodes)] == ["eth0", "ib0"]


def test_u32_keys_match_the_dscp_bits() -> None:
    assert u32_ipv4_key(26) == "0x00680000/0x00fc0000+0"  # TOS 0x68
    assert u32_ipv4_key(46) == "0x00b80000/0x00fc0000+0"  # TOS 0xb8 (EF)
    assert u32_ipv6_key(26) == "0x06800000/0x0fc00000+0"
    # How `tc -j filter show` prints them back (re-packed at byte offset 1 for IPv4).
    assert _dscp_of("ip", {"value": "68000000", "mask": "fc000000", "off": 1}) == 26
    assert _dscp_of("ipv6", {"value": "6800000", "mask": "fc00000", "off": 0}) == 26
    assert _dscp_of("ip", {"value": "0a000001", "mask": "ffffffff", "off": 12}) is None


def test_tc_state_differences() -> None:
    tc = plan_interface(PROFILE, VETH).tc
    assert tc is not None
    want = tc_expected(tc, red_classes=())
    assert want.leaves == {"1:10": "pfifo", "1:11": "pfifo", "1:12": "pfifo"}
    assert tc_expected(tc, red_classes={"1:11"}).leaves["1:11"] == "red"
    assert differences(want, want) == []
    assert differences(want, TcState()) == ["root qdisc: expected 'htb 1:', found 'none'"]
    classes = dict(want.classes)
    classes["1:11"] = (500_100, 1_000_000, 1)  # within 1%: htb rounding
    classes["1:12"] = (100_000, 1_000_000, 1)
    del classes["1:10"]
    classes["1:99"] = (8, 8, 0)
    actual = TcState(
        root="htb 1:",
        default_classid="1:11",
        classes=classes,
        leaves={"1:10": "pfifo", "1:11": "pfifo", "1:12": "tbf"},
        filters=want.filters - {("ip", 26, "1:11")} | {("ip", 27, "1:10")},
    )
    assert differences(want, actual) == [
        "htb default: expected 1:10, found 1:11",
        "class 1:10: missing",
        "class 1:12: expected rate 100000kbit ceil 1000000kbit prio 0, "
        "found rate 100000kbit ceil 1000000kbit prio 1",
        "class 1:99: not in the plan",
        "leaf of 1:12: expected pfifo, found tbf",
        "filter ip dscp 26 -> 1:11: missing",
        "filter ip dscp 27 -> 1:10: not in the plan",
    ]


@pytest.mark.parametrize(
    ("statuses", "diffs", "expected"),
    [
        (["applied", "applied"], [], "applied"),
        (["applied", "unsupported"], [], "partial"),
        (["unsupported", "unsupported"], [], "unsupported"),
        (["applied", "failed"], [], "failed"),
        (["applied"], ["x"], "failed"),
        ([], [], "applied"),
    ],
)
def test_judge(statuses: list[str], diffs: list[str], expected: str) -> None:
    parts = [PartResult(part="p", status=s) for s in statuses]  # type: ignore[arg-type]
    assert judge(parts, diffs) == expected


def test_render_plan_is_readable() -> None:
    text = render_plan(plan_all(PROFILE, [VETH], ["v0"]))
    assert "interface v0 (profile version 7)" in text
    assert "class 1:11 'training' priorities [3] rate 500000kbit" in text
    assert "red min 102400 max 409600 probability 0.5 ecn" in text
    assert "filter u32 dscp 26 -> 1:11" in text
    assert "mlx5: roce_np {'min_time_between_cnps': 4}" in text
    assert "no interface selected" in render_plan([])
