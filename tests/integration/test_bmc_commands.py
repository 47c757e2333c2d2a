"""BMC remediation as node commands over real NATS, answered by the bmc-proxy's
BmcCommandService against the Redfish emulator (agent/bmc/commands.py)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.aio.client import Client

from metalguard.agent.bmc.commands import BmcCommandService
from metalguard.proto.base import NodeIdentity
from metalguard.proto.codec import decode, encode
from metalguard.proto.events import Command, CommandReply, CommandStatus
from metalguard.proto.subjects import Subjects
from tests.support.harness.bmc_client import command_service
from tests.support.harness.redfish_emulator import RunningEmulator

NODE = NodeIdentity(region="eu1", cluster="trainA", node="gpu017")


@pytest.fixture
async def service(
    bmc: RunningEmulator, tmp_path: Path, nats_url: str, subjects: Subjects
) -> AsyncIterator[BmcCommandService]:
    async with command_service(bmc, tmp_path, nats_url, subjects) as svc:
        yield svc


async def ask(
    nc: Client,
    subjects: Subjects,
    verb: str,
    command_id: str,
    *,
    node: NodeIdentity = NODE,
    as_verb: str | None = None,
    expires_ts: float | None = None,
) -> CommandReply:
    """Send a Command on ``verb``'s subject of NODE (as ``as_verb`` inside); its reply."""
    cmd = Command(
        command_id=command_id,
        ts=time.time(),
        node=node,
        verb=as_verb or verb,
        expires_ts=expires_ts,
    )
    subject = subjects.command(NODE.region, NODE.cluster, NODE.node, verb)
    msg = await nc.request(subject, encode(cmd), timeout=10)
    return decode(msg.data, CommandReply)


async def test_pxe_and_power_cycle_through_commands_once_per_id(
    service: BmcCommandService, bmc: RunningEmulator, nc: Client, subjects: Subjects
) -> None:
    assert service.nodes == ["eu1.trainA.gpu017"]
    status = await ask(nc, subjects, "bmc_power_status", "s-1")
    assert status.ok, status.message
    assert status.result["power_state_before"] == "on"

    pxe = await ask(nc, subjects, "bmc_pxe_once", "p-1")
    assert pxe.ok, pxe.message
    assert bmc.emulator.system["Boot"]["BootSourceOverrideTarget"] == "Pxe"
    again = await ask(nc, subjects, "bmc_pxe_once", "p-1")
    assert again.duplicate
    assert len(bmc.emulator.patches) == 1  # the repeated id did not act twice

    cycle = await ask(nc, subjects, "bmc_force_power_cycle", "c-1")
    assert cycle.ok, cycle.message
    assert cycle.status == CommandStatus.DONE
    assert bmc.emulator.resets == ["ForceOff", "On"]
    assert bmc.emulator.boots == ["Pxe"]


async def test_wrong_node_wrong_verb_and_expired_are_rejected_unexecuted(
    service: BmcCommandService, bmc: RunningEmulator, nc: Client, subjects: Subjects
) -> None:
    other = NodeIdentity(region="eu1", cluster="trainA", node="gpu018")
    reply = await ask(nc, subjects, "bmc_power_cycle", "x-1", node=other)
    assert (reply.ok, reply.status) == (False, CommandStatus.REJECTED)
    assert "gpu018" in reply.message
    reply = await ask(nc, subjects, "bmc_power_cycle", "x-2", as_verb="bmc_pxe_once")
    assert reply.status == CommandStatus.REJECTED
    reply = await ask(nc, subjects, "bmc_power_cycle", "x-3", expires_ts=time.time() - 1)
    assert reply.status == CommandStatus.REJECTED
    assert "expired" in reply.message
    assert bmc.emulator.resets == []
