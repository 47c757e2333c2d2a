"""The workload runner in a real agent process, driven by real Commands over NATS:
start → progress → checkpoint → stop, idempotency, resume, SIGUSR1, hang, crash, shutdown."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import nats
import nats.errors
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from examples import trainer
from metalguard.controller.broker.server import NatsServer
from metalguard.controller.state.streams import ensure_streams
from metalguard.proto.base import AttrValue, NodeIdentity
from metalguard.proto.codec import decode, encode
from metalguard.proto.events import Command, CommandReply, NodeEvent
from metalguard.proto.subjects import Subjects
from tests.support.harness.agent_proc import AgentProcess, write_agent_config
from tests.support.waiting import wait_for_value, wait_until

TRAINER = str(Path(__file__).parents[2] / "examples" / "trainer.py")
PYTHON = sys.executable
REGION, CLUSTER = "r1", "c1"


def write_workload_config(
    path: Path, *, nats_url: str, prefix: str, base: Path, node: str, stop_grace_s: float = 5.0
) -> Path:
    """An agent config (fixture sysfs, short intervals) with the runner on."""
    write_agent_config(path, nats_url=nats_url, spool_dir=base / "spool", node=node)
    text = path.read_text().replace("[nats]\n", f'[nats]\nprefix = "{prefix}"\n', 1)
    text += f"""
[workload]
enabled = true
work_dir = "{base / "work"}"
socket = "{base / "wl.sock"}"
stop_grace_s = {stop_grace_s}
checkpoint_timeout_s = 5.0
progress_interval_s = 0.2
"""
    path.write_text(text)
    return path


async def make_streams(url: str, subjects: Subjects) -> None:
    """The design's streams under ``subjects``' prefix."""
    nc = await nats.connect(url)
    try:
        await ensure_streams(nc.jetstream(timeout=5), subjects)
    finally:
        await nc.close()


class NodeClient:
    """Commands to one agent and the NodeEvents it publishes (core subscription)."""

    def __init__(self, nc: Client, subjects: Subjects, node: str) -> None:
        self.nc = nc
        self.subjects = subjects
        self.node = NodeIdentity(region=REGION, cluster=CLUSTER, node=node)
        self.events: list[NodeEvent] = []

    async def listen(self) -> None:
        """Collect the node's events from now on."""

        async def on_event(msg: Msg) -> None:
            self.events.append(decode(msg.data, NodeEvent))

        subject = self.subjects.node_event(REGION, CLUSTER, self.node.node, "*")
        await self.nc.subscribe(subject, cb=on_event)
        await self.nc.flush()

    async def command(
        self,
        verb: str,
        args: dict[str, AttrValue | list[str]],
        *,
        command_id: str | None = None,
        expires_ts: float | None = None,
        timeout_s: float = 15.0,
    ) -> CommandReply:
        """Send one Command and decode its reply."""
        cmd = Command(
            command_id=command_id or uuid.uuid4().hex,
            ts=time.time(),
            node=self.node,
            verb=verb,
            args=args,
            expires_ts=expires_ts,
            issued_by="test",
        )
        subject = self.subjects.command(REGION, CLUSTER, self.node.node, verb)
        msg = await self.nc.request(subject, encode(cmd), timeout=timeout_s)
        return decode(msg.data, CommandReply)

    async def wait_ready(self, timeout_s: float = 20.0) -> None:
        """Until the agent answers ``status``."""

        async def probe() -> bool:
            try:
                await self.command("status", {}, timeout_s=1.0)
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                return False
            return True

        await wait_for_value(probe, bool, timeout_s, "the agent to answer commands")

    def of(self, job_id: str, kind: str) -> list[NodeEvent]:
        """Events of ``kind`` for ``job_id`` seen so far."""
        return [e for e in self.events if e.kind == kind and e.attributes.get("job_id") == job_id]

    async def wait_event(
        self, job_id: str, kind: str, timeout_s: float = 15.0, **match: AttrValue
    ) -> NodeEvent:
        """The first event of ``kind`` for ``job_id`` whose attributes include ``match``."""

        def found() -> NodeEvent | None:
            for e in self.of(job_id, kind):
                if all(e.attributes.get(k) == v for k, v in match.items()):
                    return e
            return None

        await wait_until(lambda: found() is not None, timeout_s, f"{kind} of {job_id} {match}")
        event = found()
        assert event is not None
        return event


def trainer_args(job_id: str, *extra: str) -> dict[str, AttrValue | list[str]]:
    """``start`` args running examples/trainer.py with ``extra`` flags."""
    return {"job_id": job_id, "command": "python", "args": [TRAINER, *extra]}


async def start_agent(
    tmp: Path, url: str, node: str, *, stop_grace_s: float = 5.0
) -> tuple[AgentProcess, Subjects]:
    """An agent process with the runner on, under a prefix of its own."""
    subjects = Subjects(f"w{uuid.uuid4().hex[:8]}")
    await make_streams(url, subjects)
    config = write_workload_config(
        tmp / f"{node}.toml",
        nats_url=url,
        prefix=subjects.prefix,
        base=tmp / node,
        node=node,
        stop_grace_s=stop_grace_s,
    )
    return AgentProcess(config), subjects


async def stop_agent(agent: AgentProcess) -> int:
    """SIGTERM the agent and wait (off the loop)."""
    return await asyncio.to_thread(agent.terminate)


# --- one agent for the module --------------------------------------------------------------
@pytest.fixture(scope="module")
def agent_node(
    nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Subjects]]:
    """A real agent (runner on) shared by the tests of this module; each uses its own job ids."""
    tmp = tmp_path_factory.mktemp("wl")
    agent, subjects = asyncio.run(start_agent(tmp, nats_server.url, "n1"))
    try:
        yield "n1", subjects
    finally:
        code = agent.terminate()
        err = agent.stderr()
        agent.close()
        assert code == 0, err


@pytest.fixture
async def node(nc: Client, agent_node: tuple[str, Subjects]) -> NodeClient:
    client = NodeClient(nc, agent_node[1], agent_node[0])
    await client.listen()
    await client.wait_ready()
    return client


def _job() -> str:
    return f"job-{uuid.uuid4().hex[:6]}"


async def test_start_progress_checkpoint_stop(node: NodeClient) -> None:
    job = _job()
    reply = await node.command(
        "start",
        {
            **trainer_args(job, "--steps", "100000", "--step-seconds", "0.02"),
            "rank": 0,
            "world_size": 1,
            "master_port": 29611,
            "generation": 3,
            "resume_step": 0,  # the controller's bookkeeping: ignored by the node
        },
    )
    assert reply.ok, reply
    assert reply.status == "done"
    pid = int(str(reply.result["pid"]))
    started = await node.wait_event(job, "job_started", pid=pid)
    assert started.source == "workload"
    assert started.attributes["generation"] == 3
    assert started.device == job
    # progress heartbeats: at least two distinct, increasing steps, rate-limited
    await wait_until(lambda: len(node.of(job, "job_progress")) >= 3, 15, "progress events")
    steps = [int(str(e.attributes["step"])) for e in node.of(job, "job_progress")]
    assert steps == sorted(set(steps)), steps

    ckpt = await node.command("checkpoint", {"job_id": job, "timeout_s": 5.0})
    assert ckpt.ok, ckpt
    step, path = ckpt.result["step"], ckpt.result["path"]
    assert isinstance(step, int)
    assert step > 0
    assert ckpt.result["method"] == "socket"
    assert trainer.read_checkpoint(Path(str(path))) == (step, trainer.state_after(step))
    await node.wait_event(job, "job_checkpointed", step=step, command_id=ckpt.command_id)

    status = await node.command("status", {"job_id": job})
    assert status.result["state"] == "running"
    assert status.result["checkpoint_step"] == step

    stop = await node.command("stop", {"job_id": job, "grace_s": 5.0})
    assert stop.ok, stop
    assert stop.result["exit_code"] == trainer.EXIT_STOPPED
    assert stop.result["forced"] is False
    exited = await node.wait_event(job, "job_exited")
    assert exited.attributes["stopped"] is True
    assert exited.attributes["signal"] is None
    assert exited.attributes["exit_code"] == trainer.EXIT_STOPPED
    assert exited.attributes["generation"] == 3
    # the progress rate: 0.02 s steps, at most one event per 0.2 s (+ the last flush)
    runtime = float(str(exited.attributes["runtime_s"]))
    assert len(node.of(job, "job_progress")) <= runtime / 0.2 + 2


async def test_commands_are_idempotent_and_expire(node: NodeClient) -> None:
    job = _job()
    args = trainer_args(job, "--steps", "100000", "--step-seconds", "0.02")
    cid = uuid.uuid4().hex
    first, again = await asyncio.gather(
        node.command("start", args, command_id=cid), node.command("start", args, command_id=cid)
    )
    replies = sorted([first, again], key=lambda r: r.duplicate)
    assert replies[0].ok
    assert not replies[0].duplicate
    assert replies[1].duplicate
    assert replies[1].result["pid"] == replies[0].result["pid"]
    third = await node.command("start", args, command_id=cid)
    assert third.duplicate
    assert third.result == replies[0].result
    # a new id for a job that runs is rejected, not a second process
    other = await node.command("start", args)
    assert not other.ok
    assert other.status == "rejected"
    assert other.result["pid"] == third.result["pid"]
    await node.wait_event(job, "job_started")
    assert len(node.of(job, "job_started")) == 1

    await wait_until(lambda: bool(node.of(job, "job_progress")), 10, "progress")
    ck_id = uuid.uuid4().hex
    ck1 = await node.command("checkpoint", {"job_id": job}, command_id=ck_id)
    ck2 = await node.command("checkpoint", {"job_id": job}, command_id=ck_id)
    assert ck1.ok
    assert ck2.duplicate
    assert ck2.result == ck1.result
    stop_id = uuid.uuid4().hex
    s1 = await node.command("stop", {"job_id": job}, command_id=stop_id)
    s2 = await node.command("stop", {"job_id": job}, command_id=stop_id)
    assert s1.ok
    assert s2.duplicate
    assert s2.result == s1.result
    await node.wait_event(job, "job_exited")
    requested = [e for e in node.of(job, "job_checkpointed") if e.attributes["command_id"]]
    assert [e.attributes["command_id"] for e in requested] == [ck_id]  # once, not twice

    late = _job()
    expired = await node.command(
        "start", trainer_args(late, "--steps", "5"), expires_ts=time.time() - 1
    )
    assert not expired.ok
    assert expired.status == "rejected"
    assert "expired" in expired.message
    status = await node.command("status", {"job_id": late})
    assert status.result["state"] == "unknown"
    bad = await node.command("start", {"job_id": late})
    assert not bad.ok
    assert "args.command" in bad.message


async def test_resume_gives_the_digest_of_an_uninterrupted_run(
    node: NodeClient, tmp_path: Path
) -> None:
    steps = 60
    plain = await asyncio.to_thread(
        subprocess.run,
        [
            PYTHON,
            TRAINER,
            "--steps",
            str(steps),
            "--step-seconds",
            "0.005",
            "--checkpoint-dir",
            str(tmp_path / "plain"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    uninterrupted = plain.stdout.strip().splitlines()[-1]
    assert uninterrupted == f"digest={trainer.digest_after(steps)}"

    job = _job()
    ckpt_dir = str(tmp_path / "ckpt")
    args = {
        **trainer_args(job, "--steps", str(steps), "--step-seconds", "0.05"),
        "checkpoint_dir": ckpt_dir,
    }
    assert (await node.command("start", args)).ok
    await node.wait_event(job, "job_progress", timeout_s=15)
    ckpt = await node.command("checkpoint", {"job_id": job})
    assert ckpt.ok, ckpt
    step = ckpt.result["step"]
    assert isinstance(step, int)
    assert 0 < step < steps
    await node.command("stop", {"job_id": job, "grace_s": 0.1})
    first = await node.wait_event(job, "job_exited")
    assert first.attributes["digest"] == ""

    resumed = await node.command(
        "start",
        {
            **args,
            "resume_from": str(ckpt.result["path"]),
            "args": [TRAINER, "--steps", str(steps), "--step-seconds", "0.005"],
        },
    )
    assert resumed.ok, resumed
    done = await node.wait_event(job, "job_exited", exit_code=0, stopped=False, timeout_s=30)
    assert f"digest={done.attributes['digest']}" == uninterrupted
    out = await asyncio.to_thread(Path(str(resumed.result["log"])).read_text)
    assert f"resumed step={ckpt.result['step']}" in out
    started = node.of(job, "job_started")
    assert [e.attributes["resume_from"] for e in started] == ["", ckpt.result["path"]]


async def test_checkpoint_by_sigusr1_without_the_library(node: NodeClient) -> None:
    job = _job()
    args = trainer_args(job, "--steps", "100000", "--step-seconds", "0.02", "--no-client")
    reply = await node.command("start", args)
    log = Path(str(reply.result["log"]))
    # before its handler is installed, SIGUSR1's default action would end the process
    await wait_until(lambda: "start step=" in log.read_text(), 10, "the trainer's handlers")
    ckpt = await node.command("checkpoint", {"job_id": job, "timeout_s": 5.0})
    assert ckpt.ok, ckpt
    assert ckpt.result["method"] == "signal"
    path = Path(str(ckpt.result["path"]))
    loaded = trainer.read_checkpoint(path)
    assert loaded is not None
    assert loaded[0] == ckpt.result["step"]
    assert not node.of(job, "job_progress")  # no library: no heartbeats
    await node.command("stop", {"job_id": job})
    await node.wait_event(job, "job_exited", stopped=True)


async def test_hang_stops_progress(node: NodeClient) -> None:
    job = _job()
    args = trainer_args(job, "--steps", "100000", "--step-seconds", "0.02", "--hang-at-step", "8")
    assert (await node.command("start", args)).ok
    await node.wait_event(job, "job_progress", step=8)
    seen = len(node.of(job, "job_progress"))
    # five progress intervals later: still step 8, no newer heartbeat
    await asyncio.sleep(1.0)
    assert len(node.of(job, "job_progress")) == seen
    status = await node.command("status", {"job_id": job})
    assert status.result["state"] == "running"
    assert status.result["step"] == 8
    ckpt = await node.command("checkpoint", {"job_id": job, "timeout_s": 0.5})
    assert not ckpt.ok
    assert ckpt.status == "failed"
    assert ckpt.result["last_step"] == -1
    await node.command("stop", {"job_id": job, "grace_s": 5.0})
    await node.wait_event(job, "job_exited", stopped=True, step=8)


async def test_crash_exits_nonzero_and_says_so(node: NodeClient) -> None:
    job = _job()
    # a first run of the same job finishes: its digest must not leak into the crash's event
    assert (await node.command("start", trainer_args(job, "--steps", "3"))).ok
    ok = await node.wait_event(job, "job_exited", exit_code=0)
    assert ok.attributes["digest"] == trainer.digest_after(3)
    assert ok.severity == "info"
    args = trainer_args(job, "--steps", "100", "--step-seconds", "0.01", "--crash-at-step", "3")
    assert (await node.command("start", args)).ok
    exited = await node.wait_event(job, "job_exited", exit_code=1)
    assert exited.attributes["digest"] == ""
    assert exited.severity == "warning"
    assert exited.attributes["stopped"] is False
    assert exited.attributes["step"] == 3
    status = await node.command("status", {"job_id": job})
    assert status.result["state"] == "exited"
    assert status.result["exit_code"] == 1


async def test_stop_forces_a_process_that_ignores_sigterm(node: NodeClient) -> None:
    job = _job()
    script = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('ready', flush=True)\n"
        "time.sleep(120)\n"
    )
    reply = await node.command(
        "start", {"job_id": job, "command": "python", "args": ["-c", script]}
    )
    assert reply.ok
    log = Path(str(reply.result["log"]))
    await wait_until(lambda: "ready" in log.read_text(), 10, "the script to ignore SIGTERM")
    stop = await node.command("stop", {"job_id": job, "grace_s": 0.3})
    assert stop.result["forced"] is True, stop
    assert stop.result["signal"] == "SIGKILL"
    exited = await node.wait_event(job, "job_exited")
    assert exited.attributes["forced"] is True
    assert exited.attributes["exit_code"] is None


async def test_a_killed_agent_takes_its_workloads_along(
    nats_url: str, nc: Client, tmp_path: Path
) -> None:
    agent, subjects = await start_agent(tmp_path, nats_url, "n3")
    try:
        node = NodeClient(nc, subjects, "n3")
        await node.listen()
        await node.wait_ready()
        reply = await node.command("start", trainer_args(_job(), "--steps", "100000"))
        pid = int(str(reply.result["pid"]))
        await asyncio.to_thread(agent.kill)  # a dead node: nothing runs on unwatched

        def gone() -> bool:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            return False

        await wait_until(gone, 10, "the workload to die with its agent")
    finally:
        agent.close()


async def test_agent_stop_stops_its_workloads(nats_url: str, nc: Client, tmp_path: Path) -> None:
    agent, subjects = await start_agent(tmp_path, nats_url, "n2", stop_grace_s=5.0)
    try:
        node = NodeClient(nc, subjects, "n2")
        await node.listen()
        await node.wait_ready()
        job = _job()
        reply = await node.command("start", trainer_args(job, "--steps", "100000"))
        pid = int(str(reply.result["pid"]))
        await node.wait_event(job, "job_progress")
        assert await stop_agent(agent) == 0
        exited = await node.wait_event(job, "job_exited", stopped=True)
        assert exited.attributes["exit_code"] == trainer.EXIT_STOPPED
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    finally:
        agent.close()


def _first_connects_fail(agent: AgentProcess, count: int) -> None:
    """Read the agent's log until ``count`` first-connect attempts have failed."""
    assert agent.proc.stderr is not None
    seen: list[str] = []
    while len([line for line in seen if "failed (attempt 1)" in line]) < count:
        line = agent.proc.stderr.readline()
        assert line, f"the agent exited: {''.join(seen)}"
        seen.append(line)


@pytest.mark.slow
async def test_commands_survive_nats_outages(tmp_path: Path, fresh_server: NatsServer) -> None:
    """Server down at agent start (a late first client), then restarted under a running
    job (nats-py's reconnect): the agent answers commands both times; the job runs on.
    Slow: each first connect to a server that is down takes its 5 s deadline."""
    subjects = Subjects(f"w{uuid.uuid4().hex[:8]}")
    url = fresh_server.url  # the same port after a restart
    await make_streams(url, subjects)
    await asyncio.to_thread(fresh_server.stop)
    config = write_workload_config(
        tmp_path / "n4.toml",
        nats_url=url,
        prefix=subjects.prefix,
        base=tmp_path / "n4",
        node="n4",
    )
    agent = AgentProcess(config)
    try:
        # both first connects (the publisher's, then the commands') fail before the server is up
        await asyncio.to_thread(_first_connects_fail, agent, 2)
        await asyncio.to_thread(fresh_server.start)
        nc = await nats.connect(url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
        try:
            node = NodeClient(nc, subjects, "n4")
            await node.listen()
            await node.wait_ready(30)
            job = _job()
            reply = await node.command("start", trainer_args(job, "--steps", "100000"))
            assert reply.ok
            await node.wait_event(job, "job_progress")
            await asyncio.to_thread(fresh_server.restart)
            await node.wait_ready(30)
            status = await node.command("status", {"job_id": job})
            assert status.result["state"] == "running"
            assert status.result["pid"] == reply.result["pid"]
            stop = await node.command("stop", {"job_id": job})
            assert stop.result["exit_code"] == trainer.EXIT_STOPPED
        finally:
            await nc.close()
        assert await stop_agent(agent) == 0
    finally:
        agent.close()
