"""The demo's provisioning, pure parts: ``[[provision]]`` scenario entries, the steps due,
the instances a small fleet cannot hold, and the report's instance rows and verdict
(metalguard/demo/sim/scenario.py, metalguard/demo/report.py, metalguard/demo/provisioning.py)."""

from __future__ import annotations

import pytest

from metalguard.demo.provisioning import demo_handles
from metalguard.demo.report import INSTANCE_GRACE_S, instance_rows, report_ok
from metalguard.demo.sim.scenario import (
    ScenarioError,
    due_provision,
    instances_off,
    parse_scenario,
)
from metalguard.proto.provision import Instance

STEPS = """
[[provision]]
at = 8
action = "create"
instance = "a-1"
tenant = "acme"
image = "demo-base"
node = "r1c1k4n1"
expect = "active"

[[provision]]
at = 3
action = "create"
instance = "b-1"
tenant = "globex"
image = "demo-base"
node = "r1c1k9n9"

[[provision]]
at = 30
action = "switch"
instance = "a-1"
tenant = "globex"
image = "demo-base"

[[provision]]
at = 40
action = "release"
instance = "a-1"
keep_volume = false
expect = "released"
"""


def test_provision_steps_parse_and_come_due_in_time_order() -> None:
    scenario = parse_scenario(STEPS)
    assert [p.action for p in scenario.provision] == ["create", "create", "switch", "release"]
    assert scenario.provision[3].keep_volume is False
    assert [i for i, _ in due_provision(scenario, 10.0, set())] == [1, 0]
    assert [i for i, _ in due_provision(scenario, 45.0, {0, 1})] == [2, 3]


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ('action = "create"\ninstance = "x"', "a create needs a tenant and an image"),
        ('action = "fly"\ninstance = "x"', "provision[0].action"),
        ('action = "replace"\ninstance = "x y"', "provision[0].instance"),
        ('action = "replace"\ninstance = "x"\nexpect = "gone"', "provision[0].expect"),
    ],
)
def test_a_bad_step_names_its_key(entry: str, problem: str) -> None:
    with pytest.raises(ScenarioError) as bad:
        parse_scenario(f"[[provision]]\n{entry}\n", "s.toml")
    assert str(bad.value).startswith("s.toml: provision")
    assert problem in str(bad.value)


def test_instances_created_on_nodes_the_fleet_lacks_are_named() -> None:
    scenario = parse_scenario(STEPS)
    assert instances_off(scenario, ["r1c1k4n1"]) == ["b-1"]
    assert instances_off(scenario, ["r1c1k4n1", "r1c1k9n9"]) == []


def test_demo_handles_follow_the_fleet_names() -> None:
    assert demo_handles("r1", ["r1c2k3n4", "oops"]) == {"r1c2k3n4": "r1.c2.r1c2k3n4"}


def _instance(instance_id: str, state: str, created: float = 1.0) -> Instance:
    return Instance(
        instance_id=instance_id,
        tenant="acme",
        image="demo-base",
        volume=f"acme-{instance_id}",
        state=state,  # type: ignore[arg-type]
        node="r1.c1.r1c1k4n1",
        created_ts=created,
    )


def test_instance_rows_judge_the_expected_state_with_a_grace() -> None:
    instances = [_instance("a-1", "switching", 1.0), _instance("b-1", "active", 2.0)]
    expected = {"a-1": "active", "b-1": "active", "c-1": "active", "d-1": None}
    recent = {"a-1": 100.0 - INSTANCE_GRACE_S / 2}
    rows = instance_rows(instances, expected, recent, 100.0)
    by = {r["id"]: r for r in rows}
    assert [r["id"] for r in rows] == ["a-1", "b-1", "c-1"]
    assert by["a-1"]["pending"] is True  # switched a moment ago: not judged yet
    assert by["b-1"]["pending"] is False
    assert by["c-1"] == {"id": "c-1", "state": None, "expected": "active", "pending": False}
    late = instance_rows(instances, expected, {"a-1": 10.0}, 100.0)
    assert {r["id"]: r["pending"] for r in late}["a-1"] is False


def test_the_report_is_ok_only_with_every_expected_instance() -> None:
    base = {"faults": [], "jobs": [], "jobs_submitted": 0}
    good = {"id": "a", "state": "active", "expected": "active", "pending": False}
    pending = {"id": "b", "state": "deploying", "expected": "active", "pending": True}
    missing = {"id": "c", "state": None, "expected": "active", "pending": False}
    free = {"id": "d", "state": "deploy_failed", "expected": None, "pending": False}
    assert report_ok(base | {"instances": [good, pending, free]})
    assert not report_ok(base | {"instances": [good, missing]})
    assert report_ok(base)  # a report without provisioning
