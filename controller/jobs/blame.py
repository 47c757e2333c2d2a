"""Which nodes the failures of jobs point at (docs/jobs.md "Blame"). Pure.

A job's generation fails on a node when a member there crashed or hung while the job's
other members (on other nodes) did not: the node, not the job, is then the likely cause.
The same application XID (NVIDIA's ``app`` class: 13, 31, ...) on the same GPU of a node
while different jobs ran there points at that GPU too (NVIDIA's advice for 13 and 31: run
diagnostics when the error follows the GPU, not the job): each job running on the node
when it came is blamed, counted per GPU and XID. A node blamed by the failures of
``min_jobs`` different jobs within ``window_s`` (crashes and hangs together, or one GPU's
XID) is a suspect: the region controller keeps it SUB_HEALTHY (no new work; its jobs finish), and
the failed jobs' own restarts, which go back to the same nodes only when all are
HEALTHY, are placed without it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from metalguard.proto.base import AttrValue
from metalguard.proto.jobs import MemberState
from metalguard.proto.xid import classify

FAILURE_KINDS = frozenset({"job.crashed", "job.hung"})
"""The job events whose members' nodes are blamed."""
NOT_THE_NODES = frozenset({"oom-killed"})
"""Crash causes that are the workload's, never its node's: the kernel's OOM killer
killed the process (docs/kmsg.md)."""


FAILED = "failed"
"""The cause of a crashed or hung generation (an XID's cause names the GPU and XID)."""


@dataclass(frozen=True, slots=True)
class Failure:
    """One failed generation of one job, or one application XID under it, blamed on one
    node."""

    node: str
    job_id: str
    ts: float
    cause: str = FAILED
    """What is counted together: ``failed``, or ``XID <n> on gpu<i>``."""


def xid_failures(
    node: str, attributes: Mapping[str, AttrValue], job_ids: Iterable[str], ts: float
) -> list[Failure]:
    """The failures a ``gpu_xid`` event on ``node`` blames, one per job running there
    (``job_ids``): only for an XID of the ``app`` class on a known GPU."""
    xid, index = attributes.get("xid"), attributes.get("index")
    if not isinstance(xid, int) or not isinstance(index, int) or isinstance(xid, bool):
        return []
    if classify(xid).xid_class != "app":
        return []
    cause = f"XID {xid} on gpu{index}"
    return [Failure(node, job_id, ts, cause) for job_id in sorted(set(job_ids))]


def blamed_nodes(
    kind: str, attributes: Mapping[str, AttrValue], members: Sequence[MemberState]
) -> tuple[str, ...]:
    """The nodes a ``job.crashed`` or ``job.hung`` event blames: the crashed rank's node,
    or the hung members' nodes, when the job's other members' nodes are not among them
    (a job whose every node failed blames none of them: the job itself is the likely
    cause), or the job has one node."""
    if kind not in FAILURE_KINDS or attributes.get("cause") in NOT_THE_NODES:
        return ()
    listed = attributes.get("node") if kind == "job.crashed" else attributes.get("nodes")
    failed = {n for n in str(listed or "").split(",") if n}
    every = {m.node for m in members}
    if not failed or (failed >= every and len(every) > 1):
        return ()
    return tuple(sorted(failed))


def suspects(
    failures: Iterable[Failure], now: float, window_s: float, min_jobs: int
) -> dict[str, tuple[str, ...]]:
    """Node → the different jobs (sorted) blaming it within the window, for the nodes
    blamed by at least ``min_jobs`` of them for one cause (failed generations, or one
    GPU's XID)."""
    jobs: dict[tuple[str, str], set[str]] = {}
    for f in failures:
        if f.ts > now - window_s:
            jobs.setdefault((f.node, f.cause), set()).add(f.job_id)
    found: dict[str, set[str]] = {}
    for (node, _cause), ids in jobs.items():
        if len(ids) >= min_jobs:
            found.setdefault(node, set()).update(ids)
    return {node: tuple(sorted(ids)) for node, ids in found.items()}


def recent(failures: Iterable[Failure], now: float, window_s: float) -> list[Failure]:
    """The failures still inside the window."""
    return [f for f in failures if f.ts > now - window_s]
