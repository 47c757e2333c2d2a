"""The bridge when Slurm fails, and across its own restarts (real nats-server; the Slurm
tools are absent, so every command fails the way a missing binary does)."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

from nats.aio.client import Client

from metalguard.controller.slurm.bridge import SlurmBridge
from metalguard.controller.slurm.config import BridgeConfig, SlurmSection
from metalguard.controller.slurm.runner import SlurmRunner
from metalguard.controller.slurm.tools import SlurmTools
from metalguard.proto.base import NodeIdentity
from metalguard.proto.codec import decode, encode
from metalguard.proto.events import ControllerEvent
from metalguard.proto.subjects import Subjects
from tests.support.waiting import wait_for_line, wait_for_value

DEADLINE_S = 10.0
METALGUARD = Path(sys.executable).parent / "metalguard"


def new_bridge(nc: Client, subjects: Subjects, bin_dir: Path) -> SlurmBridge:
    cfg = BridgeConfig(
        region="r1",
        cluster="c1",
        slurm=SlurmSection(bin_dir=str(bin_dir), attempts=2, backoff_s=0.05, poll_s=0.1),
    )
    tools = SlurmTools(SlurmRunner(cfg.slurm), "json")
    return SlurmBridge(nc.jetstream(timeout=5), subjects, cfg, tools)


async def isolate(nc: Client, subjects: Subjects, node: str, tag: str) -> str:
    event_id = f"r1.c1.{node}:node.isolated:{tag}"
    event = ControllerEvent(
        event_id=event_id,
        ts=1.0,
        region="r1",
        kind="node.isolated",
        node=NodeIdentity(region="r1", cluster="c1", node=node),
        message="uncorrectable ECC error",
        attributes={"by": "controller", "action": "isolate"},
    )
    js = nc.jetstream(timeout=5)
    await js.publish(
        subjects.control("r1", event.kind), encode(event), headers={"Nats-Msg-Id": event_id}
    )
    return event_id


async def failures(nc: Client, subjects: Subjects) -> list[ControllerEvent]:
    js = nc.jetstream(timeout=5)
    info = await js.stream_info(subjects.stream_control)
    if info.state.messages == 0:
        return []
    events = [
        decode((await js.get_msg(subjects.stream_control, seq)).data or b"", ControllerEvent)
        for seq in range(info.state.first_seq, info.state.last_seq + 1)
    ]
    return [e for e in events if e.kind == "slurm.command_failed"]


async def test_failing_slurm_commands_are_reported_and_the_bridge_keeps_going(
    nc: Client, subjects: Subjects, tmp_path: Path
) -> None:
    bridge = new_bridge(nc, subjects, tmp_path)
    await bridge.start()
    try:
        cause = await isolate(nc, subjects, "g1", "b1")
        found = await wait_for_value(
            lambda: failures(nc, subjects),
            lambda fs: any(f.attributes.get("cause_event_id") == cause for f in fs),
            DEADLINE_S,
            "slurm.command_failed for the isolation",
        )
        failed = next(f for f in found if f.attributes.get("cause_event_id") == cause)
        assert failed.node == NodeIdentity(region="r1", cluster="c1", node="g1")
        assert failed.attributes["attempts"] == 2
        assert str(failed.attributes["command"]).endswith("sinfo --json")
        assert any(f.node is None for f in found), "the poll's failure is reported too"
        assert bridge.handled == 0, "a failed decision is not acknowledged"
        assert bridge.retried >= 1, "but handed back for redelivery"
        # still consuming: the next decision is tried too
        second = await isolate(nc, subjects, "g2", "b2")
        await wait_for_value(
            lambda: failures(nc, subjects),
            lambda fs: any(f.attributes.get("cause_event_id") == second for f in fs),
            DEADLINE_S,
            "slurm.command_failed for the second isolation",
        )
    finally:
        await bridge.stop()


async def test_a_restarted_bridge_takes_the_decisions_made_while_it_was_down(
    nc: Client, subjects: Subjects, tmp_path: Path
) -> None:
    first = new_bridge(nc, subjects, tmp_path)
    await first.start(poll=False)
    await first.stop()
    missed = await isolate(nc, subjects, "g3", "b9")  # while no bridge runs

    second = new_bridge(nc, subjects, tmp_path)
    await second.start(poll=False)
    try:
        await wait_for_value(
            lambda: failures(nc, subjects),
            lambda fs: any(f.attributes.get("cause_event_id") == missed for f in fs),
            DEADLINE_S,
            "the restarted bridge to take the decision it missed",
        )
    finally:
        await second.stop()


async def test_the_service_runs_until_sigterm_and_exits_0(
    nats_url: str, subjects: Subjects, tmp_path: Path
) -> None:
    config = tmp_path / "bridge.toml"
    config.write_text(
        f'region = "r1"\ncluster = "c1"\n[nats]\nservers = ["{nats_url}"]\n'
        f'prefix = "{subjects.prefix}"\n[slurm]\nbin_dir = "{tmp_path}"\n'
    )
    proc = await asyncio.create_subprocess_exec(
        str(METALGUARD), "slurm-bridge", "--config", str(config),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    seen: list[str] = []
    try:
        assert proc.stderr is not None
        await wait_for_line(proc.stderr, "slurm bridge for region r1 running", DEADLINE_S, seen)
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), DEADLINE_S) == 0, "".join(seen)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
