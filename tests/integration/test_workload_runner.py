"""The runner in this process, without NATS: abandon (a simulated dead node) and close."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from examples import trainer
from metalguard.agent.workload.runner import LaunchSpec, Runner, RunnerSettings
from metalguard.proto.base import NodeIdentity
from metalguard.proto.events import NodeEvent
from tests.support.waiting import wait_until

ME = NodeIdentity(region="r1", cluster="c1", node="n1")
TRAINER = str(Path(__file__).parents[2] / "examples" / "trainer.py")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _runner(tmp_path: Path, events: list[NodeEvent]) -> Runner:
    async def emit(event: NodeEvent) -> None:
        events.append(event)

    settings = RunnerSettings(
        tmp_path / "work", str(tmp_path / "wl.sock"), stop_grace_s=5.0, progress_interval_s=0.1
    )
    return Runner(lambda: ME, emit, settings)


def _spec(job: str, *args: str) -> LaunchSpec:
    return LaunchSpec(job_id=job, command=sys.executable, args=(TRAINER, *args))


async def test_abandon_kills_at_once_and_reports_nothing(tmp_path: Path) -> None:
    events: list[NodeEvent] = []
    runner = _runner(tmp_path, events)
    await runner.start()
    try:
        member = await runner.launch(_spec("a", "--steps", "100000", "--step-seconds", "0.01"))
        await wait_until(lambda: member.step > 2, 10, "heartbeats over the socket")
        seen = len(events)
        runner.abandon()
        await wait_until(lambda: not _alive(member.pid), 10, "the member to be killed")
        await member.exited.wait()
        assert member.exit is not None
        assert member.exit.signal == "SIGKILL"
        assert len(events) == seen  # a dead node says nothing
        assert not [e for e in events if e.kind == "job_exited"]
    finally:
        await runner.close()


async def test_close_stops_members_gracefully_and_reports(tmp_path: Path) -> None:
    events: list[NodeEvent] = []
    runner = _runner(tmp_path, events)
    await runner.start()
    member = await runner.launch(_spec("b", "--steps", "100000", "--step-seconds", "0.01"))
    await wait_until(lambda: member.step > 2, 10, "heartbeats over the socket")
    await runner.close()
    assert member.exit is not None
    assert member.exit.exit_code == trainer.EXIT_STOPPED
    assert member.exit.stopped
    exited = [e for e in events if e.kind == "job_exited"]
    assert len(exited) == 1
    # the trainer's stop checkpoint was reported before the exit
    kinds = [e.kind for e in events]
    assert kinds.index("job_checkpointed") < kinds.index("job_exited")
    assert not _socket_left(tmp_path / "wl.sock")


def _socket_left(path: Path) -> bool:
    """Whether the socket file is still there (close removes it)."""
    return os.path.exists(path)


PRINT_DATASET_ENV = (
    "import os; print(repr((os.environ.get('MG_DATASET'), os.environ.get('MG_DATASET_DIR'))))"
)


async def test_members_get_their_datasets_mount(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """MG_DATASET and MG_DATASET_DIR (the node's [[cache.datasets]] mount); a dataset the
    node has no mount of: MG_DATASET only and a warning; never the agent's own values."""
    monkeypatch.setenv("MG_DATASET", "inherited")
    monkeypatch.setenv("MG_DATASET_DIR", "/inherited")
    mounts = {"imagenet": "/mnt/imagenet", "coco": ""}

    async def emit(event: NodeEvent) -> None:
        return None

    settings = RunnerSettings(tmp_path / "work", str(tmp_path / "wl.sock"))
    runner = Runner(lambda: ME, emit, settings, dataset_dirs=lambda: mounts)
    await runner.start()
    seen: dict[str, str] = {}
    try:
        for job, dataset in [("a", "imagenet"), ("b", "coco"), ("c", "missing"), ("d", "")]:
            spec = LaunchSpec(
                job_id=job, command=sys.executable, args=("-c", PRINT_DATASET_ENV), dataset=dataset
            )
            member = await runner.launch(spec)
            await asyncio.wait_for(member.exited.wait(), 30)
            seen[job] = member.log_path.read_text().strip()
    finally:
        await runner.close()
    assert seen == {
        "a": "('imagenet', '/mnt/imagenet')",
        "b": "('coco', None)",
        "c": "('missing', None)",
        "d": "(None, None)",
    }
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len([w for w in warned if "MG_DATASET_DIR not set" in w]) == 2, warned
    assert any("'missing' has no mount on this node" in w for w in warned), warned


async def test_a_member_the_oom_killer_killed_exits_with_that_cause(tmp_path: Path) -> None:
    """docs/kmsg.md: the kernel log's OOM kill of a member's pid, even a moment after the
    SIGKILL, makes its exit ``oom-killed``; a SIGKILL the log does not name has no cause."""
    import signal

    events: list[NodeEvent] = []
    runner = _runner(tmp_path, events)
    await runner.start()
    try:
        oom = await runner.launch(_spec("oom", "--steps", "100000", "--step-seconds", "0.01"))
        other = await runner.launch(_spec("kill", "--steps", "100000", "--step-seconds", "0.01"))
        await wait_until(lambda: oom.step > 2 and other.step > 2, 10, "heartbeats")
        os.kill(oom.pid, signal.SIGKILL)
        # the kernel log's record comes after the process is gone
        await wait_until(lambda: not _alive(oom.pid), 10, "the killed member reaped")
        runner.note_oom_kill(oom.pid, 1.0)
        os.kill(other.pid, signal.SIGKILL)
        await oom.exited.wait()
        await other.exited.wait()
        exits = {str(e.attributes["job_id"]): e for e in events if e.kind == "job_exited"}
        assert exits["oom"].attributes["cause"] == "oom-killed"
        assert exits["oom"].attributes["signal"] == "SIGKILL"
        assert "cause" not in exits["kill"].attributes
    finally:
        await runner.close()
