"""``node.isolation_lost``: a sensitive job runs on a node whose DMA isolation posture is
no longer ``isolated`` (docs/security.md "DMA isolation"). Pure: which (job, node) pairs
to announce; the job manager publishes them. The job is not stopped: an operator
decides (a posture can drop for a reason they chose, such as ACS turned off for
GPUDirect peer-to-peer)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from metalguard.proto.jobs import JobStatus
from metalguard.proto.nodes import NodeRecord

ISOLATION_LOST = "node.isolation_lost"
WATCHED_STATES = frozenset({"running", "checkpointing"})


@dataclass(frozen=True, slots=True)
class Lost:
    """One sensitive job's node that lost its isolation, in one generation."""

    job_id: str
    handle: str
    generation: int
    posture: str
    reasons: tuple[str, ...]

    @property
    def event_id(self) -> str:
        """Deterministic: one announcement per job, node, generation and posture."""
        return f"{self.job_id}.{self.handle}.g{self.generation}.isolation_lost.{self.posture}"


def lost_isolation(jobs: Iterable[JobStatus], records: Mapping[str, NodeRecord]) -> list[Lost]:
    """Each node of a running sensitive job whose reported posture is not ``isolated``
    (a node that never reported one is not announced: it was never placed there)."""
    out = []
    for status in jobs:
        job = status.job
        if job is None or not job.sensitive or status.state not in WATCHED_STATES:
            continue
        for handle in status.placement:
            record = records.get(handle)
            if record is None or record.dma_posture in ("", "isolated"):
                continue
            out.append(
                Lost(status.job_id, handle, status.generation, record.dma_posture,
                     record.dma_reasons)
            )  # fmt: skip
    return out
