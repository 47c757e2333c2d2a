"""The workload runner's pure parts, the command handler's idempotency and expiry, and the
client library without an agent (against the agent's real socket end:
tests/integration/test_workload_channel.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from metalguard.agent.workload import client
from metalguard.agent.workload.commands import BadArgsError, CommandHandler, parse_start
from metalguard.agent.workload.reports import digest_from, exit_info, exited_event, step_from_name
from metalguard.agent.workload.runner import Runner, RunnerSettings
from metalguard.proto.base import NodeIdentity
from metalguard.proto.events import Command, NodeEvent
from tests.support.clock import T0, ManualClock

ME = NodeIdentity(region="r1", cluster="c1", node="n1")


def test_parse_start_reads_every_arg() -> None:
    spec = parse_start(
        "c1",
        {
            "job_id": "j1",
            "command": "python",
            "args": ["train.py", "--steps", "3"],
            "env": ["A=1", "B=x=y"],
            "rank": 2,
            "world_size": 4,
            "master_addr": "10.0.0.1",
            "master_port": 29400,
            "checkpoint_dir": "/ckpt",
            "resume_from": "/ckpt/ckpt-00000010.json",
            "checkpoint_every": 30,
        },
    )
    assert spec.args == ("train.py", "--steps", "3")
    assert spec.env == {"A": "1", "B": "x=y"}
    assert (spec.rank, spec.world_size, spec.master_port) == (2, 4, 29400)
    assert spec.checkpoint_every == 30.0
    assert spec.command_id == "c1"


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        ({"job_id": "j"}, "args.command is required"),
        ({"job_id": "j", "command": "x", "rank": "1"}, "args.rank must be int"),
        ({"job_id": "j", "command": "x", "rank": True}, "args.rank must be int"),
        ({"job_id": "j", "command": "x", "env": ["NOEQUALS"]}, "not KEY=VALUE"),
        ({"job_id": "j", "command": "x", "args": "a b"}, "args.args must be a list"),
        ({"job_id": "", "command": "x"}, "must not be empty"),
    ],
)
def test_parse_start_names_the_bad_arg(args: dict[str, Any], problem: str) -> None:
    with pytest.raises(BadArgsError, match=problem):
        parse_start("c", args)


def test_exit_info_and_parsers() -> None:
    killed = exit_info(-9, stopped=True, forced=True, step=4, runtime_s=1.23456, output="")
    assert (killed.exit_code, killed.signal, killed.runtime_s) == (None, "SIGKILL", 1.235)
    done = exit_info(0, stopped=False, forced=False, step=9, runtime_s=1, output="digest=ab\nx\n")
    assert done.digest == "ab"
    assert digest_from("digest=aa\nsteps=3\ndigest=bb\n") == "bb"
    assert digest_from("no digest here; digest=cc") == ""
    assert step_from_name("ckpt-00000120.json") == 120
    assert step_from_name("latest.pt") is None
    event = exited_event(ME, event_id="e", ts=T0, job_id="j", rank=1, info=killed)
    assert event.severity == "warning"
    assert event.attributes["signal"] == "SIGKILL"
    assert event.attributes["job_id"] == "j"
    assert event.attributes["rank"] == 1


def test_client_without_an_agent_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(client.SOCKET_ENV, raising=False)
    wl = client.connect(handle_sigusr1=False)
    assert not wl.connected
    wl.report_progress(3)
    wl.checkpoint_done(3, "/x")
    assert not wl.checkpoint_requested()
    missing = client.connect("/nonexistent/agent.sock", handle_sigusr1=False)
    assert not missing.connected
    env = client.job_env({"MG_RANK": "3", "MG_WORLD_SIZE": "8", "MG_CHECKPOINT_EVERY": "bad"})
    assert (env.rank, env.world_size, env.checkpoint_every) == (3, 8, 0.0)


def _handler(tmp_path: Path, clock: ManualClock, remember: int = 16) -> CommandHandler:
    async def emit(_event: NodeEvent) -> None:
        return None

    runner = Runner(
        lambda: ME, emit, RunnerSettings(tmp_path / "work", str(tmp_path / "s")), wall_clock=clock
    )
    return CommandHandler(lambda: ME, runner, remember=remember, wall_clock=clock)


def _cmd(cid: str, verb: str = "status", **kw: object) -> Command:
    return Command(command_id=cid, ts=T0, node=ME, verb=verb, **kw)  # type: ignore[arg-type]


async def test_handler_is_idempotent_bounded_and_rejects_expired(tmp_path: Path) -> None:
    clock = ManualClock()
    handler = _handler(tmp_path, clock)
    first = await handler.handle(_cmd("a"))
    again = await handler.handle(_cmd("a"))
    assert first.ok
    assert not first.duplicate
    assert again.duplicate
    assert again.result == first.result
    assert handler.executed == 1
    # concurrent repeats: executed once
    replies = await asyncio.gather(*(handler.handle(_cmd("b")) for _ in range(5)))
    assert handler.executed == 2
    assert sorted(r.duplicate for r in replies) == [False, True, True, True, True]
    # only the newest `remember` ids are kept
    for i in range(16):
        await handler.handle(_cmd(f"x{i}"))
    assert not (await handler.handle(_cmd("a"))).duplicate

    clock.now = T0 + 100
    expired = await handler.handle(_cmd("late", expires_ts=T0 + 99))
    assert not expired.ok
    assert expired.status == "rejected"
    assert "expired" in expired.message
    assert (await handler.handle(_cmd("late", expires_ts=T0 + 99))).duplicate
    other = await handler.handle(
        Command(
            command_id="o",
            ts=T0,
            node=NodeIdentity(region="r1", cluster="c1", node="n9"),
            verb="status",
        )
    )
    assert other.status == "rejected"
    executed = handler.executed
    for blank in ("", "  "):  # every blank id would share one idempotency key
        refused = await handler.handle(_cmd(blank))
        assert (refused.status, refused.duplicate) == ("rejected", False)
        assert "command_id is empty" in refused.message
    assert handler.executed == executed
    unknown = await handler.handle(_cmd("u", verb="reboot"))
    assert "unknown verb" in unknown.message
    stop = await handler.handle(_cmd("s", verb="stop", args={"job_id": "nope"}))
    assert stop.ok
    assert stop.result["running"] is False
    ckpt = await handler.handle(_cmd("k", verb="checkpoint", args={"job_id": "nope"}))
    assert ckpt.status == "rejected"
    assert "does not run here" in ckpt.message
