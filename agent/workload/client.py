"""The client library a training script imports to talk to the metalguard agent.

Standard library only, so a script can import it (or copy it) anywhere.  Without an agent
(no ``MG_WORKLOAD_SOCKET``, or nothing listening there) every call is a cheap no-op.

Wire: newline-delimited JSON over a unix stream socket (docs/workloads.md).  The script
sends ``hello``, ``progress``, ``timing`` (one per window, docs/jobs.md "Stragglers") and
``checkpoint_done``; the agent sends ``checkpoint``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

from metalguard.agent.workload.timing import DEFAULT_WINDOW_S, MARK_KINDS, StepTimer

SOCKET_ENV = "MG_WORKLOAD_SOCKET"
WINDOW_ENV = "MG_TIMING_WINDOW_S"
SEND_TIMEOUT_S = 1.0
"""A send that cannot complete within this is dropped (the agent is stuck or gone)."""


@dataclass(frozen=True, slots=True)
class JobEnv:
    """What the runner tells the process through its environment."""

    job_id: str = ""
    rank: int = 0
    world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    checkpoint_dir: str = ""
    resume_from: str = ""
    checkpoint_every: float = 0.0
    timing_window_s: float = DEFAULT_WINDOW_S


def job_env(environ: dict[str, str] | None = None) -> JobEnv:
    """Read the ``MG_*`` variables (defaults for a run by hand)."""
    env = os.environ if environ is None else environ

    def num(key: str, default: float) -> float:
        try:
            return float(env.get(key, "") or default)
        except ValueError:
            return default

    return JobEnv(
        job_id=env.get("MG_JOB_ID", ""),
        rank=int(num("MG_RANK", 0)),
        world_size=int(num("MG_WORLD_SIZE", 1)),
        master_addr=env.get("MG_MASTER_ADDR", "") or "127.0.0.1",
        master_port=int(num("MG_MASTER_PORT", 29500)),
        checkpoint_dir=env.get("MG_CHECKPOINT_DIR", ""),
        resume_from=env.get("MG_RESUME_FROM", ""),
        checkpoint_every=num("MG_CHECKPOINT_EVERY", 0.0),
        timing_window_s=num(WINDOW_ENV, DEFAULT_WINDOW_S) or DEFAULT_WINDOW_S,
    )


class WorkloadClient:
    """One connection to the agent; every method is a no-op when not connected."""

    def __init__(
        self,
        sock: socket.socket | None,
        *,
        handle_sigusr1: bool = True,
        window_s: float = DEFAULT_WINDOW_S,
    ) -> None:
        self._sock = sock
        self._timer = StepTimer(window_s=window_s)
        self._buf = b""
        self._pending: list[str | None] = []
        """Checkpoint requests not yet answered (request ids; None for SIGUSR1)."""
        self._lock = threading.Lock()
        if handle_sigusr1 and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGUSR1, self._on_sigusr1)

    @property
    def connected(self) -> bool:
        """Whether an agent is listening."""
        return self._sock is not None

    def report_progress(self, step: int) -> None:
        """Heartbeat: ``step`` steps are done (the agent rate-limits what it forwards).
        It also ends the step's timing: a window's medians go out once it is due."""
        self._send({"op": "progress", "step": int(step)})
        if self._sock is not None and (window := self._timer.end_step(int(step))) is not None:
            self._send(window.message())

    def set_role(self, *role: int) -> None:
        """This rank's role, e.g. ``(pipeline_stage, tensor_slot)``: its timings are
        compared only with ranks of the same role (default: every rank is a peer)."""
        self._timer.role = tuple(int(r) for r in role)

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        """Time a block of the step's own work (forward, backward, optimizer)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self._timer.add(compute_s=time.perf_counter() - started)

    @contextlib.contextmanager
    def communicate(self) -> Iterator[None]:
        """Time a block spent in collectives (all-reduce, all-gather, barriers)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self._timer.add(comm_s=time.perf_counter() - started)

    def report_timing(self, compute_s: float, comm_s: float = 0.0) -> None:
        """Add measured durations to the step in progress (``torch.cuda.Event`` timings,
        in seconds), instead of or beside the blocks."""
        self._timer.add(compute_s=float(compute_s), comm_s=float(comm_s))

    def mark_step(self, kind: str = "checkpoint") -> None:
        """The step in progress is a ``checkpoint``, ``eval`` or ``other`` step that does
        not do the usual work: it is left out of the windows."""
        if kind not in MARK_KINDS:
            raise ValueError(f"mark_step: kind must be one of {sorted(MARK_KINDS)}, not {kind!r}")
        self._timer.mark()

    def checkpoint_requested(self) -> bool:
        """Whether a checkpoint was asked for (by the agent or SIGUSR1); never blocks."""
        self._poll()
        return bool(self._pending)

    def checkpoint_done(self, step: int, path: str) -> None:
        """Report a checkpoint written at ``step``: answers every pending request, or
        reports a periodic checkpoint when none is pending."""
        with self._lock:
            pending, self._pending = self._pending, []
        ids: list[str | None] = [rid for rid in pending if rid is not None] or [None]
        for rid in ids:
            self._send(
                {"op": "checkpoint_done", "step": int(step), "path": str(path), "request_id": rid}
            )

    def close(self) -> None:
        """Close the connection (the agent notices)."""
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()

    # --- internals ------------------------------------------------------------------
    def _on_sigusr1(self, _signum: int, _frame: FrameType | None) -> None:
        self._pending.append(None)

    def _send(self, obj: dict[str, Any]) -> None:
        if self._sock is None:
            return
        try:
            self._sock.sendall(json.dumps(obj).encode() + b"\n")
        except OSError:
            self.close()  # the agent is gone: carry on without it

    def _poll(self) -> None:
        if self._sock is None:
            return
        try:
            self._sock.setblocking(False)
            try:
                while True:
                    data = self._sock.recv(65536)
                    if not data:
                        self.close()
                        break
                    self._buf += data
            finally:
                if self._sock is not None:
                    self._sock.settimeout(SEND_TIMEOUT_S)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self.close()
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if isinstance(msg, dict) and msg.get("op") == "checkpoint":
                with self._lock:
                    self._pending.append(str(msg.get("request_id") or ""))


def connect(path: str | None = None, *, handle_sigusr1: bool = True) -> WorkloadClient:
    """Connect to the agent at ``path`` (default ``$MG_WORKLOAD_SOCKET``); never raises."""
    path = path if path is not None else os.environ.get(SOCKET_ENV, "")
    sock: socket.socket | None = None
    if path:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(SEND_TIMEOUT_S)
            sock.connect(path)
        except OSError:
            sock.close()
            sock = None
    env = job_env()
    wl = WorkloadClient(sock, handle_sigusr1=handle_sigusr1, window_s=env.timing_window_s)
    wl._send({"op": "hello", "job_id": env.job_id, "rank": env.rank, "pid": os.getpid()})
    return wl


_default: WorkloadClient | None = None


def _client() -> WorkloadClient:
    global _default
    if _default is None:
        _default = connect()
    return _default


def report_progress(step: int) -> None:
    """``report_progress`` on the default client."""
    _client().report_progress(step)


def checkpoint_requested() -> bool:
    """``checkpoint_requested`` on the default client."""
    return _client().checkpoint_requested()


def checkpoint_done(step: int, path: str) -> None:
    """``checkpoint_done`` on the default client."""
    _client().checkpoint_done(step, path)


def set_role(*role: int) -> None:
    """``set_role`` on the default client."""
    _client().set_role(*role)


def compute() -> contextlib.AbstractContextManager[None]:
    """``compute`` on the default client."""
    return _client().compute()


def communicate() -> contextlib.AbstractContextManager[None]:
    """``communicate`` on the default client."""
    return _client().communicate()


def report_timing(compute_s: float, comm_s: float = 0.0) -> None:
    """``report_timing`` on the default client."""
    _client().report_timing(compute_s, comm_s)


def mark_step(kind: str = "checkpoint") -> None:
    """``mark_step`` on the default client."""
    _client().mark_step(kind)
