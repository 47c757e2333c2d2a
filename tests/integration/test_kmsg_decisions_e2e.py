# ruff: noqa: E501  (real kernel log lines are kept whole)
"""The kernel log's decisions end to end (docs/kmsg.md "Into the fleet", docs/decisions.md):
simulated nodes whose agents read their kernel log from a file in /dev/kmsg's format, the
region controller and the job manager over real NATS.

- A critical line of a kind that isolates (here an uncorrected memory error) isolates the
  node at once, moves the job running on it from its checkpoint, and keeps the node out
  for the window (``kmsg_fatal`` on the batches' ``critical`` counts): it does not come
  back after three clean assessments.
- A hung task makes the node SUB_HEALTHY: its job runs to its end where it is.
"""

from __future__ import annotations

from pathlib import Path

from nats.aio.client import Client

from metalguard.proto.jobs import TERMINAL_JOB_STATES
from metalguard.proto.subjects import Subjects
from tests.support.harness.jobs_env import jobs_env
from tests.support.waiting import wait_until

UE = "EDAC MC1: 1 UE memory read error on CPU_SrcID#1_Ha#0_Chan#0_DIMM#0 (channel:0 slot:0 page:0x1234 offset:0x0 grain:32 - area:DRAM err_code:0001:0090)"
HUNG = "INFO: task python3:4242 blocked for more than 120 seconds."


async def test_an_uncorrected_memory_error_in_the_kernel_log_moves_the_job_and_keeps_the_node_out(
    tmp_path: Path, nats_url: str, nc: Client, subjects: Subjects
) -> None:
    async with jobs_env(tmp_path, nats_url, nc, subjects, racks=1, nodes_per_rack=4) as env:
        records = env.region.store.records
        first = await env.running_counted("ue", 400, nodes=2, step_s=0.05)
        await env.wait_step(first.job_id, 10)
        victim = first.placement[0]
        env.fleet.apply("kmsg", victim.rsplit(".", 1)[-1], line=UE)
        await wait_until(
            lambda: any(e.node and e.node.handle == victim for e in env.of("node.isolated")),
            30,
            "node.isolated",
        )
        (isolated,) = [e for e in env.of("node.isolated") if e.node and e.node.handle == victim]
        assert isolated.reasons[0].signal == "event.kmsg_memory_uncorrected"
        await wait_until(lambda: bool(env.of("job.rescheduled", first.job_id)), 30, "the job moved")
        moved = env.job(first.job_id)
        assert victim not in moved.placement
        # many more batches than the three clean ones a return needs: still out, by kmsg_fatal
        seq = records[victim].last_seq
        await wait_until(lambda: records[victim].last_seq >= seq + 10, 30, "ten more batches")
        assert records[victim].grade == "FAILING"
        assert any(r.rule == "kmsg_fatal" for r in records[victim].reasons), records[victim].reasons
        assert not [e for e in env.of("node.returned") if e.node and e.node.handle == victim]
        await env.manager.cancel(first.job_id)


async def test_a_hung_task_lets_the_job_finish_where_it_is(
    tmp_path: Path, nats_url: str, nc: Client, subjects: Subjects
) -> None:
    async with jobs_env(tmp_path, nats_url, nc, subjects, racks=1, nodes_per_rack=4) as env:
        first = await env.running_counted("hung", 120, nodes=2, step_s=0.05)
        await env.wait_step(first.job_id, 10)
        victim = first.placement[1]
        env.fleet.apply("kmsg", victim.rsplit(".", 1)[-1], line=HUNG)
        await wait_until(
            lambda: any(e.node and e.node.handle == victim for e in env.of("node.sub_healthy")),
            30,
            "node.sub_healthy",
        )
        (entered,) = [e for e in env.of("node.sub_healthy") if e.node and e.node.handle == victim]
        assert {r.rule for r in entered.reasons} >= {"kmsg_severe"}
        done = await env.wait_state(first.job_id, TERMINAL_JOB_STATES, 60)
        assert done.state == "succeeded", done.history
        assert (done.generation, done.restarts) == (first.generation, 0)
        assert not env.of("job.rescheduled", first.job_id)
