"""GPU faults graded by NVIDIA's XID catalog, end to end (docs/decisions.md, "GPU"):
simulated NVIDIA GPUs behind a simulated NVML (the agents' real gpu collector and XID
watcher), the region controller, the job manager and remediation over real NATS.

- An XID of the ``reset_gpu`` class on a node of a running 2-node job: SUB_HEALTHY ("GPU
  reset when drained"); the job runs to its end where it is; the node enters MAINTENANCE;
  the controller asks its agent to reset that GPU (the simulated ``nvidia-smi
  --gpu-reset``), and after a clean re-check the node returns to service.
- A reset that fails leaves the node in MAINTENANCE, announced for an operator.
- XID 63 (a row remap recorded) isolates nothing and costs nothing; XID 92 costs points.
- XID 79 (fallen off the bus) isolates at once and the node is power-cycled through its
  BMC's verb (a bmc-proxy stand-in answers it here: this machine has no BMC).
"""

from __future__ import annotations

from pathlib import Path

from nats.aio.client import Client
from nats.aio.msg import Msg

from metalguard.controller.core.rules.gpu import RESET_SIGNAL
from metalguard.demo.sim import gpus
from metalguard.proto.codec import decode, encode
from metalguard.proto.events import Command, CommandReply, CommandStatus, ControllerEvent
from metalguard.proto.jobs import TERMINAL_JOB_STATES
from metalguard.proto.subjects import Subjects
from tests.support.harness.jobs_env import JobsEnv, expected_digest, jobs_env
from tests.support.waiting import wait_until

STEPS = 120
STEP_S = 0.05


def _for(env: JobsEnv, kind: str, handle: str) -> list[ControllerEvent]:
    return [e for e in env.of(kind) if e.node is not None and e.node.handle == handle]


def _gpu_of(env: JobsEnv, name: str) -> int:
    """The GPU the last fault on ``name`` hit (its detail says ``gpu<N>``)."""
    node, applied = env.fleet.applied[-1]
    assert node == name
    return int(applied.detail.split("gpu", 1)[1].split()[0].rstrip(":"))


async def test_a_reset_gpu_xid_drains_the_node_resets_the_gpu_and_returns_it(
    tmp_path: Path, nats_url: str, nc: Client, subjects: Subjects
) -> None:
    async with jobs_env(tmp_path, nats_url, nc, subjects, racks=1, nodes_per_rack=4) as env:
        records = env.region.store.records
        first = await env.running_counted("finishes", STEPS, nodes=2, step_s=STEP_S)
        job_id = first.job_id
        await env.wait_step(job_id, 10)
        victim = first.placement[1]
        name = victim.rsplit(".", 1)[-1]
        env.fleet.apply("gpu_xid_reset", name)  # XID 119, GSP RPC timeout
        gpu = _gpu_of(env, name)
        await wait_until(lambda: bool(_for(env, "node.sub_healthy", victim)), 30, "sub_healthy")
        (entered,) = _for(env, "node.sub_healthy", victim)
        (why,) = [r for r in entered.reasons if r.signal == RESET_SIGNAL]
        assert why.value == gpu
        assert why.message.endswith("GPU reset when drained")
        assert "XID 119 (GSP RPC timeout)" in why.message

        done = await env.wait_state(job_id, TERMINAL_JOB_STATES, 60)
        assert done.state == "succeeded", done.history
        assert done.digest == expected_digest(STEPS)
        assert (done.generation, done.restarts) == (first.generation, 0)
        assert not env.of("job.rescheduled", job_id)

        await wait_until(lambda: bool(_for(env, "node.gpu_reset", victim)), 30, "node.gpu_reset")
        (reset,) = _for(env, "node.gpu_reset", victim)
        assert reset.message == f"reset gpu{gpu}; back in service after clean re-checks"
        assert reset.command_id
        assert reset.command_id.startswith(f"{victim}.gpu_reset.")
        (maintenance,) = _for(env, "node.maintenance", victim)
        assert maintenance.message == "sub-healthy and its last job ended"
        assert maintenance.ts <= reset.ts
        state = gpus.read_state(gpus.state_dir(env.fleet.tree(name).root))
        assert [g["resets"] for g in state] == [int(g["index"] == gpu) for g in state]
        # back in service only after clean re-checks, and never reset twice
        await wait_until(lambda: bool(_for(env, "node.returned", victim)), 30, "node.returned")
        assert records[victim].grade == "HEALTHY"
        assert not [r for r in records[victim].reasons if r.signal == RESET_SIGNAL]
        assert len(_for(env, "node.gpu_reset", victim)) == 1
        assert not env.of("node.isolated")


async def test_a_failed_gpu_reset_leaves_the_node_in_maintenance_for_an_operator(
    tmp_path: Path, nats_url: str, nc: Client, subjects: Subjects
) -> None:
    async with jobs_env(tmp_path, nats_url, nc, subjects, racks=1, nodes_per_rack=2) as env:
        records = env.region.store.records
        name = env.fleet.node_names[0]
        handle = env.handle(name)
        directory = gpus.state_dir(env.fleet.tree(name).root)
        for g in gpus.read_state(directory):
            gpus.change(directory, int(g["index"]), reset_fails=True)
        env.fleet.apply("gpu_remap_pending", name)  # no job on it: drained at once
        gpu = _gpu_of(env, name)
        await wait_until(
            lambda: bool(_for(env, "node.gpu_reset.failed", handle)), 30, "the failed reset"
        )
        (failed,) = _for(env, "node.gpu_reset.failed", handle)
        assert "Unable to reset GPU" in failed.message
        assert "an operator must look" in failed.message
        assert failed.attributes["status"] == CommandStatus.FAILED
        assert records[handle].grade == "MAINTENANCE"
        assert any(r.signal == RESET_SIGNAL and r.value == gpu for r in records[handle].reasons)
        assert not _for(env, "node.returned", handle)


async def test_xid_63_costs_nothing_and_xid_92_reaches_the_score(
    tmp_path: Path, nats_url: str, nc: Client, subjects: Subjects
) -> None:
    async with jobs_env(tmp_path, nats_url, nc, subjects, racks=1, nodes_per_rack=2) as env:
        records = env.region.store.records
        quiet, noisy = env.fleet.node_names
        seen: list[str] = []

        async def on_xid(msg: Msg) -> None:
            seen.append(msg.subject)

        sub = await nc.subscribe(subjects.node_event("r1", "*", "*", "gpu_xid"), cb=on_xid)
        try:
            env.fleet.apply("gpu_xid_ignore", quiet)
            env.fleet.apply("gpu_xid_attention", noisy, count=3)
            noisy_handle = env.handle(noisy)
            await wait_until(
                lambda: any(r.signal == "gpu.xid_attention" for r in records[noisy_handle].reasons),
                30,
                "XID 92 in the noisy node's score",
            )
            (why,) = [r for r in records[noisy_handle].reasons if r.rule == "gpu_xid_attention"]
            assert why.value == 3
            assert records[noisy_handle].score == 90.0
            assert records[noisy_handle].grade == "HEALTHY"
            # the quiet node: its XID 63 came and went through batches after it
            quiet_handle = env.handle(quiet)
            await wait_until(lambda: len(seen) >= 4, 30, "both nodes' XID events")
            after = records[quiet_handle].last_seq
            await wait_until(
                lambda: records[quiet_handle].last_seq >= after + 3, 30, "three more batches"
            )
            assert records[quiet_handle].grade == "HEALTHY"
            assert records[quiet_handle].score == 100.0
            assert not env.of("node.isolated")
            assert not env.of("node.sub_healthy")
        finally:
            await sub.unsubscribe()


async def test_xid_79_isolates_at_once_and_power_cycles_through_the_bmc(
    tmp_path: Path, nats_url: str, nc: Client, subjects: Subjects
) -> None:
    async with jobs_env(tmp_path, nats_url, nc, subjects, racks=1, nodes_per_rack=2) as env:
        name = env.fleet.node_names[0]
        handle = env.handle(name)
        cluster = handle.split(".")[1]
        asked: list[Command] = []

        async def bmc_proxy(msg: Msg) -> None:  # a bmc-proxy's answer (docs/bmc.md)
            cmd = decode(msg.data, Command)
            asked.append(cmd)
            reply = CommandReply(
                command_id=cmd.command_id,
                ts=cmd.ts,
                ok=True,
                status=CommandStatus.DONE,
                message="power cycled",
                node=cmd.node,
            )
            await msg.respond(encode(reply))

        sub = await nc.subscribe(
            subjects.command("r1", cluster, name, "bmc_power_cycle"), cb=bmc_proxy
        )
        try:
            env.fleet.apply("gpu_xid_reboot", name)
            await wait_until(lambda: bool(_for(env, "node.isolated", handle)), 30, "isolated")
            (isolated,) = _for(env, "node.isolated", handle)
            assert isolated.reasons[0].signal == "event.gpu_xid"
            assert isolated.reasons[0].value == 79
            await wait_until(
                lambda: bool(_for(env, "node.power_cycled", handle)), 30, "node.power_cycled"
            )
            (cmd,) = asked
            assert cmd.verb == "bmc_power_cycle"
            assert cmd.issued_by == "controller:remediation"
            assert cmd.command_id.startswith(f"{handle}.bmc_power_cycle.")
            (cycled,) = _for(env, "node.power_cycled", handle)
            assert cycled.command_id == cmd.command_id
            assert any(r.rule == "gpu_xid_reboot" for r in cycled.reasons)
        finally:
            await sub.unsubscribe()


async def test_an_xid_only_the_kernel_log_names_is_graded_by_its_class(
    tmp_path: Path, nats_url: str, nc: Client, subjects: Subjects
) -> None:
    """docs/kmsg.md: an XID line of the kernel log enters the GPU's ``xid_errors`` (its
    PCI address -> the GPU NVML last read there): a reset-class XID makes the node
    SUB_HEALTHY, reset when drained, as NVML's own report would."""
    async with jobs_env(tmp_path, nats_url, nc, subjects, racks=1, nodes_per_rack=2) as env:
        name = env.fleet.node_names[0]
        handle = env.handle(name)
        line = (
            "NVRM: Xid (PCI:0000:10:00): 119, pid=2024380, name=nvidia-smi, Timeout after 6s "
            "of waiting for RPC response from GPU0 GSP! Expected function 103 (GSP_RM_ALLOC)"
        )
        env.fleet.apply("kmsg", name, line=line)
        await wait_until(lambda: bool(_for(env, "node.sub_healthy", handle)), 30, "sub_healthy")
        (entered,) = _for(env, "node.sub_healthy", handle)
        (why,) = [r for r in entered.reasons if r.signal == RESET_SIGNAL]
        assert why.value == 0  # GPU 0 is the simulated GPU at 0000:10:00.0
        assert "XID 119 (GSP RPC timeout)" in why.message
        # no job on it: drained, its GPU reset, back in service
        await wait_until(lambda: bool(_for(env, "node.returned", handle)), 30, "node.returned")
