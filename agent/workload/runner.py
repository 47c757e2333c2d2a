"""The process runner: launches, checkpoints and stops job members on this node.

Each member runs in its own process group, in ``<work_dir>/<job_id>.<rank>/`` with its
output in ``output.log``.  Start and exit are reported as NodeEvents at once; progress
heartbeats from the client library are forwarded at a bounded rate; checkpoints go
through the client library's socket, else SIGUSR1 (docs/workloads.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import sys
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from metalguard.agent.workload.channel import Channel, ChannelPeer
from metalguard.agent.workload.reports import (
    Checkpoint,
    ExitInfo,
    exit_info,
    exited_event,
    job_event,
    refusal,
    step_from_name,
)
from metalguard.agent.workload.timing import DEFAULT_WINDOW_S
from metalguard.proto.base import NodeIdentity
from metalguard.proto.events import NodeEvent
from metalguard.runtime.deadlines import wait_event, within

log = logging.getLogger(__name__)

Emit = Callable[[NodeEvent], Awaitable[None]]
KEEP_EXITED = 256
OOM_WAIT_S = 1.0
"""How long a member killed by SIGKILL waits for the kernel log's OOM record of it."""
OOM_REMEMBER = 1024
"""OOM-killed pids kept (the newest)."""
"""Exited members remembered for ``status``."""
SIGNAL_POLL_S = 0.1
"""How often the checkpoint dir is looked at after a SIGUSR1."""
OUTPUT_TAIL_BYTES = 16384


class RunnerError(Exception):
    """A command the runner cannot carry out; ``status`` is the CommandReply status."""

    def __init__(self, message: str, status: str = "rejected", **result: object) -> None:
        super().__init__(message)
        self.status = status
        self.result = result


@dataclass(frozen=True, slots=True)
class RunnerSettings:
    """The ``[workload]`` settings the runner needs."""

    work_dir: Path
    socket_path: str
    stop_grace_s: float = 30.0
    checkpoint_timeout_s: float = 60.0
    progress_interval_s: float = 2.0
    python: str = ""


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    """What a ``start`` command asks for."""

    job_id: str
    command: str
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    rank: int = 0
    world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    checkpoint_dir: str = ""
    resume_from: str = ""
    checkpoint_every: float = 0.0
    command_id: str = ""
    generation: int = 0
    """The controller's generation of the job, echoed in every event."""
    dataset: str = ""
    """The dataset the job reads (``MG_DATASET``; its mount here is ``MG_DATASET_DIR``)."""
    timing_window_s: float = DEFAULT_WINDOW_S
    """``MG_TIMING_WINDOW_S``: the window the client batches step timings over."""


class Member:
    """One process of a job on this node."""

    def __init__(self, spec: LaunchSpec, directory: Path, checkpoint_dir: Path) -> None:
        self.spec = spec
        self.dir = directory
        self.log_path = directory / "output.log"
        self.log_offset = 0
        """Where this run's output starts in ``output.log`` (earlier runs append too)."""
        self.checkpoint_dir = checkpoint_dir
        self.proc: asyncio.subprocess.Process | None = None
        self.pid = 0
        self.started_ts = 0.0
        self.started_mono = 0.0
        self.step = -1
        self.step_ts = 0.0
        self.sent_step = -1
        self.sent_mono = float("-inf")
        self.flusher: asyncio.Task[None] | None = None
        self.timing_mono = float("-inf")
        """When the last timing window was forwarded (at most one per MIN_TIMING_GAP_S)."""
        self.checkpoint: Checkpoint | None = None
        self.peer: ChannelPeer | None = None
        self.waiters: dict[str, tuple[asyncio.Future[Checkpoint], str]] = {}
        """request id -> (future, command id)"""
        self.stopping = False
        self.forced = False
        self.exit: ExitInfo | None = None
        self.exited = asyncio.Event()
        self.watcher: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        """Whether the process has not exited yet."""
        return self.exit is None


class Runner:
    """Runs members; one per job id on this node."""

    def __init__(
        self,
        identity: Callable[[], NodeIdentity],
        emit: Emit,
        settings: RunnerSettings,
        *,
        wall_clock: Callable[[], float] = time.time,
        dataset_dirs: Callable[[], Mapping[str, str]] = dict,
    ) -> None:
        """``dataset_dirs``: the node's dataset caches, name -> mountpoint ("" for one
        without a mount), read at every launch (the ``[[cache.datasets]]`` of agent.toml)."""
        self._identity = identity
        self._emit = emit
        self.settings = settings
        self._wall = wall_clock
        self._dataset_dirs = dataset_dirs
        self._members: OrderedDict[str, Member] = OrderedDict()
        self._oom: OrderedDict[int, float] = OrderedDict()
        """Pids the kernel's OOM killer killed (from the kernel log), newest last."""
        self._oom_waiters: dict[int, asyncio.Event] = {}
        self._silent = False
        self._channel = Channel(settings.socket_path, self._on_peer_message, self._on_peer_gone)

    async def start(self) -> None:
        """Open the client library's socket."""
        self.settings.work_dir.mkdir(parents=True, exist_ok=True)
        await self._channel.start()

    async def close(self) -> None:
        """Stop every running member gracefully (their exits are reported), close the socket."""
        running = [m for m in self._members.values() if m.running]
        await asyncio.gather(
            *(self.stop(m.spec.job_id, self.settings.stop_grace_s) for m in running),
            return_exceptions=True,
        )
        await self._channel.close()

    def abandon(self) -> None:
        """Act out a dead node (simulated fleets): SIGKILL every member now and report
        nothing more, neither their exits nor anything they still say."""
        self._silent = True
        for member in self._members.values():
            if member.running:
                _signal_group(member.pid, signal.SIGKILL)

    # --- verbs ----------------------------------------------------------------------
    async def launch(self, spec: LaunchSpec) -> Member:
        """Start a member; RunnerError when one of the job still runs here."""
        old = self._members.get(spec.job_id)
        if old is not None and old.running:
            raise RunnerError(f"job {spec.job_id} already runs here (pid {old.pid})", pid=old.pid)
        directory = self.settings.work_dir / f"{spec.job_id}.{spec.rank}"
        ckpt_dir = Path(spec.checkpoint_dir) if spec.checkpoint_dir else directory / "checkpoints"
        member = Member(spec, directory, ckpt_dir)
        try:
            out = await asyncio.to_thread(_prepare, directory, ckpt_dir, member.log_path)
        except OSError as exc:
            log.debug("job %s rank %d: cannot prepare %s: %s", spec.job_id, spec.rank,
                      directory, exc)  # fmt: skip
            raise RunnerError(
                f"cannot prepare {directory}: {exc}", "failed", **refusal(exc)
            ) from None
        member.log_offset = out.seek(0, os.SEEK_END)
        command = spec.command
        if command in ("python", "python3"):
            command = self.settings.python or sys.executable
        try:
            member.proc = await asyncio.create_subprocess_exec(
                command,
                *spec.args,
                cwd=directory,
                env=self._environment(spec, ckpt_dir),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_agent,
            )
        except OSError as exc:  # the controller logs it, once per generation
            log.debug("job %s rank %d generation %d: cannot run %r: %s", spec.job_id,
                      spec.rank, spec.generation, command, exc)  # fmt: skip
            raise RunnerError(f"cannot run {command!r}: {exc}", "failed", **refusal(exc)) from None
        finally:
            out.close()
        member.pid = member.proc.pid
        member.started_ts = self._wall()
        member.started_mono = time.monotonic()
        self._remember(member)
        member.watcher = asyncio.create_task(self._watch(member), name=f"job-{spec.job_id}")
        await self._publish(
            member,
            "job_started",
            f"job {spec.job_id} rank {spec.rank} started (pid {member.pid})",
            pid=member.pid,
            world_size=spec.world_size,
            resume_from=spec.resume_from,
            command_id=spec.command_id,
        )
        return member

    async def checkpoint(self, job_id: str, timeout_s: float, command_id: str = "") -> Checkpoint:
        """Ask a member to checkpoint; RunnerError on the deadline or when it is not running."""
        member = self._running(job_id)
        loop = asyncio.get_running_loop()
        if member.peer is not None and not member.peer.closed:
            request_id = uuid.uuid4().hex
            future: asyncio.Future[Checkpoint] = loop.create_future()
            member.waiters[request_id] = (future, command_id)
            try:
                await member.peer.send({"op": "checkpoint", "request_id": request_id})
                return await within(asyncio.shield(future), timeout_s)
            except TimeoutError:
                raise self._no_checkpoint(member, timeout_s) from None
            finally:
                member.waiters.pop(request_id, None)
        return await self._checkpoint_by_signal(member, timeout_s, command_id)

    async def stop(self, job_id: str, grace_s: float) -> ExitInfo | None:
        """SIGTERM the member's process group, SIGKILL after ``grace_s``; None if unknown."""
        member = self._members.get(job_id)
        if member is None:
            return None
        if member.running:
            member.stopping = True
            _signal_group(member.pid, signal.SIGTERM)
            try:
                await within(member.exited.wait(), grace_s)
            except TimeoutError:
                member.forced = True
                _signal_group(member.pid, signal.SIGKILL)
        await member.exited.wait()
        return member.exit

    def member(self, job_id: str) -> Member | None:
        """The member of ``job_id`` (running or exited, while remembered)."""
        return self._members.get(job_id)

    def members(self) -> list[Member]:
        """Every member remembered, oldest first."""
        return list(self._members.values())

    # --- internals ------------------------------------------------------------------
    def _environment(self, spec: LaunchSpec, ckpt_dir: Path) -> dict[str, str]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **spec.env}
        env.update(
            MG_JOB_ID=spec.job_id,
            MG_RANK=str(spec.rank),
            MG_WORLD_SIZE=str(spec.world_size),
            MG_MASTER_ADDR=spec.master_addr,
            MG_MASTER_PORT=str(spec.master_port),
            MG_CHECKPOINT_DIR=str(ckpt_dir),
            MG_RESUME_FROM=spec.resume_from,
            MG_CHECKPOINT_EVERY=str(spec.checkpoint_every),
            MG_TIMING_WINDOW_S=str(spec.timing_window_s),
            MG_WORKLOAD_SOCKET=self.settings.socket_path,
        )
        env.pop("MG_DATASET", None)  # only ever the job's own (never inherited)
        env.pop("MG_DATASET_DIR", None)
        if spec.dataset:
            env["MG_DATASET"] = spec.dataset
            mountpoint = self._dataset_dirs().get(spec.dataset, "")
            if mountpoint:
                env["MG_DATASET_DIR"] = mountpoint
            else:
                log.warning(
                    "job %s rank %d: dataset %r has no mount on this node (no such "
                    "[[cache.datasets]] entry, or it has no mountpoint): MG_DATASET_DIR not set",
                    spec.job_id, spec.rank, spec.dataset,
                )  # fmt: skip
        return env

    def _remember(self, member: Member) -> None:
        self._members.pop(member.spec.job_id, None)
        self._members[member.spec.job_id] = member
        while len(self._members) > KEEP_EXITED:
            oldest = next((k for k, m in self._members.items() if not m.running), None)
            if oldest is None:
                break
            del self._members[oldest]

    def _running(self, job_id: str) -> Member:
        member = self._members.get(job_id)
        if member is None or not member.running:
            raise RunnerError(f"job {job_id} does not run here")
        return member

    def _no_checkpoint(self, member: Member, timeout_s: float) -> RunnerError:
        last = member.checkpoint
        return RunnerError(
            f"no checkpoint within {timeout_s:g}s",
            "failed",
            last_step=last.step if last else -1,
            last_path=last.path if last else "",
        )

    async def _checkpoint_by_signal(
        self, member: Member, timeout_s: float, command_id: str
    ) -> Checkpoint:
        """SIGUSR1, then wait for a new file in the member's checkpoint dir."""
        before = _listing(member.checkpoint_dir)
        asked = time.time()
        with contextlib.suppress(ProcessLookupError):
            os.kill(member.pid, signal.SIGUSR1)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and member.running:
            fresh = _newest_since(member.checkpoint_dir, before, asked)
            if fresh is not None:
                step = step_from_name(fresh.name)
                ckpt = Checkpoint(step if step is not None else member.step, str(fresh), "signal")
                await self._checkpointed(member, ckpt, command_id)
                return ckpt
            await asyncio.sleep(SIGNAL_POLL_S)
        raise self._no_checkpoint(member, timeout_s)

    async def _checkpointed(self, member: Member, ckpt: Checkpoint, command_id: str) -> None:
        member.checkpoint = ckpt
        await self._publish(
            member,
            "job_checkpointed",
            f"job {member.spec.job_id} rank {member.spec.rank} checkpointed at step {ckpt.step}",
            step=ckpt.step,
            path=ckpt.path,
            method=ckpt.method,
            command_id=command_id,
        )

    def note_oom_kill(self, pid: int, ts: float) -> None:
        """The kernel log says the OOM killer killed ``pid`` (docs/kmsg.md): a member of
        that pid that dies of SIGKILL exits with the cause ``oom-killed``."""
        self._oom[pid] = ts
        while len(self._oom) > OOM_REMEMBER:
            self._oom.popitem(last=False)
        waiter = self._oom_waiters.get(pid)
        if waiter is not None:
            waiter.set()

    async def _exit_cause(self, member: Member, returncode: int) -> str:
        """``oom-killed`` when the kernel's OOM killer killed the member's process: its
        record may come a moment after the exit, so a SIGKILL this runner did not send
        waits up to ``OOM_WAIT_S`` for it."""
        if returncode != -signal.SIGKILL or member.stopping:
            return ""
        if member.pid not in self._oom:
            waiter = self._oom_waiters.setdefault(member.pid, asyncio.Event())
            try:
                await wait_event(waiter, OOM_WAIT_S)
            finally:
                self._oom_waiters.pop(member.pid, None)
        return "oom-killed" if member.pid in self._oom else ""

    async def _watch(self, member: Member) -> None:
        """Wait for the process to exit; report it."""
        assert member.proc is not None
        returncode = await member.proc.wait()
        cause = await self._exit_cause(member, returncode)
        _signal_group(member.pid, signal.SIGKILL)  # stragglers of the group
        if member.flusher is not None:
            member.flusher.cancel()
        output = await asyncio.to_thread(_tail, member.log_path, member.log_offset)
        member.exit = exit_info(
            returncode,
            stopped=member.stopping,
            forced=member.forced,
            step=member.step,
            runtime_s=time.monotonic() - member.started_mono,
            output=output,
            cause=cause,
        )
        for future, _cid in member.waiters.values():
            if not future.done():
                future.set_exception(RunnerError("the process exited", "failed"))
        if member.peer is not None:
            member.peer.close()
        member.exited.set()
        if self._silent:
            return
        event = exited_event(
            self._identity(),
            event_id=uuid.uuid4().hex,
            ts=self._wall(),
            job_id=member.spec.job_id,
            rank=member.spec.rank,
            info=member.exit,
            generation=member.spec.generation,
        )
        await self._emit(event)

    # --- the client library's messages ------------------------------------------------
    async def _on_peer_message(self, peer: ChannelPeer, msg: dict[str, object]) -> None:
        op = msg.get("op")
        if op == "hello":
            member = self._members.get(str(msg.get("job_id", "")))
            if member is not None and member.running:
                peer.member_key = member.spec.job_id
                member.peer = peer
            return
        member = self._members.get(peer.member_key or "")
        if member is None or member.peer is not peer:
            return
        if op == "progress":
            self._progress(member, _int(msg.get("step")))
        elif op == "timing":
            await self._timing(member, msg)
        elif op == "checkpoint_done":
            await self._checkpoint_done(member, msg)

    def _on_peer_gone(self, peer: ChannelPeer) -> None:
        member = self._members.get(peer.member_key or "")
        if member is not None and member.peer is peer:
            member.peer = None

    async def _checkpoint_done(self, member: Member, msg: dict[str, object]) -> None:
        step, path = _int(msg.get("step")), str(msg.get("path", ""))
        if step < 0 or not path:
            return
        request_id = msg.get("request_id")
        waiter = member.waiters.get(str(request_id)) if request_id else None
        if waiter is None:
            await self._checkpointed(member, Checkpoint(step, path, "periodic"), "")
            return
        future, command_id = waiter
        ckpt = Checkpoint(step, path, "socket")
        await self._checkpointed(member, ckpt, command_id)
        if not future.done():
            future.set_result(ckpt)

    def _progress(self, member: Member, step: int) -> None:
        if step < 0 or step == member.step:
            return
        member.step, member.step_ts = step, self._wall()
        if member.flusher is not None and not member.flusher.done():
            return  # the pending flush sends the newest step
        wait = member.sent_mono + self.settings.progress_interval_s - time.monotonic()
        member.flusher = asyncio.create_task(self._flush_progress(member, max(0.0, wait)))

    async def _flush_progress(self, member: Member, after_s: float) -> None:
        if after_s > 0:
            await asyncio.sleep(after_s)
        if member.step == member.sent_step or not member.running:
            return
        member.sent_step, member.sent_mono = member.step, time.monotonic()
        await self._publish(
            member,
            "job_progress",
            f"job {member.spec.job_id} rank {member.spec.rank} at step {member.step}",
            step=member.step,
            step_ts=member.step_ts,
        )

    async def _timing(self, member: Member, msg: dict[str, object]) -> None:
        """Forward one window of the rank's step timings as ``job_timing`` (docs/jobs.md
        "Stragglers"); malformed ones and more than one per ``MIN_TIMING_GAP_S`` are
        dropped (a script cannot flood the controller)."""
        window = timing_attributes(msg)
        now = time.monotonic()
        if window is None or now - member.timing_mono < MIN_TIMING_GAP_S:
            return
        member.timing_mono = now
        await self._publish(
            member,
            "job_timing",
            f"job {member.spec.job_id} rank {member.spec.rank}: {window['steps']} steps, "
            f"compute {window['compute_s']} s, collectives {window['comm_s']} s per step",
            **window,
        )

    async def _publish(self, member: Member, kind: str, message: str, **attrs: object) -> None:
        if self._silent:
            return
        event = job_event(
            self._identity(),
            kind,
            event_id=uuid.uuid4().hex,
            ts=self._wall(),
            job_id=member.spec.job_id,
            rank=member.spec.rank,
            message=message,
            generation=member.spec.generation,
            **attrs,  # type: ignore[arg-type]
        )
        await self._emit(event)


MIN_TIMING_GAP_S = 0.5
"""The shortest time between two forwarded timing windows of one member."""


def timing_attributes(msg: Mapping[str, object]) -> dict[str, int | float | str] | None:
    """The ``job_timing`` attributes of a client's ``timing`` message; None when it is
    malformed (a count or duration missing, negative or not a number; a bad role)."""
    out: dict[str, int | float | str] = {}
    for key in ("steps", "marked", "first_step", "last_step"):
        value = msg.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return None
        out[key] = value
    for key in ("compute_s", "comm_s", "elapsed_s"):
        value = msg.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            return None
        if not 0 <= value < 1e9:  # also NaN
            return None
        out[key] = float(value)
    role = msg.get("role", [])
    if not isinstance(role, list) or len(role) > 8:
        return None
    if any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in role):
        return None
    out["role"] = ",".join(str(r) for r in role)
    return out


def _load_prctl() -> Callable[..., int] | None:
    try:
        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl  # Linux libc
    except (OSError, AttributeError):
        return None
    return prctl


_PRCTL = _load_prctl()
PR_SET_PDEATHSIG = 1


def _die_with_agent() -> None:
    """In the child before exec: SIGKILL when the agent dies, so a dead agent never leaves
    a job running unwatched (under systemd its cgroup would be stopped anyway)."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL)


def _int(value: object) -> int:
    try:
        return int(value)  # type: ignore[call-overload, no-any-return]
    except (TypeError, ValueError):
        return -1


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _listing(directory: Path) -> dict[str, float]:
    try:
        return {e.name: e.stat().st_mtime for e in os.scandir(directory) if e.is_file()}
    except OSError:
        return {}


def _newest_since(directory: Path, before: dict[str, float], asked: float) -> Path | None:
    """A visible file that appeared (or changed) in ``directory`` since the listing."""
    best: tuple[float, str] | None = None
    for name, mtime in _listing(directory).items():
        if name.startswith(".") or name.endswith(".tmp"):
            continue
        if before.get(name) == mtime or mtime < asked - 1.0:
            continue
        if best is None or mtime > best[0]:
            best = (mtime, name)
    return directory / best[1] if best else None


def _prepare(directory: Path, ckpt_dir: Path, log_path: Path) -> BinaryIO:
    """Make the member's dirs; open its output file (handed to the child, then closed)."""
    directory.mkdir(parents=True, exist_ok=True)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    return open(log_path, "ab")


def _tail(path: Path, start: int) -> str:
    """The last bytes of this run's output (from ``start`` on)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(start, f.tell() - OUTPUT_TAIL_BYTES))
            return f.read().decode(errors="replace")
    except OSError:
        return ""
