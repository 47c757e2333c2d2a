"""Scenario files: parsing, validation errors, and which faults are due when."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from metalguard.controller.core.lifecycle_model import LifecycleConfig
from metalguard.controller.core.rail import rail_limit
from metalguard.demo.sim.faults import KNOWN_KINDS
from metalguard.demo.sim.fleet import SimFleet, fleet_names, node_name
from metalguard.demo.sim.scenario import (
    Fault,
    Scenario,
    ScenarioError,
    due_faults,
    load_scenario,
    parse_scenario,
    unknown_nodes,
)

DEFAULT = Path(__file__).parents[2] / "scenarios" / "default.toml"

GOOD = """
description = "two faults"

[[fault]]
at = 10
node = "r1c1k1n2"
kind = "ecc_ce_storm"
count = 30
duration_s = 5.5

[[fault]]
at = 2.5
node = "r1c1k1n1"
kind = "agent_kill"
"""


def test_good_file_parses() -> None:
    scenario = parse_scenario(GOOD, "s.toml")
    assert scenario.description == "two faults"
    assert scenario.fault == (
        Fault(at=10, node="r1c1k1n2", kind="ecc_ce_storm", count=30, duration_s=5.5),
        Fault(at=2.5, node="r1c1k1n1", kind="agent_kill"),
    )


def test_default_scenario_covers_every_kind_on_the_default_fleet() -> None:
    scenario = load_scenario(DEFAULT)
    assert {f.kind for f in scenario.fault} == set(KNOWN_KINDS)
    default_fleet = fleet_names(1, 1, 4, 8) + fleet_names(2, 1, 4, 8)  # two regions
    assert unknown_nodes(scenario, default_fleet) == []
    assert all(f.expect for f in scenario.fault)  # every fault says what it should do


def test_the_default_scenarios_isolations_fit_under_its_safety_rail() -> None:
    """More FAILING faults in a cluster than its rail allows would leave the extra nodes
    in service (rail_flagged), never FAILING: the report would judge them wrong."""
    scenario = load_scenario(DEFAULT)
    assert scenario.rail_max_fraction is not None
    limit = rail_limit(32, LifecycleConfig(rail_max_fraction=scenario.rail_max_fraction))
    failing = Counter(f.node[:4] for f in scenario.fault if f.expect == "FAILING")  # r1c1
    assert failing, "the scenario isolates nothing"
    assert max(failing.values()) <= limit, (failing, limit)
    kmsg_failing = [f for f in scenario.fault if f.kind == "kmsg" and f.expect == "FAILING"]
    assert len(kmsg_failing) >= 3  # the kernel log's isolating families (docs/demo.md)


def test_a_rail_outside_0_to_1_is_refused() -> None:
    with pytest.raises(ScenarioError, match="rail_max_fraction"):
        parse_scenario("rail_max_fraction = 1.5\n", "s.toml")


def test_unknown_kind_lists_the_known_ones() -> None:
    text = GOOD.replace('"agent_kill"', '"meteor"')
    with pytest.raises(ScenarioError) as info:
        parse_scenario(text, "s.toml")
    message = str(info.value)
    assert message.startswith("s.toml: fault[1].kind: unknown kind 'meteor'; known: ")
    assert all(kind in message for kind in KNOWN_KINDS)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            '[[fault]]\nnode = "n"\nkind = "ecc_ue"\n',
            "s.toml: fault[0].at: missing (required)",
        ),
        (
            '[[fault]]\nat = "soon"\nnode = "n"\nkind = "ecc_ue"\n',
            "s.toml: fault[0].at: Expected `float`",
        ),
        (
            '[[fault]]\nat = -1\nnode = "n"\nkind = "ecc_ue"\n',
            "s.toml: fault[0].at: Expected `float` >= 0",
        ),
        (
            '[[fault]]\nat = 1\nnode = "n"\nkind = "ecc_ue"\ncount = 0\n',
            "fault[0].count: Expected `int` >= 1",
        ),
        (
            '[[fault]]\nat = 1\nnode = "n"\nkind = "ecc_ue"\nwhen = 3\n',
            "s.toml: fault[0].when: unknown key",
        ),
        ("[[fault]\n", "s.toml: not valid TOML"),
    ],
)
def test_bad_files_name_file_key_and_problem(text: str, expected: str) -> None:
    with pytest.raises(ScenarioError) as info:
        parse_scenario(text, "s.toml")
    assert expected in str(info.value)


def test_unreadable_file_names_it(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match=r"missing\.toml: cannot read"):
        load_scenario(tmp_path / "missing.toml")


def test_due_faults_in_time_order_once_each() -> None:
    scenario = parse_scenario(GOOD)
    assert due_faults(scenario, 0.0, set()) == []
    assert due_faults(scenario, 3.0, set()) == [(1, scenario.fault[1])]
    assert due_faults(scenario, 3.0, {1}) == []
    assert due_faults(scenario, 10.0, set()) == [(1, scenario.fault[1]), (0, scenario.fault[0])]
    assert due_faults(scenario, 99.0, {0, 1}) == []


def test_unknown_nodes_once_in_file_order() -> None:
    scenario = Scenario(
        fault=(
            Fault(at=0, node="x", kind="ecc_ue"),
            Fault(at=1, node="r1c1k1n1", kind="ecc_ue"),
            Fault(at=2, node="x", kind="fan_stop"),
        )
    )
    assert unknown_nodes(scenario, [node_name(1, 1, 1, 1)]) == ["x"]


def test_fleet_names_are_one_based() -> None:
    names = fleet_names(2, 1, 2, 3)
    assert names[0] == "r2c1k1n1"
    assert names[-1] == "r2c1k2n3"
    assert len(names) == 6


def test_fleet_configs_carry_identity_and_tree(tmp_path: Path) -> None:
    fleet = SimFleet(tmp_path, "nats://127.0.0.1:4222", clusters=2, racks=1, nodes_per_rack=1)
    nodes = fleet._build()
    config = nodes["r1c2k1n1"].config
    assert (config.node.region, config.node.cluster, config.node.name) == ("r1", "c2", "r1c2k1n1")
    assert config.collect.sysfs == str(tmp_path / "r1c2k1n1" / "sys")
    assert config.collect.intervals == {
        "edac": 1.0, "pcie": 1.0, "hwmon": 1.0, "smart": 1.0, "rdma": 5.0, "iommu": 5.0
    }  # fmt: skip
