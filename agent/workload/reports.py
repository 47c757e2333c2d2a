"""Pure builders of the workload's NodeEvents and small parsers (docs/workloads.md)."""

from __future__ import annotations

import errno
import re
import signal
from dataclasses import dataclass

from metalguard.proto.base import AttrValue, NodeIdentity
from metalguard.proto.events import NodeEvent

SOURCE = "workload"
_DIGEST = re.compile(r"^digest=([0-9A-Za-z]+)\s*$", re.MULTILINE)
_FIRST_NUMBER = re.compile(r"(\d+)")


PERMANENT_ERRNOS: frozenset[int] = frozenset(
    {
        errno.ENOENT,  # no such file (the command, or the working directory)
        errno.ENOTDIR,
        errno.EACCES,  # permission denied (not executable, a directory)
        errno.EPERM,
        errno.ENOEXEC,  # exec format error (no #! line)
        errno.EISDIR,
        errno.ELOOP,
        errno.ENAMETOOLONG,
    }
)
"""Why a start will fail again however often it is tried (``permanent`` in the reply)."""


def refusal(exc: OSError) -> dict[str, AttrValue]:
    """The machine-readable cause of a refused start, next to its message (the start
    reply's ``result``: ``cause`` the errno name, ``errno``, ``permanent``)."""
    code = exc.errno
    name = errno.errorcode.get(code, "") if code is not None else ""
    return {
        "cause": name or type(exc).__name__,
        "errno": code,
        "permanent": code in PERMANENT_ERRNOS,
    }


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A checkpoint one member wrote."""

    step: int
    path: str
    method: str
    """socket | signal | periodic"""


@dataclass(frozen=True, slots=True)
class ExitInfo:
    """How a member's process ended."""

    exit_code: int | None
    signal: str | None
    stopped: bool
    forced: bool
    step: int
    runtime_s: float
    digest: str
    cause: str = ""
    """Why it was killed, when the node knows: ``oom-killed`` (the kernel's OOM killer,
    read from the kernel log; docs/kmsg.md)."""


def exit_info(
    returncode: int,
    *,
    stopped: bool,
    forced: bool,
    step: int,
    runtime_s: float,
    output: str,
    cause: str = "",
) -> ExitInfo:
    """An ExitInfo from a Popen-style return code (negative: killed by that signal)."""
    code: int | None = returncode
    sig: str | None = None
    if returncode < 0:
        code = None
        try:
            sig = signal.Signals(-returncode).name
        except ValueError:
            sig = f"SIG{-returncode}"
    return ExitInfo(
        code, sig, stopped, forced, step, round(runtime_s, 3), digest_from(output), cause
    )


def digest_from(output: str) -> str:
    """The value of the last ``digest=<hex>`` line of a workload's output, else ``""``."""
    found = _DIGEST.findall(output)
    return found[-1] if found else ""


def step_from_name(name: str) -> int | None:
    """The step a checkpoint file names: its first number (``ckpt-00000120.json`` → 120)."""
    m = _FIRST_NUMBER.search(name)
    return int(m.group(1)) if m else None


def job_event(
    node: NodeIdentity,
    kind: str,
    *,
    event_id: str,
    ts: float,
    job_id: str,
    rank: int,
    message: str,
    severity: str = "info",
    **attributes: AttrValue,
) -> NodeEvent:
    """One ``job_*`` NodeEvent; ``job_id`` and ``rank`` are always among the attributes."""
    return NodeEvent(
        node=node,
        event_id=event_id,
        ts=ts,
        kind=kind,
        source=SOURCE,
        device=job_id,
        severity=severity,
        message=message,
        attributes={"job_id": job_id, "rank": rank, **attributes},
    )


def exited_event(
    node: NodeIdentity,
    *,
    event_id: str,
    ts: float,
    job_id: str,
    rank: int,
    info: ExitInfo,
    generation: int = 0,
) -> NodeEvent:
    """``job_exited``: warning unless the exit code is 0."""
    how = f"exit code {info.exit_code}" if info.signal is None else f"signal {info.signal}"
    return job_event(
        node,
        "job_exited",
        event_id=event_id,
        ts=ts,
        job_id=job_id,
        rank=rank,
        message=f"job {job_id} rank {rank} exited ({how}) at step {info.step}",
        severity="info" if info.exit_code == 0 else "warning",
        exit_code=info.exit_code,
        signal=info.signal,
        stopped=info.stopped,
        forced=info.forced,
        step=info.step,
        runtime_s=info.runtime_s,
        digest=info.digest,
        generation=generation,
        **({"cause": info.cause} if info.cause else {}),
    )
