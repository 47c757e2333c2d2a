"""The node's command handler: ``<p>.cmd.<region>.<cluster>.<node>.<verb>`` for the
workload verbs start, checkpoint, stop and status (docs/workloads.md), and gpu_reset
(a drained node's GPUs, docs/decisions.md).

Idempotent by ``command_id``: a repeated id returns the stored reply with ``duplicate``
set and is never executed twice (a repeat arriving while the first still runs waits for
its result).  The newest ``remember`` ids are kept.  Expired commands are rejected
unexecuted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from metalguard.agent.workload.gpu_reset import GpuResetter, parse_gpus
from metalguard.agent.workload.runner import LaunchSpec, Runner, RunnerError
from metalguard.agent.workload.timing import DEFAULT_WINDOW_S
from metalguard.proto.base import AttrValue, NodeIdentity
from metalguard.proto.codec import CodecError, decode, encode
from metalguard.proto.events import Command, CommandReply, CommandStatus
from metalguard.proto.subjects import Subjects

log = logging.getLogger(__name__)

VERBS: tuple[str, ...] = ("start", "checkpoint", "stop", "status", "gpu_reset")
Result = dict[str, AttrValue | list[str]]


class BadArgsError(ValueError):
    """A command's args are missing or of the wrong type."""


def _arg(args: Result, key: str, kind: type, default: Any = None) -> Any:
    value = args.get(key, default)
    if value is None and default is None:
        raise BadArgsError(f"args.{key} is required")
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if kind is list:
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
            raise BadArgsError(f"args.{key} must be a list of strings")
        return tuple(value)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise BadArgsError(f"args.{key} must be {kind.__name__}, got {type(value).__name__}")
    return value


def parse_start(command_id: str, args: Result) -> LaunchSpec:
    """The LaunchSpec of a ``start`` command's args; BadArgsError naming the bad one."""
    env: dict[str, str] = {}
    for item in _arg(args, "env", list, []):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise BadArgsError(f"args.env item {item!r} is not KEY=VALUE")
        env[key] = value
    job_id = _arg(args, "job_id", str)
    command = _arg(args, "command", str)
    if not job_id or not command:
        raise BadArgsError("args.job_id and args.command must not be empty")
    return LaunchSpec(
        job_id=job_id,
        command=command,
        args=_arg(args, "args", list, []),
        env=env,
        rank=_arg(args, "rank", int, 0),
        world_size=_arg(args, "world_size", int, 1),
        master_addr=_arg(args, "master_addr", str, "127.0.0.1"),
        master_port=_arg(args, "master_port", int, 29500),
        checkpoint_dir=_arg(args, "checkpoint_dir", str, ""),
        resume_from=_arg(args, "resume_from", str, ""),
        checkpoint_every=_arg(args, "checkpoint_every", float, 0.0),
        command_id=command_id,
        generation=_arg(args, "generation", int, 0),
        dataset=_arg(args, "dataset", str, ""),
        timing_window_s=_arg(args, "timing_window_s", float, DEFAULT_WINDOW_S),
    )


class CommandHandler:
    """Answers the workload verbs of one node, through ``runner``."""

    def __init__(
        self,
        identity: Callable[[], NodeIdentity],
        runner: Runner,
        *,
        remember: int = 1024,
        wall_clock: Callable[[], float] = time.time,
        gpu_reset: GpuResetter | None = None,
    ) -> None:
        self._identity = identity
        self._runner = runner
        self._gpu_reset = gpu_reset
        self._remember = remember
        self._wall = wall_clock
        self._done: OrderedDict[str, CommandReply] = OrderedDict()
        self._inflight: dict[str, asyncio.Future[CommandReply]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._subs: list[Subscription] = []
        self.executed = 0
        """Commands executed (not counting duplicates and rejections before execution)."""

    # --- the idempotent core ----------------------------------------------------------
    async def handle(self, cmd: Command) -> CommandReply:
        """The reply to ``cmd``; a known id gets its stored reply with ``duplicate``; a
        blank id is refused (every blank id would share one idempotency key)."""
        if not cmd.command_id.strip():
            return self._reply(
                cmd, False, CommandStatus.REJECTED, "command_id is empty: a command needs an id"
            )
        stored = self._done.get(cmd.command_id)
        if stored is not None:
            return msgspec.structs.replace(stored, duplicate=True)
        pending = self._inflight.get(cmd.command_id)
        if pending is not None:
            reply = await asyncio.shield(pending)
            return msgspec.structs.replace(reply, duplicate=True)
        future: asyncio.Future[CommandReply] = asyncio.get_running_loop().create_future()
        self._inflight[cmd.command_id] = future
        try:
            reply = await self._execute(cmd)
        except Exception as exc:  # never leave a requester without an answer
            log.exception("command %s (%s) failed", cmd.command_id, cmd.verb)
            reply = self._reply(cmd, False, CommandStatus.FAILED, f"internal error: {exc}")
        except BaseException:
            future.cancel()  # cancelled (shutdown): repeats waiting on it end too
            raise
        finally:
            self._inflight.pop(cmd.command_id, None)
        self._done[cmd.command_id] = reply
        while len(self._done) > self._remember:
            self._done.popitem(last=False)
        future.set_result(reply)
        return reply

    async def _execute(self, cmd: Command) -> CommandReply:
        me = self._identity()
        if (cmd.node.region, cmd.node.cluster, cmd.node.node) != (me.region, me.cluster, me.node):
            return self._reply(cmd, False, CommandStatus.REJECTED, "command for another node")
        now = self._wall()
        if cmd.expires_ts is not None and now > cmd.expires_ts:
            return self._reply(
                cmd, False, CommandStatus.REJECTED, f"expired {now - cmd.expires_ts:.1f}s ago"
            )
        if cmd.verb not in VERBS:
            return self._reply(cmd, False, CommandStatus.REJECTED, f"unknown verb {cmd.verb!r}")
        self.executed += 1
        try:
            match cmd.verb:
                case "start":
                    return await self._start(cmd)
                case "checkpoint":
                    return await self._checkpoint(cmd)
                case "stop":
                    return await self._stop(cmd)
                case "gpu_reset":
                    return await self._reset_gpus(cmd)
                case _:
                    return self._status(cmd)
        except BadArgsError as exc:  # sent again, the same args are refused again
            bad: Result = {"cause": "bad_args", "permanent": True}
            return self._reply(cmd, False, CommandStatus.REJECTED, str(exc), bad)
        except RunnerError as exc:
            result: Result = _result(exc.result)
            return self._reply(cmd, False, exc.status, str(exc), result)

    async def _start(self, cmd: Command) -> CommandReply:
        member = await self._runner.launch(parse_start(cmd.command_id, cmd.args))
        return self._reply(
            cmd,
            True,
            CommandStatus.DONE,
            f"started pid {member.pid}",
            {
                "job_id": member.spec.job_id,
                "rank": member.spec.rank,
                "generation": member.spec.generation,
                "pid": member.pid,
                "log": str(member.log_path),
                "started_ts": member.started_ts,
            },
        )

    async def _checkpoint(self, cmd: Command) -> CommandReply:
        job_id = _arg(cmd.args, "job_id", str)
        timeout = _arg(cmd.args, "timeout_s", float, self._runner.settings.checkpoint_timeout_s)
        ckpt = await self._runner.checkpoint(job_id, timeout, cmd.command_id)
        return self._reply(
            cmd,
            True,
            CommandStatus.DONE,
            f"checkpoint at step {ckpt.step}",
            {"job_id": job_id, "step": ckpt.step, "path": ckpt.path, "method": ckpt.method},
        )

    async def _stop(self, cmd: Command) -> CommandReply:
        job_id = _arg(cmd.args, "job_id", str)
        grace = _arg(cmd.args, "grace_s", float, self._runner.settings.stop_grace_s)
        was_running = (m := self._runner.member(job_id)) is not None and m.running
        info = await self._runner.stop(job_id, grace)
        if info is None:
            return self._reply(
                cmd, True, CommandStatus.DONE, "not running", {"job_id": job_id, "running": False}
            )
        return self._reply(
            cmd,
            True,
            CommandStatus.DONE,
            "stopped" if was_running else "had already exited",
            {
                "job_id": job_id,
                "running": False,
                "exit_code": info.exit_code,
                "signal": info.signal,
                "forced": info.forced,
                "step": info.step,
            },
        )

    async def _reset_gpus(self, cmd: Command) -> CommandReply:
        if self._gpu_reset is None:
            return self._reply(
                cmd, False, CommandStatus.REJECTED, "this agent resets no GPUs (no workload runner)"
            )
        try:
            gpus = parse_gpus(cmd.args.get("gpus"))
        except ValueError as exc:
            raise BadArgsError(str(exc)) from None
        done = await self._gpu_reset.reset(gpus)
        shown = ", ".join(f"gpu{g}" for g in gpus)
        return self._reply(cmd, True, CommandStatus.DONE, f"reset {shown}", _result(done))

    def _status(self, cmd: Command) -> CommandReply:
        job_id = cmd.args.get("job_id")
        if not job_id:
            jobs = [
                f"{m.spec.job_id}:{m.spec.rank}:{'running' if m.running else 'exited'}:{m.step}"
                for m in self._runner.members()
            ]
            return self._reply(cmd, True, CommandStatus.DONE, f"{len(jobs)} jobs", {"jobs": jobs})
        member = self._runner.member(str(job_id))
        if member is None:
            return self._reply(
                cmd, True, CommandStatus.DONE, "unknown", {"job_id": job_id, "state": "unknown"}
            )
        ckpt, info = member.checkpoint, member.exit
        return self._reply(
            cmd,
            True,
            CommandStatus.DONE,
            "running" if member.running else "exited",
            {
                "job_id": member.spec.job_id,
                "state": "running" if member.running else "exited",
                "generation": member.spec.generation,
                "pid": member.pid,
                "rank": member.spec.rank,
                "step": member.step,
                "step_ts": member.step_ts,
                "checkpoint_step": ckpt.step if ckpt else -1,
                "checkpoint_path": ckpt.path if ckpt else "",
                "exit_code": info.exit_code if info else None,
                "signal": info.signal if info else None,
                "digest": info.digest if info else "",
            },
        )

    def _reply(
        self, cmd: Command, ok: bool, status: str, message: str, result: Result | None = None
    ) -> CommandReply:
        return CommandReply(
            command_id=cmd.command_id,
            ts=self._wall(),
            ok=ok,
            status=status,
            message=message,
            result=result or {},
            node=self._identity(),
        )

    # --- NATS -------------------------------------------------------------------------
    async def subscribe(self, nc: Client, subjects: Subjects) -> None:
        """Subscribe to this node's workload verbs on ``nc`` (replacing older ones)."""
        await self.unsubscribe()
        me = self._identity()
        for verb in VERBS:
            subject = subjects.command(me.region, me.cluster, me.node, verb)
            self._subs.append(await nc.subscribe(subject, cb=self._on_msg))

    async def unsubscribe(self) -> None:
        """Drop the subscriptions (the client may already be closed)."""
        subs, self._subs = self._subs, []
        for sub in subs:
            try:
                await sub.unsubscribe()
            except Exception as exc:
                log.debug("unsubscribe: %s", exc)

    async def close(self) -> None:
        """Unsubscribe and wait for the commands being answered."""
        await self.unsubscribe()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _on_msg(self, msg: Msg) -> None:
        """Each command runs in its own task: a long checkpoint never blocks a status."""
        task = asyncio.create_task(self._answer(msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, msg: Msg) -> None:
        try:
            cmd = decode(msg.data, Command)
        except CodecError as exc:
            reply = CommandReply(
                command_id="",
                ts=self._wall(),
                ok=False,
                status=CommandStatus.REJECTED,
                message=f"undecodable command: {exc}",
                node=self._identity(),
            )
        else:
            verb = msg.subject.rsplit(".", 1)[-1]
            if cmd.verb != verb:
                reply = self._reply(
                    cmd, False, CommandStatus.REJECTED, f"verb {cmd.verb!r} sent on {verb!r}"
                )
            else:
                reply = await self.handle(cmd)
        if msg.reply:
            try:
                await msg.respond(encode(reply))
            except Exception as exc:
                log.warning("cannot answer command %s: %s", reply.command_id, exc)


def _result(values: dict[str, object]) -> Result:
    return {k: _scalar(v) for k, v in values.items()}


def _scalar(value: object) -> AttrValue | list[str]:
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, list | tuple):
        return [str(v) for v in value]
    return str(value)
