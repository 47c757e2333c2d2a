#!/usr/bin/env python3
"""A deterministic stand-in for a training job (docs/workloads.md).

Its state is a SHA-256 chain, ``state[i+1] = sha256(state[i] || i)``, so the final line
``digest=<hex>`` depends only on the number of steps completed: the same whether or not
the run was interrupted and resumed from a checkpoint, and whatever the world size
(``MG_WORLD_SIZE``) of each run: an elastic job (docs/jobs.md "Elastic jobs") resumes a
checkpoint written by N ranks with M.  Standard library only; it uses the
metalguard client library when importable (``--no-client`` never imports it: SIGUSR1 only).

``--sync`` makes the ranks meet every step in a small TCP all-reduce (rank 0 at
``MG_MASTER_ADDR:MG_MASTER_PORT``), so a slow rank really makes the others wait: the
workload of the straggler tests, with flags for a straggler (``--slow-rank``) and for the
slowdowns by design that must blame no one (pipeline stages, evaluation steps, jitter,
a whole-job slowdown).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import selectors
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Protocol

SEED = b"metalguard-trainer"
JITTER_SEED = b"metalguard-trainer-jitter"
CKPT_NAME = re.compile(r"^ckpt-(\d{8})\.json$")
EXIT_STOPPED = 143
EXIT_RENDEZVOUS = 3
"""--sync: the ranks could not meet (rank 0 unreachable, a rank missing, resumed apart)."""
EXIT_PEER_LOST = 4
"""--sync: a peer disconnected, or sent nothing within --sync-timeout, during a step."""

FLAG_STOP = 1
FLAG_CHECKPOINT = 2
POLL_S = 0.1
"""How often a wait on peers looks at its deadline and at SIGTERM."""
STOP_WAIT_S = 3.0
"""After SIGTERM, how long a rank still waits for peers to finish the step together; past
it, it checkpoints the last step every rank completed and exits 143 alone."""
PEER_GONE_GRACE_S = 1.0
"""A lost peer may be a stop in progress (the agent stops every member, one by one): how
long a rank waits for its own SIGTERM before calling it a failure."""
MAX_LINE = 256


def initial_state() -> bytes:
    """The state before step 0."""
    return hashlib.sha256(SEED).digest()


def advance(state: bytes, step: int) -> bytes:
    """The state after step ``step`` (0-based) is done."""
    return hashlib.sha256(state + step.to_bytes(8, "big")).digest()


def state_after(steps: int) -> bytes:
    """The state after ``steps`` steps from scratch (what an uninterrupted run reaches)."""
    state = initial_state()
    for i in range(steps):
        state = advance(state, i)
    return state


def digest_after(steps: int) -> str:
    """The ``digest=`` value of a run of ``steps`` steps."""
    return state_after(steps).hex()


def _check(step: int, state_hex: str) -> str:
    return hashlib.sha256(f"{step}:{state_hex}".encode()).hexdigest()[:16]


def write_checkpoint(directory: Path, step: int, state: bytes, world_size: int = 1) -> Path:
    """Write ``ckpt-<step>.json`` atomically (tmp file + rename); return its path.

    ``world_size``: the ranks of the run that wrote it (said again on a resume at another
    size; the state itself is the same for every rank and every size)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"ckpt-{step:08d}.json"
    body = {
        "step": step,
        "state": state.hex(),
        "check": _check(step, state.hex()),
        "world_size": world_size,
    }
    tmp = directory / f".ckpt-{step:08d}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(body))
    os.replace(tmp, path)
    return path


def read_checkpoint(path: Path) -> tuple[int, bytes] | None:
    """(step, state) of a valid checkpoint file, else None."""
    try:
        body = json.loads(path.read_text())
        step, state_hex = int(body["step"]), str(body["state"])
        if body.get("check") != _check(step, state_hex) or step < 0:
            return None
        return step, bytes.fromhex(state_hex)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def checkpoint_world_size(path: Path) -> int | None:
    """The world size of the run that wrote a checkpoint (None: not recorded)."""
    try:
        size = json.loads(path.read_text()).get("world_size")
    except (OSError, ValueError, AttributeError):
        return None
    return size if isinstance(size, int) and size >= 1 else None


def newest_checkpoint(directory: Path) -> Path | None:
    """The valid checkpoint with the highest step in ``directory``."""
    if not directory.is_dir():
        return None
    found = sorted(
        (int(m.group(1)), p)
        for p in directory.iterdir()
        if (m := CKPT_NAME.match(p.name)) is not None
    )
    for _step, path in reversed(found):
        if read_checkpoint(path) is not None:
            return path
    return None


# --- how long a step's compute takes ---------------------------------------------------
def jitter_factor(step: int, jitter: float) -> float:
    """A pseudo-random factor in ``[1 - jitter, 1 + jitter]`` drawn from ``step`` alone:
    every rank draws the same one for the same step (a batch costlier for everyone)."""
    digest = hashlib.sha256(JITTER_SEED + step.to_bytes(8, "big")).digest()
    unit = int.from_bytes(digest[:8], "big") / float(1 << 64)
    return 1.0 + jitter * (2.0 * unit - 1.0)


def is_eval_step(step: int, eval_every: int) -> bool:
    """Whether step ``step`` (0-based) is an evaluation step: every ``eval_every``-th."""
    return eval_every > 0 and (step + 1) % eval_every == 0


class SlowFile:
    """``--slow-file``: the factor a file holds while it exists (1.0 without one), read
    again only when its modification time changes."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._seen: float | None = None
        self._factor = 1.0

    def factor(self) -> float:
        """The file's factor now (a missing or unreadable file: 1.0)."""
        if self.path is None:
            return 1.0
        try:
            mtime = self.path.stat().st_mtime
            if mtime != self._seen:
                self._seen, self._factor = mtime, max(0.0, float(self.path.read_text()))
        except (OSError, ValueError):
            self._seen, self._factor = None, 1.0
        return self._factor


def compute_factor(args: argparse.Namespace, rank: int, step: int, *, slow: bool = True) -> float:
    """How many ``--step-seconds`` the compute of step ``step`` takes on ``rank``
    (``slow``: whether the injected straggler, ``--slow-rank``, is on in this run)."""
    factor = 1.0
    if (
        slow
        and args.slow_rank is not None
        and rank == args.slow_rank
        and step >= args.slow_after_step
    ):
        factor *= args.slow_factor
    if args.heavy_stage is not None and rank % args.pipeline_stages == args.heavy_stage:
        factor *= args.heavy_factor
    if is_eval_step(step, args.eval_every):
        factor *= args.eval_factor
    if args.jitter > 0:
        factor *= jitter_factor(step, args.jitter)
    if step >= args.job_slowdown_after_step:
        factor *= args.job_slowdown
    return factor


# --- the client library, or SIGUSR1 alone ----------------------------------------------
class _Client(Protocol):
    def report_progress(self, step: int) -> None: ...
    def checkpoint_requested(self) -> bool: ...
    def checkpoint_done(self, step: int, path: str) -> None: ...
    def compute(self) -> contextlib.AbstractContextManager[None]: ...
    def communicate(self) -> contextlib.AbstractContextManager[None]: ...
    def set_role(self, *role: int) -> None: ...
    def mark_step(self, kind: str = "checkpoint") -> None: ...
    def close(self) -> None: ...


class _SignalOnly:
    """What the trainer uses without the client library: SIGUSR1 only, no timings."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGUSR1, self._on_usr1)

    def _on_usr1(self, _signum: int, _frame: FrameType | None) -> None:
        self.requested = True

    def report_progress(self, step: int) -> None:
        pass

    def checkpoint_requested(self) -> bool:
        return self.requested

    def checkpoint_done(self, step: int, path: str) -> None:
        self.requested = False

    def compute(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def communicate(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def set_role(self, *role: int) -> None:
        pass

    def mark_step(self, kind: str = "checkpoint") -> None:
        pass

    def close(self) -> None:
        pass


def _client(use_library: bool) -> _Client:
    if use_library:
        try:
            from metalguard import checkpoint as client
        except ImportError:
            pass
        else:
            return client.connect()
    return _SignalOnly()


# --- --sync: the ranks' all-reduce -----------------------------------------------------
class SyncError(Exception):
    """The ranks could not meet, or a peer was lost; ``code`` is the exit status."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class _StoppedWaitingError(Exception):
    """SIGTERM while waiting on peers that do not come: the step is given up."""


def master_host(addr: str) -> str:
    """``addr`` when it resolves, else 127.0.0.1 (a node name no DNS knows: one host)."""
    try:
        socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return "127.0.0.1"
    return addr


@dataclass
class _Conn:
    sock: socket.socket
    rank: int
    buf: bytes = b""

    def pop_line(self) -> str | None:
        if b"\n" not in self.buf:
            return None
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode("ascii", "replace").strip()

    def send(self, line: str) -> None:
        try:
            self.sock.sendall(line.encode() + b"\n")
        except OSError as e:
            raise SyncError(f"rank {self.rank} is gone: {e}", EXIT_PEER_LOST) from e


class SyncGroup:
    """The ranks of one job meeting every step: a star all-reduce through rank 0 over TCP
    (newline-delimited text). Each rank sends ``step <n> <flags>``; rank 0 ORs the flags
    (stop, checkpoint) and answers ``go <n> <flags>`` to every rank, so they all stop or
    checkpoint at the same step."""

    def __init__(
        self,
        rank: int,
        world: int,
        addr: str,
        port: int,
        *,
        timeout_s: float,
        connect_timeout_s: float,
        stopping: Callable[[], bool],
    ) -> None:
        if not 0 <= rank < world:
            raise SyncError(f"rank {rank} is not in a world of size {world}", EXIT_RENDEZVOUS)
        self.rank, self.world = rank, world
        self.host, self.port = master_host(addr), port
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self._stopping = stopping
        self.peers: list[_Conn] = []
        """Rank 0: a connection to every other rank; the others: the one to rank 0."""

    # rendezvous
    def meet(self, step: int) -> None:
        """Connect the ranks; every rank must start from ``step`` (the same resume)."""
        if self.world == 1:
            return
        deadline = time.monotonic() + self.connect_timeout_s
        if self.rank == 0:
            self._accept_all(step, deadline)
        else:
            self._join(step, deadline)

    def _accept_all(self, step: int, deadline: float) -> None:
        server = self._listen(deadline)
        try:
            waiting = set(range(1, self.world))
            while waiting:
                self._check_rendezvous(deadline, f"ranks {sorted(waiting)} did not join")
                try:
                    sock, _ = server.accept()
                except TimeoutError:
                    continue
                sock.settimeout(self.timeout_s)
                conn = _Conn(sock, -1)
                try:
                    hello = self._gather([conn], min(5.0, deadline - time.monotonic()), 0.0)
                except SyncError as e:
                    print(f"sync: dropped a connection: {e}", file=sys.stderr, flush=True)
                    sock.close()
                    continue
                fields = hello[-1].split()
                if len(fields) != 3 or fields[0] != "hello" or not fields[1].isdigit():
                    print(f"sync: dropped a stranger: {hello[-1]!r}", file=sys.stderr, flush=True)
                    sock.close()
                    continue
                peer, their_step = int(fields[1]), fields[2]
                if peer not in waiting:
                    sock.close()
                    raise SyncError(
                        f"rank {peer} joined twice or is not in a world of size {self.world}",
                        EXIT_RENDEZVOUS,
                    )
                if their_step != str(step):
                    sock.close()
                    raise SyncError(
                        f"rank {peer} starts from step {their_step}, rank 0 from step {step}:"
                        " the ranks must resume from the same checkpoint",
                        EXIT_RENDEZVOUS,
                    )
                conn.rank = peer
                self.peers.append(conn)
                waiting.discard(peer)
        finally:
            server.close()
        self.peers.sort(key=lambda c: c.rank)
        for conn in self.peers:
            conn.send(f"go {step}")

    def _listen(self, deadline: float) -> socket.socket:
        infos = socket.getaddrinfo(
            self.host, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        family, _, _, _, address = infos[0]
        while True:
            server = socket.socket(family, socket.SOCK_STREAM)
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                server.bind(address)
                server.listen(self.world)
            except OSError as e:
                server.close()
                self._check_rendezvous(deadline, f"cannot listen on {self.host}:{self.port}: {e}")
                time.sleep(POLL_S)
                continue
            server.settimeout(POLL_S)
            return server

    def _join(self, step: int, deadline: float) -> None:
        while True:
            try:
                remaining = max(0.05, min(1.0, deadline - time.monotonic()))
                sock = socket.create_connection((self.host, self.port), timeout=remaining)
                break
            except OSError as e:
                self._check_rendezvous(
                    deadline, f"cannot reach rank 0 at {self.host}:{self.port}: {e}"
                )
                time.sleep(POLL_S)
        sock.settimeout(self.timeout_s)
        conn = _Conn(sock, 0)
        self.peers = [conn]
        conn.send(f"hello {self.rank} {step}")
        try:
            line = self._gather([conn], max(0.0, deadline - time.monotonic()), 0.0)[0]
        except SyncError as e:
            raise SyncError(f"rendezvous: {e}", EXIT_RENDEZVOUS) from e
        if line != f"go {step}":
            raise SyncError(f"rank 0 answered {line!r} to hello", EXIT_RENDEZVOUS)

    def _check_rendezvous(self, deadline: float, why: str) -> None:
        if self._stopping():
            raise _StoppedWaitingError("stopped before the ranks met")
        if time.monotonic() >= deadline:
            within = f"within {self.connect_timeout_s:g}s"
            raise SyncError(f"the ranks did not meet {within}: {why}", EXIT_RENDEZVOUS)

    # every step
    def all_reduce(self, step: int, flags: int) -> int:
        """Wait for every rank to finish step ``step``; the OR of their flags."""
        if self.world == 1:
            return flags
        if self.rank == 0:
            lines = self._gather(self.peers, self.timeout_s, STOP_WAIT_S)
            for conn, line in zip(self.peers, lines, strict=True):
                flags |= self._parse(line, "step", step, conn.rank)
            for conn in self.peers:
                conn.send(f"go {step} {flags}")
            return flags
        master = self.peers[0]
        master.send(f"step {step} {flags}")
        return self._parse(self._gather([master], self.timeout_s, STOP_WAIT_S)[0], "go", step, 0)

    @staticmethod
    def _parse(line: str, word: str, step: int, rank: int) -> int:
        fields = line.split()
        if len(fields) != 3 or fields[0] != word or not fields[2].isdigit():
            raise SyncError(f"rank {rank} sent {line!r} at step {step}", EXIT_PEER_LOST)
        if fields[1] != str(step):
            raise SyncError(
                f"rank {rank} is at step {fields[1]}, this rank at step {step}", EXIT_PEER_LOST
            )
        return int(fields[2])

    def _gather(self, conns: list[_Conn], timeout_s: float, stop_wait_s: float) -> list[str]:
        """One line from each of ``conns`` (in their order), within ``timeout_s``.

        A peer's EOF or silence is a SyncError; after SIGTERM, the wait goes on for
        ``stop_wait_s`` (the peers stop together at the end of the step), then
        _StoppedWaitingError."""
        lines: dict[int, str] = {}
        for i, conn in enumerate(conns):
            if (line := conn.pop_line()) is not None:
                lines[i] = line
        deadline = time.monotonic() + timeout_s
        stop_since: float | None = None
        with selectors.DefaultSelector() as sel:
            for i, conn in enumerate(conns):
                if i not in lines:
                    sel.register(conn.sock, selectors.EVENT_READ, i)
            while len(lines) < len(conns):
                now = time.monotonic()
                if self._stopping():
                    stop_since = now if stop_since is None else stop_since
                    if now - stop_since >= stop_wait_s:
                        raise _StoppedWaitingError("stopped while waiting on peers")
                if now >= deadline:
                    missing = sorted(conns[i].rank for i in range(len(conns)) if i not in lines)
                    raise SyncError(
                        f"no word from rank(s) {missing} within {timeout_s:g}s", EXIT_PEER_LOST
                    )
                for key, _ in sel.select(max(0.0, min(POLL_S, deadline - now))):
                    i = int(key.data)
                    conn = conns[i]
                    try:
                        data = conn.sock.recv(4096)
                    except (BlockingIOError, InterruptedError, TimeoutError):
                        continue
                    except OSError as e:
                        raise SyncError(f"rank {conn.rank} is gone: {e}", EXIT_PEER_LOST) from e
                    if not data:
                        raise SyncError(f"rank {conn.rank} disconnected", EXIT_PEER_LOST)
                    conn.buf += data
                    if (line := conn.pop_line()) is not None:
                        lines[i] = line
                        sel.unregister(conn.sock)
                    elif len(conn.buf) > MAX_LINE:
                        raise SyncError(f"rank {conn.rank} sent garbage", EXIT_PEER_LOST)
        return [lines[i] for i in range(len(conns))]

    def close(self) -> None:
        for conn in self.peers:
            with contextlib.suppress(OSError):
                conn.sock.close()
        self.peers = []


# --- the command line and the run ------------------------------------------------------
def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, not {text}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (docs/workloads.md)."""
    env = os.environ
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--step-seconds", type=float, default=0.05)
    p.add_argument("--checkpoint-dir", default=env.get("MG_CHECKPOINT_DIR") or "checkpoints")
    p.add_argument(
        "--checkpoint-every", type=float, default=float(env.get("MG_CHECKPOINT_EVERY") or 0)
    )
    p.add_argument("--resume", default=env.get("MG_RESUME_FROM") or "none")
    p.add_argument("--hang-at-step", type=int, default=None)
    p.add_argument("--crash-at-step", type=int, default=None)
    p.add_argument("--fault-rank", type=int, default=None, help="default: every rank")
    p.add_argument("--faults-only-fresh", action="store_true")
    p.add_argument("--no-client", action="store_true")
    sync = p.add_argument_group("synchronous mode (straggler tests)")
    sync.add_argument("--sync", action="store_true", help="all-reduce among the ranks each step")
    sync.add_argument("--sync-timeout", type=_positive, default=120.0, help="seconds per step")
    sync.add_argument("--sync-connect-timeout", type=_positive, default=60.0)
    sync.add_argument("--slow-rank", type=int, default=None, help="the injected straggler")
    sync.add_argument("--slow-factor", type=_positive, default=1.0)
    sync.add_argument("--slow-after-step", type=int, default=0)
    sync.add_argument("--pipeline-stages", type=int, default=1, help="role: (rank %% K,)")
    sync.add_argument("--heavy-stage", type=int, default=None)
    sync.add_argument("--heavy-factor", type=_positive, default=1.0)
    sync.add_argument("--eval-every", type=int, default=0)
    sync.add_argument("--eval-factor", type=_positive, default=3.0)
    sync.add_argument("--jitter", type=float, default=0.0, help="in [0, 1)")
    sync.add_argument("--job-slowdown", type=_positive, default=1.0)
    sync.add_argument("--job-slowdown-after-step", type=int, default=0)
    sync.add_argument(
        "--slow-file",
        default=None,
        help="a file whose number (e.g. 1.3) multiplies this rank's compute while it exists "
        "(relative paths from the working directory; the demo's straggler fault writes one)",
    )
    args = p.parse_args(argv)
    if args.pipeline_stages < 1:
        p.error("--pipeline-stages must be >= 1")
    if args.heavy_stage is not None and not 0 <= args.heavy_stage < args.pipeline_stages:
        p.error("--heavy-stage must be in [0, --pipeline-stages)")
    if not 0 <= args.jitter < 1:
        p.error("--jitter must be in [0, 1)")
    if args.eval_every < 0:
        p.error("--eval-every must be >= 0")
    return args


def _resume(args: argparse.Namespace, ckpt_dir: Path) -> tuple[int, bytes, Path | None]:
    if args.resume == "none":
        return 0, initial_state(), None
    path = newest_checkpoint(ckpt_dir) if args.resume == "auto" else Path(args.resume)
    if path is None:
        return 0, initial_state(), None
    loaded = read_checkpoint(path)
    if loaded is None:
        print(f"invalid checkpoint {path}", file=sys.stderr, flush=True)
        raise SystemExit(2)
    return loaded[0], loaded[1], path


@dataclass
class _Run:
    """The steps every rank has completed, and the state after them."""

    step: int
    state: bytes
    world: int = 1
    """MG_WORLD_SIZE of this run (recorded in its checkpoints)."""
    waited_s: float = 0.0
    """Time spent in the all-reduce (--sync)."""


def main(argv: list[str] | None = None) -> int:
    """Run the trainer; return the exit status."""
    args = parse_args(argv)
    rank = int(os.environ.get("MG_RANK") or 0)
    world = int(os.environ.get("MG_WORLD_SIZE") or 1)
    ckpt_dir = Path(args.checkpoint_dir)
    step, state, resumed = _resume(args, ckpt_dir)
    if resumed is not None:
        print(f"resumed step={step} path={resumed}", flush=True)
        written = checkpoint_world_size(resumed)
        if written is not None and written != world:  # a real trainer reshards here
            print(f"resized world_size={written}->{world}", flush=True)
    faults_on = not (args.faults_only_fresh and resumed is not None)
    stop: dict[str, Any] = {"now": False}

    def on_term(_signum: int, _frame: FrameType | None) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_term)
    wl = _client(not args.no_client)
    if args.pipeline_stages > 1:
        wl.set_role(rank % args.pipeline_stages)
    wl.report_progress(step)
    print(f"start step={step} rank={rank}", flush=True)  # signal handlers are in place
    group: SyncGroup | None = None
    run = _Run(step, state, world)

    def stopped() -> int:
        path = write_checkpoint(ckpt_dir, run.step, run.state, run.world)
        wl.checkpoint_done(run.step, str(path))
        print(f"checkpoint step={run.step} path={path}", flush=True)
        if group is not None:
            print(f"waited_s={run.waited_s:.6f}", flush=True)
        print(f"stopped step={run.step}", flush=True)
        return EXIT_STOPPED

    try:
        if args.sync:
            env = os.environ
            group = SyncGroup(
                rank,
                world,
                env.get("MG_MASTER_ADDR") or "127.0.0.1",
                int(env.get("MG_MASTER_PORT") or 29500),
                timeout_s=args.sync_timeout,
                connect_timeout_s=args.sync_connect_timeout,
                stopping=lambda: bool(stop["now"]),
            )
            group.meet(step)
            print(f"sync rank={rank} world={group.world}", flush=True)
        return _train(args, rank, faults_on, wl, group, run, stop, stopped)
    except _StoppedWaitingError:
        return stopped()  # the last step every rank completed
    except SyncError as e:
        deadline = time.monotonic() + PEER_GONE_GRACE_S
        while not stop["now"] and time.monotonic() < deadline:
            time.sleep(0.02)  # a stop in progress reaches the ranks one by one
        if stop["now"]:
            return stopped()
        print(f"sync: rank {rank} at step {run.step}: {e}", file=sys.stderr, flush=True)
        return e.code
    finally:
        if group is not None:
            group.close()
        wl.close()


def _train(
    args: argparse.Namespace,
    rank: int,
    faults_on: bool,
    wl: _Client,
    group: SyncGroup | None,
    run: _Run,
    stop: dict[str, Any],
    stopped: Callable[[], int],
) -> int:
    hang_crash = faults_on and (args.fault_rank is None or args.fault_rank == rank)
    slow_file = SlowFile(Path(args.slow_file) if args.slow_file else None)
    last_periodic = time.monotonic()
    while run.step < args.steps:
        step = run.step
        if hang_crash and args.crash_at_step is not None and step >= args.crash_at_step:
            print(f"crash step={step}", flush=True)
            return 1
        if hang_crash and args.hang_at_step is not None and step >= args.hang_at_step:
            print(f"hang step={step}", flush=True)
            while not stop["now"]:  # no step is ever taken again; SIGTERM still ends it
                time.sleep(0.05)
            return EXIT_STOPPED
        with wl.compute():
            factor = compute_factor(args, rank, step, slow=faults_on)
            time.sleep(args.step_seconds * factor * slow_file.factor())
        periodic = args.checkpoint_every > 0 and (
            time.monotonic() - last_periodic >= args.checkpoint_every
        )
        flags = (FLAG_STOP if stop["now"] else 0) | (
            FLAG_CHECKPOINT if wl.checkpoint_requested() or periodic else 0
        )
        if group is not None:
            started = time.perf_counter()
            with wl.communicate():
                flags = group.all_reduce(step, flags)
            run.waited_s += time.perf_counter() - started
        run.state = advance(run.state, step)
        run.step = step + 1
        if is_eval_step(step, args.eval_every):
            wl.mark_step("eval")
        if flags:
            wl.mark_step("checkpoint")
        wl.report_progress(run.step)
        if flags & FLAG_STOP:
            return stopped()
        if flags & FLAG_CHECKPOINT:
            path = write_checkpoint(Path(args.checkpoint_dir), run.step, run.state, run.world)
            wl.checkpoint_done(run.step, str(path))
            last_periodic = time.monotonic()
            print(f"checkpoint step={run.step} path={path}", flush=True)
    if group is not None:
        print(f"waited_s={run.waited_s:.6f}", flush=True)
    print(f"steps={run.step}", flush=True)
    print(f"digest={run.state.hex()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
