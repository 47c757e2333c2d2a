"""Job (what a tenant submits) and JobStatus (where it is and how it got there)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from proto.base import Message, NonNegInt, Record

Spread = Literal["rack", "cluster", "zone", "region"]
JobState = Literal[
    "queued",
    "placing",
    "running",
    "checkpointing",
    "rescheduling",
    "preempted",
    "succeeded",
    "failed",
    "cancelled",
]
TERMINAL_JOB_STATES: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]


class Job(Message, frozen=True, tag="job"):
    """A gang-scheduled training job as submitted."""

    job_id: str
    name: str
    tenant: str = "default"
    nodes: PositiveInt = 1
    gpus_per_node: NonNegInt = 0
    gpu_type: str = ""
    cpu: NonNegInt = 0
    memory_gb: NonNegInt = 0
    bandwidth_tier: NonNegInt = 0
    max_spread: Spread = "region"
    allowed_regions: tuple[str, ...] = ()
    max_latency_ms: float | None = None
    priority: int = 0
    preemptible: bool = False
    sensitive: bool = False
    command: str = ""
    args: tuple[str, ...] = ()
    env: dict[str, str] = {}
    checkpoint_dir: str = ""
    checkpoint_every: float = 0.0
    """Seconds between periodic checkpoints (0: only on request)."""
    hang_timeout: float = 0.0
    max_restarts: NonNegInt = 3
    submitted_ts: float = 0.0


class CheckpointRef(Record, frozen=True):
    """A checkpoint a job can resume from."""

    path: str
    step: NonNegInt
    ts: float


class JobTransition(Record, frozen=True):
    """One step of a job's history, with its reason."""

    ts: float
    state: JobState
    reason: str = ""
    from_nodes: tuple[str, ...] = ()
    to_nodes: tuple[str, ...] = ()
    step: NonNegInt | None = None


class JobStatus(Message, frozen=True, tag="job_status"):
    """Where a job is now and how it got there (KV ``MG_JOBS``)."""

    job_id: str
    state: JobState
    placement: tuple[str, ...] = ()
    """Node handles (``region.cluster.node``) of the gang, rank order."""
    restarts: NonNegInt = 0
    last_checkpoint: CheckpointRef | None = None
    history: tuple[JobTransition, ...] = ()
    updated_ts: float = 0.0
