"""A drained node's GPU reset, the agent's part (docs/decisions.md "GPU"): the XID ledger
between the watcher and the collector, the ``gpu_reset`` verb running a real
``nvidia-smi`` stand-in process (a shell script), its refusals and failures."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from metalguard.agent.collectors.gpu_xids import XidLedger, boot_time
from metalguard.agent.workload.commands import CommandHandler
from metalguard.agent.workload.gpu_reset import (
    GpuResetSettings,
    GpuResetter,
    parse_gpus,
    reset_argv,
)
from metalguard.agent.workload.runner import Runner, RunnerSettings
from metalguard.proto.base import NodeIdentity
from metalguard.proto.events import Command, CommandStatus, NodeEvent
from tests.support.clock import T0, ManualClock

ME = NodeIdentity(region="r1", cluster="c1", node="n1")
RERUNS: list[str] = []
"""The fresh GPU readings asked for after resets (``on_reset``), by nvidia-smi path."""
DAY = 86_400.0


def test_the_ledger_keeps_reset_classes_until_a_reset_and_others_for_a_day() -> None:
    ledger = XidLedger()
    ledger.record(0, 13, T0)  # app: a day
    ledger.record(0, 119, T0)  # reset_gpu: until reset
    ledger.record(0, 92, T0 + 10)  # contact_support: a day
    ledger.record(1, 79, T0)  # reboot: until reset (or the node's reboot)
    assert ledger.xids(0, T0 + 60) == (13, 119, 92)
    assert ledger.xids(0, T0 + DAY + 5) == (119, 92)
    assert ledger.xids(0, T0 + 2 * DAY) == (119,)
    assert ledger.xids(1, T0 + 30 * DAY) == (79,)
    assert ledger.clear(0) == 3
    assert ledger.xids(0, T0) == ()
    assert ledger.xids(1, T0) == (79,)
    assert ledger.xids(7, T0) == ()


def test_the_ledger_survives_an_agent_restart_but_not_a_reboot(tmp_path: Path) -> None:
    path = tmp_path / "spool" / "xids.json"
    ledger = XidLedger(path=path, boot_ts=1000.0)
    ledger.record(2, 119, T0)
    ledger.record(2, 13, T0 + 1)
    ledger.record(4, 79, T0)
    assert ledger.clear(4) == 1
    again = XidLedger(path=path, boot_ts=1001.0)  # the same boot (btime moved a second)
    assert (again.xids(2, T0 + 5), again.xids(4, T0 + 5)) == ((119, 13), ())
    rebooted = XidLedger(path=path, boot_ts=90_000.0)
    assert rebooted.xids(2, T0 + 5) == ()


@pytest.mark.parametrize(
    "text", ["not json", '{"gpus": 3}', '["x"]', '{"boot_ts": 1000, "gpus": {"x": [[1, 2]]}}']
)
def test_a_broken_ledger_file_starts_empty(tmp_path: Path, text: str) -> None:
    path = tmp_path / "xids.json"
    path.write_text(text)
    ledger = XidLedger(path=path, boot_ts=1000.0)
    assert ledger.xids(0, T0) == ()
    ledger.record(0, 48, T0)  # and is replaced by a good one
    assert XidLedger(path=path, boot_ts=1000.0).xids(0, T0) == (48,)


def test_boot_time_reads_proc_stat(tmp_path: Path) -> None:
    (tmp_path / "stat").write_text("cpu  1 2 3\nbtime 1764000000\nprocesses 5\n")
    assert boot_time(tmp_path) == 1764000000.0
    assert boot_time(tmp_path / "absent") is None
    assert boot_time() is not None  # this machine's


def test_the_ledger_keeps_the_newest_when_full() -> None:
    ledger = XidLedger(keep=3)
    for i, xid in enumerate((13, 31, 43, 92)):
        ledger.record(0, xid, T0 + i)
    assert ledger.xids(0, T0 + 10) == (31, 43, 92)


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (None, "non-empty list"),
        ([], "non-empty list"),
        (["x"], "'x' is not a GPU index"),
        (["-1"], "'-1' is not a GPU index"),
        ("0", "non-empty list"),
    ],
)
def test_bad_gpu_lists_are_refused_saying_why(value: object, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_gpus(value)


def test_gpus_and_argv() -> None:
    assert parse_gpus(["3", "1", 3]) == (1, 3)
    assert reset_argv("/opt/x/nvidia-smi --quiet", 2) == [
        "/opt/x/nvidia-smi",
        "--quiet",
        "--gpu-reset",
        "-i",
        "2",
    ]


def _script(tmp_path: Path, body: str) -> str:
    """A stand-in nvidia-smi: logs its arguments, then ``body``."""
    path = tmp_path / "nvidia-smi"
    path.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "calls"}\n{body}\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def _calls(tmp_path: Path) -> list[str]:
    calls = tmp_path / "calls"
    return calls.read_text().splitlines() if calls.exists() else []


async def _noop(_event: NodeEvent) -> None:
    return None


def _handler(tmp_path: Path, nvidia_smi: str, ledger: XidLedger, busy: int = 0) -> CommandHandler:
    runner = Runner(lambda: ME, _noop, RunnerSettings(work_dir=tmp_path, socket_path=""))
    resetter = GpuResetter(
        GpuResetSettings(nvidia_smi, timeout_s=5.0),
        busy=lambda: busy,
        xids=ledger,
        on_reset=lambda: RERUNS.append(nvidia_smi),
    )
    return CommandHandler(lambda: ME, runner, wall_clock=ManualClock(), gpu_reset=resetter)


def _reset(cid: str, gpus: list[str]) -> Command:
    return Command(command_id=cid, ts=T0, node=ME, verb="gpu_reset", args={"gpus": gpus})


async def test_gpu_reset_runs_nvidia_smi_per_gpu_and_forgets_their_xids(tmp_path: Path) -> None:
    ledger = XidLedger()
    ledger.record(1, 119, T0)
    ledger.record(2, 48, T0)
    ledger.record(5, 79, T0)
    handler = _handler(tmp_path, _script(tmp_path, 'echo "GPU reset."'), ledger)
    reply = await handler.handle(_reset("c1", ["2", "1"]))
    assert (reply.ok, reply.status) == (True, CommandStatus.DONE), reply.message
    assert reply.message == "reset gpu1, gpu2"
    assert reply.result == {"gpus": ["1", "2"], "cleared_xids": 2}
    assert _calls(tmp_path) == ["--gpu-reset -i 1", "--gpu-reset -i 2"]
    assert (ledger.xids(1, T0), ledger.xids(2, T0), ledger.xids(5, T0)) == ((), (), (79,))
    assert RERUNS.count(str(tmp_path / "nvidia-smi")) == 1  # the GPUs are read again
    again = await handler.handle(_reset("c1", ["2", "1"]))  # the same id: not twice
    assert again.duplicate
    assert len(_calls(tmp_path)) == 2


async def test_gpu_reset_is_refused_while_a_job_member_runs(tmp_path: Path) -> None:
    ledger = XidLedger()
    ledger.record(0, 119, T0)
    handler = _handler(tmp_path, _script(tmp_path, "exit 0"), ledger, busy=2)
    reply = await handler.handle(_reset("c1", ["0"]))
    assert (reply.ok, reply.status) == (False, CommandStatus.REJECTED)
    assert "2 job member(s) still running here" in reply.message
    assert _calls(tmp_path) == []
    assert ledger.xids(0, T0) == (119,)


async def test_a_failed_reset_says_why_and_keeps_the_gpus_xids(tmp_path: Path) -> None:
    ledger = XidLedger()
    ledger.record(0, 119, T0)
    ledger.record(1, 119, T0)
    body = 'case "$3" in 1) echo "Unable to reset GPU 00000000:19:00.0: In use" >&2; exit 3;; esac'
    handler = _handler(tmp_path, _script(tmp_path, body), ledger)
    reply = await handler.handle(_reset("c1", ["0", "1"]))
    assert (reply.ok, reply.status) == (False, CommandStatus.FAILED)
    assert "exited 3: Unable to reset GPU 00000000:19:00.0: In use" in reply.message
    assert reply.result == {"gpu": 1, "exit_code": 3}
    # gpu0 was reset before the failure: its XIDs are gone; gpu1's stay
    assert (ledger.xids(0, T0), ledger.xids(1, T0)) == ((), (119,))


async def test_a_missing_nvidia_smi_and_bad_args_are_clear_errors(tmp_path: Path) -> None:
    handler = _handler(tmp_path, str(tmp_path / "absent"), XidLedger())
    reply = await handler.handle(_reset("c1", ["0"]))
    assert (reply.ok, reply.status) == (False, CommandStatus.FAILED)
    assert "No such file" in reply.message
    bad = await handler.handle(_reset("c2", ["gpu0"]))
    assert (bad.status, bad.result.get("cause")) == (CommandStatus.REJECTED, "bad_args")
    assert "'gpu0' is not a GPU index" in bad.message


def test_one_xid_from_nvml_and_the_kernel_log_is_one_report() -> None:
    from metalguard.agent.collectors.gpu_xids import gpu_index
    from metalguard.proto.telemetry import GpuDevice

    ledger = XidLedger()
    assert ledger.record(2, 92, T0, "nvml")
    assert not ledger.record(2, 92, T0 + 1.5, "kmsg")  # the same XID, the other source
    assert ledger.record(2, 92, T0 + 2.0, "nvml")  # a repeat of one source counts
    assert ledger.record(2, 92, T0 + 30, "kmsg")  # later: another report
    assert ledger.xids(2, T0 + 31) == (92, 92, 92)
    gpus = (
        GpuDevice(index=0, pci_address="0000:18:00.0"),
        GpuDevice(index=5, pci_address="0000:2B:00.0"),
    )
    assert gpu_index("0000:2b:00", gpus) == 5
    assert gpu_index("0000:2b:00.0", gpus) == 5
    assert gpu_index("0000:99:00", gpus) is None
