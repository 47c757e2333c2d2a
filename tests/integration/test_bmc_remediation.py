"""Remediation through Redfish against the mockup emulator: the state changes are the
emulator's own (power state, reset log, boot log, boot override), read back after."""

from __future__ import annotations

import asyncio
from pathlib import Path

from metalguard.agent.bmc import remediation
from metalguard.agent.bmc.remediation import to_reply
from metalguard.proto.events import CommandStatus
from tests.support.harness.bmc_client import bmc_target, credentials, remediator, target
from tests.support.harness.redfish_emulator import RunningEmulator


async def test_power_status_changes_nothing(bmc: RunningEmulator, tmp_path: Path) -> None:
    outcome = await remediator(bmc).execute("c-1", bmc_target(bmc, tmp_path), "power_status")
    assert outcome.ok, outcome.message
    assert (outcome.power_state_before, outcome.power_state_after) == ("on", "on")
    assert bmc.emulator.resets == []
    assert bmc.emulator.sessions == {}  # logged out


async def test_forced_power_cycle_and_pxe_override_visible_in_emulator(
    bmc: RunningEmulator, tmp_path: Path
) -> None:
    rem = remediator(bmc)
    t = bmc_target(bmc, tmp_path)

    pxe = await rem.execute("c-pxe", t, "pxe_once")
    assert pxe.ok, pxe.message
    boot = bmc.emulator.system["Boot"]
    assert (boot["BootSourceOverrideTarget"], boot["BootSourceOverrideEnabled"]) == ("Pxe", "Once")
    assert bmc.emulator.patches == [remediation.boot_override_patch()]

    cycle = await rem.execute("c-cycle", t, "force_power_cycle")
    assert cycle.ok, cycle.message
    # the mockup offers no PowerCycle ResetType: ForceOff, then On
    assert bmc.emulator.resets == ["ForceOff", "On"]
    assert (cycle.power_state_before, cycle.power_state_after) == ("on", "on")
    assert bmc.emulator.system["PowerState"] == "On"
    # the boot after the cycle used the override once and consumed it
    assert bmc.emulator.boots == ["Pxe"]
    assert bmc.emulator.system["Boot"]["BootSourceOverrideEnabled"] == "Disabled"


async def test_pxe_override_sends_if_match_when_required(
    bmc: RunningEmulator, tmp_path: Path
) -> None:
    bmc.emulator.require_if_match = True
    outcome = await remediator(bmc).execute("c-etag", bmc_target(bmc, tmp_path), "pxe_once")
    assert outcome.ok, outcome.message
    assert bmc.emulator.system["Boot"]["BootSourceOverrideTarget"] == "Pxe"


async def test_graceful_power_cycle_waits_for_the_shutdown(
    bmc: RunningEmulator, tmp_path: Path
) -> None:
    bmc.emulator.shutdown_polls = 3  # PoweringOff for three reads of the system
    outcome = await remediator(bmc).execute("c-g", bmc_target(bmc, tmp_path), "power_cycle")
    assert outcome.ok, outcome.message
    assert bmc.emulator.resets == ["GracefulShutdown", "On"]
    assert bmc.emulator.boots == ["Hdd"]
    assert outcome.power_state_after == "on"
    reply = to_reply(outcome)
    assert reply.ok
    assert reply.status == CommandStatus.DONE
    assert reply.result["power_state_before"] == "on"


async def test_graceful_shutdown_that_never_ends_fails_with_the_state(
    bmc: RunningEmulator, tmp_path: Path
) -> None:
    bmc.emulator.shutdown_polls = 10**6  # the OS ignores the ACPI request
    rem = remediator(bmc, graceful_timeout_s=0.3)
    outcome = await rem.execute("c-hang", bmc_target(bmc, tmp_path), "power_cycle")
    assert not outcome.ok
    assert "did not become off" in outcome.message
    assert outcome.power_state_after == "powering_off"
    assert bmc.emulator.resets == ["GracefulShutdown"]  # no escalation by itself
    assert to_reply(outcome).status == CommandStatus.FAILED


async def test_repeated_command_id_acts_once(bmc: RunningEmulator, tmp_path: Path) -> None:
    store = tmp_path / "outcomes.jsonl"
    rem = remediator(bmc, store=store)
    t = bmc_target(bmc, tmp_path)
    first, again = await asyncio.gather(
        rem.execute("c-dup", t, "force_power_cycle"), rem.execute("c-dup", t, "force_power_cycle")
    )
    third = await rem.execute("c-dup", t, "force_power_cycle")
    assert bmc.emulator.resets == ["ForceOff", "On"]  # once
    assert first.ok
    assert not first.duplicate
    assert again.duplicate
    assert third.duplicate
    assert (again.ok, again.message, again.started_ts) == (
        first.ok,
        first.message,
        first.started_ts,
    )

    restarted = remediator(bmc, store=store)  # a new process reading the same store
    after_restart = await restarted.execute("c-dup", t, "force_power_cycle")
    assert after_restart.duplicate
    assert after_restart.finished_ts == first.finished_ts
    assert bmc.emulator.resets == ["ForceOff", "On"]
    assert to_reply(after_restart).duplicate


async def test_wrong_credentials_and_unknown_action_fail_cleanly(
    bmc: RunningEmulator, tmp_path: Path
) -> None:
    bad = target(bmc.address, credentials(tmp_path, password="nope"))
    rem = remediator(bmc)
    outcome = await rem.execute("c-401", bad, "force_power_cycle")
    assert not outcome.ok
    assert "401" in outcome.message
    assert "authentication" in outcome.message
    assert bmc.emulator.resets == []

    unknown = await rem.execute("c-x", bmc_target(bmc, tmp_path), "reboot_please")
    assert not unknown.ok
    assert "unknown action" in unknown.message


async def test_off_node_is_just_powered_on(bmc: RunningEmulator, tmp_path: Path) -> None:
    bmc.emulator.system["PowerState"] = "Off"
    outcome = await remediator(bmc).execute("c-on", bmc_target(bmc, tmp_path), "power_cycle")
    assert outcome.ok, outcome.message
    assert (outcome.power_state_before, outcome.power_state_after) == ("off", "on")
    assert bmc.emulator.resets == ["On"]


async def test_power_that_never_returns_is_a_failed_outcome(
    bmc: RunningEmulator, tmp_path: Path
) -> None:
    bmc.emulator.stays_off = True
    rem = remediator(bmc, transition_timeout_s=0.3)
    outcome = await rem.execute("c-dead", bmc_target(bmc, tmp_path), "force_power_cycle")
    assert bmc.emulator.resets == ["ForceOff", "On"]
    assert not outcome.ok
    assert "did not become on" in outcome.message
    assert (outcome.power_state_before, outcome.power_state_after) == ("on", "off")
