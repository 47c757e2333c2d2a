"""A simulated fleet of real agents against the session's real nats-server."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from nats.aio.client import Client

from metalguard.controller.ingest.consumer import Ingest, IngestSettings
from metalguard.controller.region import RegionController
from metalguard.controller.state.store import NodeStore
from metalguard.demo.sim.fleet import SimFleet
from metalguard.demo.sim.scenario import parse_scenario
from metalguard.proto.subjects import Subjects
from tests.support.waiting import wait_for_value, wait_until


async def batches_per_node(nc: Client, subjects: Subjects) -> dict[str, int]:
    """Telemetry messages stored per node name."""
    info = await nc.jetstream().stream_info(
        subjects.stream_telemetry, subjects_filter=subjects.all_of("tel")
    )
    counts = info.state.subjects or {}
    return {subject.rsplit(".", 1)[1]: n for subject, n in counts.items()}


async def test_fifty_agents_publish_and_a_killed_one_stops(
    tmp_path: Path, nats_url: str, nc: Client, subjects: Subjects
) -> None:
    """At 1 s rather than 0.5 s: 50 agents at 0.5 s saturate one core (docs/simulation.md),
    which makes the deadlines flaky on a loaded machine."""
    before_tasks = asyncio.all_tasks()
    fleet = SimFleet(
        tmp_path, nats_url, racks=5, nodes_per_rack=10, interval_s=1.0, prefix=subjects.prefix
    )
    assert len(fleet.node_names) == 50
    assert fleet.node_names[0] == "r1c1k1n1"
    cpu0, wall0 = time.process_time(), time.monotonic()
    await fleet.start()
    started = time.monotonic() - wall0
    try:
        counts = await wait_for_value(
            lambda: batches_per_node(nc, subjects),
            lambda c: len(c) == 50 and min(c.values()) >= 2,
            timeout_s=30,
            what="2 batches from each of 50 agents",
        )
        assert set(counts) == set(fleet.node_names)

        victim = "r1c1k3n5"
        fleet.apply("agent_kill", victim)
        await wait_until(lambda: victim not in fleet.running(), 10, "the killed agent to end")
        assert len(fleet.running()) == 49
        at_kill = await batches_per_node(nc, subjects)
        later = await wait_for_value(
            lambda: batches_per_node(nc, subjects),
            lambda c: all(c[n] >= at_kill[n] + 2 for n in fleet.node_names if n != victim),
            timeout_s=20,
            what="2 more batches from every live agent",
        )
        assert later[victim] == at_kill[victim]
        stopping = time.monotonic()
    finally:
        await fleet.stop()
    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    print(
        f"\n50 agents @1s: {cpu / wall:.0%} of one CPU over {wall:.1f}s "
        f"(start {started:.1f}s, stop {time.monotonic() - stopping:.1f}s)"
    )
    assert fleet.running() == []
    assert asyncio.all_tasks() - before_tasks == set()


async def test_scenario_faults_reach_the_stream(
    tmp_path: Path, nats_url: str, nc: Client, subjects: Subjects
) -> None:
    """Faults of a scenario become NodeEvents published by the faulty node's agent."""
    scenario = parse_scenario(
        """
[[fault]]
at = 0
node = "r1c1k1n2"
kind = "pcie_downgrade"

[[fault]]
at = 0
node = "r1c1k1n1"
kind = "smart_fail"
"""
    )
    async with SimFleet(
        tmp_path, nats_url, racks=1, nodes_per_rack=2, interval_s=0.2, prefix=subjects.prefix
    ) as fleet:
        await fleet.run_scenario(scenario)
        assert [node for node, _ in fleet.applied] == ["r1c1k1n2", "r1c1k1n1"]

        async def events() -> dict[str, int]:
            info = await nc.jetstream().stream_info(
                subjects.stream_events, subjects_filter=subjects.all_of("evt")
            )
            return dict(info.state.subjects or {})

        seen = await wait_for_value(
            events,
            lambda e: any("link_downgrade" in s for s in e) and any("smart_failed" in s for s in e),
            timeout_s=10,
            what="link_downgrade and smart_failed events",
        )
        assert any(".r1c1k1n2." in s for s in seen if "link_downgrade" in s)


async def test_simulated_nodes_declare_their_rack_and_the_records_carry_it(
    tmp_path: Path, nc: Client, nats_url: str, subjects: Subjects
) -> None:
    """Each simulated agent's ``[node]`` says its rack like a real one's (``k<N>`` of
    ``r1c1k<N>n<M>``), and a region controller's records carry it: what the dashboard
    groups by."""
    js = nc.jetstream(timeout=5)
    region = RegionController(js, await NodeStore.open(js, subjects), subjects, "r1")
    await region.start()
    ingest = Ingest(js, subjects, IngestSettings(region="r1"), region)
    await ingest.start()
    fleet = SimFleet(
        tmp_path, nats_url, racks=2, nodes_per_rack=2, interval_s=0.5, prefix=subjects.prefix
    )
    try:
        await fleet.start()
        declared = {name: node.config.node.rack for name, node in fleet.nodes.items()}
        assert declared == {
            "r1c1k1n1": "k1", "r1c1k1n2": "k1", "r1c1k2n1": "k2", "r1c1k2n2": "k2"
        }  # fmt: skip
        assert 'rack = "k2"' in (tmp_path / "r1c1k2n1" / "agent.toml").read_text()
        racks = await wait_for_value(
            lambda: _racks(region),
            lambda r: len(r) == 4,
            timeout_s=20,
            what="a record for each of the 4 simulated nodes",
        )
        assert racks == {f"r1.c1.{name}": rack for name, rack in declared.items()}
    finally:
        await fleet.stop()
        await ingest.stop()
        await region.stop()


async def _racks(region: RegionController) -> dict[str, str]:
    return {handle: r.rack for handle, r in region.store.records.items()}
