"""``metalguard demo`` over two regions: one controller per region, one API showing every
region, and a report that checks each fault's grade, each job's digest and each
provisioned instance's state (docs/demo.md)."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from metalguard.demo.report import report_ok, worst_grade_since
from metalguard.demo.run import DemoOptions, expected_digest, region_count
from metalguard.demo.sim.scenario import ScenarioError, parse_scenario
from metalguard.proto.base import NodeIdentity
from metalguard.proto.nodes import GradeChange, NodeRecord
from tests.support.waiting import wait_for_line, wait_for_value

ROOT = Path(__file__).resolve().parents[2]
METALGUARD = Path(sys.executable).parent / "metalguard"
SCENARIO = """\
description = "two regions, three fault kinds, one job"

[[fault]]
at = 2
node = "r1c1k1n2"
kind = "ecc_ue"
expect = "FAILING"

[[fault]]
at = 2
node = "r2c1k1n1"
kind = "pcie_downgrade"
expect = "SUB_HEALTHY"

[[fault]]
at = 2
node = "r2c1k1n3"
kind = "agent_kill"
expect = "UNREACHABLE"

[[job]]
at = 1
name = "short"
nodes = 2
args = ["examples/trainer.py", "--steps", "60"]
checkpoint_every = 2

[[provision]]
at = 1
action = "create"
instance = "acme-1"
tenant = "acme"
image = "demo-base"
node = "r1c1k1n3"
expect = "active"

[[provision]]
at = 5
action = "switch"
instance = "acme-1"
tenant = "globex"
image = "demo-base"
expect = "active"
"""
START_S = 40.0
RUN_S = 12.0


async def _get(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def _decisions(session: aiohttp.ClientSession, api: str) -> set[tuple[str, str]]:
    history = (await _get(session, f"{api}/v1/events/history"))["events"]
    return {(e["kind"], e["node"]["node"]) for e in history if e.get("node")}


def _settled(fleet: dict[str, Any]) -> bool:
    """Both regions heard, each with its own 3 nodes, and the faults graded there."""
    regions = {r["region"]: r for r in fleet["regions"]}
    if set(regions) != {"r1", "r2"} or any(r["nodes"] != 3 for r in regions.values()):
        return False
    r1, r2 = regions["r1"]["grades"], regions["r2"]["grades"]
    return bool(r1["FAILING"] == 1 and r2["UNREACHABLE"] == 1 and r2["FAILING"] == 0)


async def test_two_regions_one_api_and_a_report_that_checks_itself(tmp_path: Path) -> None:
    scenario = tmp_path / "s.toml"
    scenario.write_text(SCENARIO, encoding="utf-8")
    report = tmp_path / "r.json"
    demo = await asyncio.create_subprocess_exec(
        str(METALGUARD), "--log-level", "warning", "demo", "--headless",
        "--duration", str(RUN_S), "--regions", "2", "--racks", "1", "--nodes-per-rack", "3",
        "--interval", "0.5", "--scenario", str(scenario), "--report", str(report),
        "--http", "127.0.0.1:0",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, cwd=ROOT,
    )  # fmt: skip
    assert demo.stdout is not None
    seen: list[str] = []
    reader: asyncio.Task[None] | None = None
    try:
        await wait_for_line(demo.stdout, "dashboard: ", START_S, seen)
        found = re.search(r"(http://\S+)/ui/", seen[-1])
        assert found is not None, seen[-1]
        api = found.group(1)
        reader = asyncio.create_task(_drain(demo.stdout, seen))
        text = "".join(seen)
        assert "agents up: 6/6 (r1 3/3, r2 3/3)" in text
        assert "QoS profile qos-profile.toml" in text
        async with aiohttp.ClientSession() as session:
            # per-region isolation: each region's summary counts only its own 3 nodes,
            # and each fault is graded in its own region only
            fleet = await wait_for_value(
                lambda: _get(session, f"{api}/v1/fleet"), _settled, RUN_S, "both regions graded"
            )
            assert fleet["region"] == "r1"
            nodes = (await _get(session, f"{api}/v1/nodes"))["nodes"]
            regions = sorted({n["region"] for n in nodes})
            assert regions == ["r1", "r2"], nodes  # the heatmap's source: every region
            assert len(nodes) == 6
            # the event stream (and its history) carries both regions' decisions
            want = {("node.isolated", "r1c1k1n2"), ("node.unreachable", "r2c1k1n3")}
            await wait_for_value(
                lambda: _decisions(session, api), want.issubset, RUN_S, "both regions' events"
            )
            # provisioning (the first region's, through the same ProvisionService): the
            # instance goes active on the simulated node's boot, then is switched
            switched = await wait_for_value(
                lambda: _get(session, f"{api}/v1/instances/acme-1"),
                lambda i: i["tenant"] == "globex" and i["state"] == "active",
                RUN_S,
                "acme-1 switched to globex",
            )
            assert switched["node"] == "r1.c1.r1c1k1n3"
            assert [h["state"] for h in switched["history"]] == [
                "deploying",
                "active",
                "switching",
                "active",
            ]
            volumes = {
                v["tenant"]: v for v in (await _get(session, f"{api}/v1/volumes"))["volumes"]
            }
            assert volumes["acme"]["instance"] is None  # kept for acme, attached nowhere
            assert volumes["globex"]["instance"] == "acme-1"
            lines = {n["handle"]: n.get("provision") for n in nodes}
            assert lines["r1.c1.r1c1k1n1"] == {
                "state": "available",
                "instance": None,
                "tenant": None,
                "image": None,
                "flagged": False,
            }
            assert lines["r2.c1.r2c1k1n1"] is None  # the first region provisions
            qos = await _get(session, f"{api}/v1/qos/c1")
            assert qos["profile"]["version"] == 3, qos
            view = await _get(session, f"{api}/v1/qos")  # the fleet view: both regions
            assert [
                (c["region"], c["cluster"], c["profile_version"], c["nodes"])
                for c in view["clusters"]
            ] == [
                ("r1", "c1", 3, 3),
                ("r2", "c1", 3, 3),
            ], view
        await asyncio.wait_for(demo.wait(), RUN_S + 20)
    finally:
        if demo.returncode is None:
            demo.send_signal(signal.SIGINT)
            try:
                await asyncio.wait_for(demo.wait(), 20)
            except TimeoutError:
                demo.kill()
                await demo.wait()
        if reader is not None:
            await reader
    assert demo.returncode == 0, "".join(seen)
    doc = json.loads(report.read_text())
    assert doc["regions"] == ["r1", "r2"]
    got = {(f["node"], f["expected"], f["got"]) for f in doc["faults"]}
    assert got == {
        ("r1c1k1n2", "FAILING", "FAILING"),
        ("r2c1k1n1", "SUB_HEALTHY", "SUB_HEALTHY"),
        ("r2c1k1n3", "UNREACHABLE", "UNREACHABLE"),
    }, "".join(seen)
    [job] = doc["jobs"]
    assert job["state"] == "succeeded"
    assert doc["jobs_submitted"] == 1
    assert job["digest"] == doc["expected_digests"]["short"] is not None
    [instance] = doc["instances"]
    assert (instance["id"], instance["tenant"], instance["state"]) == ("acme-1", "globex", "active")
    assert [s["action"] for s in doc["provision_steps"]] == ["create", "switch"]
    assert all(s["ok"] for s in doc["provision_steps"])
    text = "".join(seen)
    assert "instance.active r1c1k1n3" in text
    assert "instance.switching r1c1k1n3" in text
    assert doc["ok"] is True, "".join(seen)


async def _drain(stream: asyncio.StreamReader, seen: list[str]) -> None:
    while line := await stream.readline():
        seen.append(line.decode())


# --- the pure parts ----------------------------------------------------------------------


def _record(grade: str, changes: list[tuple[float, str]]) -> NodeRecord:
    history = tuple(
        GradeChange(ts=ts, grade_from="HEALTHY", grade_to=to)  # type: ignore[arg-type]
        for ts, to in changes
    )
    node = NodeIdentity(region="r1", cluster="c1", node="r1c1k1n1")
    return NodeRecord(node=node, grade=grade, history=history)  # type: ignore[arg-type]


def test_got_is_the_worst_grade_since_the_fault() -> None:
    drained = _record("MAINTENANCE", [(5.0, "SUB_HEALTHY"), (6.0, "MAINTENANCE")])
    assert worst_grade_since(drained, 4.0) == "SUB_HEALTHY"
    escalated = _record("FAILING", [(5.0, "SUB_HEALTHY"), (6.0, "FAILING")])
    assert worst_grade_since(escalated, 4.0) == "FAILING"
    before = _record("HEALTHY", [(1.0, "FAILING"), (2.0, "HEALTHY")])
    assert worst_grade_since(before, 4.0) == "HEALTHY"  # a grade before the fault counts not
    assert worst_grade_since(_record("UNREACHABLE", []), 0.0) == "UNREACHABLE"
    assert worst_grade_since(None, 0.0) is None


def test_report_ok_needs_every_grade_every_digest_and_every_job() -> None:
    fault = {"node": "n", "kind": "ecc_ue", "expected": "FAILING", "got": "FAILING"}
    job = {"name": "a", "state": "succeeded", "digest": "ab"}

    def doc(faults: list[Any], jobs: list[Any], submitted: int = 1) -> dict[str, Any]:
        return {
            "faults": faults,
            "jobs": jobs,
            "jobs_submitted": submitted,
            "expected_digests": {"a": "ab"},
        }

    assert report_ok(doc([fault], [job]))
    assert not report_ok(doc([fault | {"got": "HEALTHY"}], [job]))
    assert not report_ok(doc([fault], [job | {"digest": "cd"}]))
    assert not report_ok(doc([fault], [job | {"state": "failed"}]))
    assert not report_ok(doc([fault], [job], submitted=2))  # one was lost
    assert report_ok(doc([fault | {"expected": None, "got": "HEALTHY"}], [], submitted=0))


def test_expected_digest_is_the_trainers_uninterrupted_one() -> None:
    scenario = parse_scenario(SCENARIO)
    digest = expected_digest(scenario.job[0])
    assert digest == "7bed7af64a6aa44296fb60077e15284b0498d5433dbf0d0fe02379c3da81fc87"
    other = parse_scenario('[[job]]\nname = "x"\nargs = ["sleep.py"]\n').job[0]
    assert expected_digest(other) is None


def test_region_count_defaults_to_two_or_to_what_the_scenario_names() -> None:
    scenario = parse_scenario(SCENARIO)
    assert region_count(DemoOptions(), scenario) == 2
    assert region_count(DemoOptions(regions=3), scenario) == 3
    assert region_count(DemoOptions(scenario=Path("s.toml")), scenario) == 2
    only_r1 = parse_scenario('[[fault]]\nat = 1\nnode = "r1c1k1n2"\nkind = "ecc_ue"\n')
    assert region_count(DemoOptions(scenario=Path("s.toml")), only_r1) == 1


def test_expect_must_be_a_grade() -> None:
    text = '[[fault]]\nat = 1\nnode = "r1c1k1n2"\nkind = "ecc_ue"\nexpect = "RED"\n'
    with pytest.raises(ScenarioError, match=r"s.toml: .*fault\[0\]\.expect"):
        parse_scenario(text, "s.toml")
