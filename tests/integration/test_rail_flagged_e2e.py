"""The safety rail's promise end to end (docs/lifecycle.md, "The safety rail"): real agents,
real NATS, the region controller with its default rail and the job manager. Three of ten
nodes fail at once: one is isolated, two are kept in service and flagged
(``node.rail_flagged``); new work lands on none of them, a job too big for the rest stays
queued, a small one runs on unflagged nodes, and the job already running on a flagged
node runs on where it is."""

from __future__ import annotations

from pathlib import Path

from nats.aio.client import Client

from metalguard.controller.core.lifecycle import LifecycleConfig
from metalguard.proto.subjects import Subjects
from tests.support.harness.jobs_env import jobs_env
from tests.support.waiting import wait_until

RAIL = LifecycleConfig()
"""The shipped defaults: 10 % of a cluster per hour, at least one node."""


async def test_three_of_ten_failing_one_isolated_two_flagged_and_given_no_new_work(
    tmp_path: Path, nats_url: str, nc: Client, subjects: Subjects
) -> None:
    async with jobs_env(
        tmp_path, nats_url, nc, subjects, racks=1, nodes_per_rack=10, lifecycle=RAIL
    ) as env:
        records = env.region.store.records
        running = await env.submit("runs-on", 400, nodes=2, step_s=0.05)
        before = await env.wait_state(running, {"running"})
        await env.wait_step(running, 2)
        # the two nodes of the running job and one more fail at once
        spare = next(n for n in env.fleet.node_names if env.handle(n) not in before.placement)
        victims = [h.rsplit(".", 1)[-1] for h in before.placement] + [spare]
        for name in victims:
            env.fleet.apply("ecc_ue", name)
        handles = {env.handle(n) for n in victims}

        def settled() -> bool:
            got = [records.get(h) for h in handles]
            failing = sum(1 for r in got if r is not None and r.grade == "FAILING")
            flagged = sum(1 for r in got if r is not None and r.rail_flagged)
            return (failing, flagged) == (1, 2)

        await wait_until(settled, 60, "one of the three isolated, two flagged")
        flagged = {h for h in handles if records[h].rail_flagged}
        await wait_until(
            lambda: {e.node.handle for e in env.of("node.rail_flagged") if e.node} == flagged,
            30,
            "node.rail_flagged for each flagged node",
        )
        for event in env.of("node.rail_flagged"):
            assert event.attributes["flagged"] is True
            assert event.attributes["by"] == "rail"
        await wait_until(lambda: bool(env.of("rail.tripped")), 30, "rail.tripped")
        assert len(env.of("rail.tripped")) == 1

        # new work: 10 - 1 isolated - 2 flagged = 7 nodes take it
        big = await env.submit("nine", 50, nodes=9)
        small = await env.submit("two", 50, nodes=2)
        placed = await env.wait_state(small, {"running", "finished"})
        assert not set(placed.placement) & handles, placed.placement
        assert env.job(big).state == "queued", env.job(big)
        env.invariant()

        # the job that was on the isolated node moved; if both of its nodes were flagged
        # it ran on where it was (no rescheduling for a flag)
        isolated = next(h for h in handles if records[h].grade == "FAILING")
        if isolated in before.placement:
            await wait_until(
                lambda: bool(env.of("job.rescheduled", running)), 60, "the isolated node's job"
            )
            assert isolated not in env.job(running).placement
        else:
            assert env.job(running).placement == before.placement
            assert not env.of("job.rescheduled", running)
