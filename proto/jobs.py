"""Job (what a tenant submits) and JobStatus (where it is and how it got there)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from metalguard.proto.base import Message, NonNegInt, Record

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
MoveCause = Literal[
    "node_failing",
    "maintenance",
    "preempted",
    "hang",
    "crash",
    "lost",
    "operator",
    "straggler",
    "resized",
]
MoveTarget = Literal["place", "queue", "failed", "cancelled"]
MovePhase = Literal["checkpointing", "stopping", "placing", "starting"]
"""The steps of a move, in order; each is recorded in MG_JOBS before it is taken."""
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
    hang_timeout: float | None = None
    """Seconds a member's step may stand still before the job is hung (0: never; None: the
    controller's ``[jobs] hang_timeout_s``, which waits for a member's first progress)."""
    max_restarts: NonNegInt = 3
    submitted_ts: float = 0.0
    dataset: str = ""
    """The dataset the job reads (a ``[[cache.datasets]]`` name, docs/cache.md): among
    placements equal in topology the scheduler prefers nodes where it is warm, and each
    member gets ``MG_DATASET`` and ``MG_DATASET_DIR`` (the node's mount of it)."""
    timing_window_s: float = 30.0
    """Seconds over which each rank's step timings are batched (``MG_TIMING_WINDOW_S``;
    docs/jobs.md "Stragglers")."""
    total_steps: NonNegInt = 0
    """The steps a full run takes (0: not said): with the measured step time it gives the
    remaining run time that decides whether moving off a straggler pays."""
    restart_cost_s: float | None = None
    """What a restart costs the job in seconds (start-up, checkpoint load, warm-up);
    None: the controller's ``[jobs] straggler_restart_cost_s``."""
    min_nodes: PositiveInt | None = None
    """Elastic jobs (docs/jobs.md "Elastic jobs"): the fewest members it runs with (None:
    ``nodes``); it starts with as many as fit in ``[min_nodes, max_nodes]`` and is shrunk,
    never below this, instead of being preempted whole."""
    max_nodes: PositiveInt | None = None
    """The most members it grows to when nodes are idle (None: ``nodes``).  The job is
    elastic when its ``max_nodes`` is above its ``min_nodes``; ``nodes`` (within both) is
    the size it waits, reserves and preempts for when it cannot start now."""
    resize_interval_s: float = 300.0
    """Seconds from the job's last start or resize before it may grow again (each resize
    restarts it from a fresh checkpoint)."""


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


class MemberState(Record, frozen=True):
    """One rank of a running gang: where it runs and how far it got."""

    rank: NonNegInt
    node: str
    """Node handle ``region.cluster.node``."""
    step: NonNegInt = 0
    progress_ts: float = 0.0
    """Controller time the step last advanced (or the member started)."""
    exit_code: int | None = None
    """Set once the member's process exited (``-signal`` when killed by one)."""
    digest: str = ""
    """The workload's final ``digest=`` line, when it printed one."""
    exit_cause: str = ""
    """Why the process was killed, when its node knows: ``oom-killed``."""


class JobMove(Record, frozen=True):
    """A move or restart in progress: the durable plan a restarted controller finishes."""

    move_id: str
    """Unique per move; command ids of the move derive from it (idempotent retries)."""
    cause: MoveCause
    phase: MovePhase
    started_ts: float
    phase_ts: float
    """When the current phase began (its deadline counts from here)."""
    from_nodes: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    """Nodes the job must not be placed on again (the bad ones)."""
    checkpoint: CheckpointRef | None = None
    """The checkpoint chosen to resume from (set when leaving ``checkpointing``)."""
    fresh: bool = False
    """Whether ``checkpoint`` was taken by this move (else: the last periodic one)."""
    last_step: NonNegInt = 0
    """The furthest step any member had reached when the move began."""
    target: MoveTarget = "place"
    """After stopping: place again (``place``), back to the queue (``queue``: preemption),
    or end the job (``failed``, ``cancelled``)."""
    not_before_ts: float = 0.0
    """No start is sent before this time (the backoff after a refused start; 0: none)."""
    to_nodes: tuple[str, ...] = ()
    """An elastic job's resize: the placement it starts on once stopped (rank order),
    held for it meanwhile (docs/jobs.md "Elastic jobs"); empty: the queue pass places it."""


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
    job: Job | None = None
    """The job as submitted (the MG_JOBS value carries both)."""
    generation: NonNegInt = 0
    """Incremented at every start; start/stop command ids derive from it."""
    members: tuple[MemberState, ...] = ()
    move: JobMove | None = None
    resumed_from_step: NonNegInt | None = None
    """The step the latest start resumed from (None: started from scratch)."""
    steps_redone: NonNegInt = 0
    """Steps computed again after resuming from a checkpoint older than the progress."""
    downtime_s: float = 0.0
    """Seconds the job spent not running between its first start and now (moves)."""
    crashes: NonNegInt = 0
    """Restarts caused by a crash or a hang (counted against ``max_restarts``)."""
    digest: str = ""
    """The final ``digest=`` line of rank 0 once the job succeeded."""
    reason: str = ""
    """Why it is in its state (failed, cancelled, preempted)."""
    cancel_requested: bool = False


JOB_EVENT_KINDS: frozenset[str] = frozenset(
    {
        "job.queued",
        "job.placed",
        "job.started",
        "job.checkpointed",
        "job.stopped",
        "job.rescheduled",
        "job.lost_progress",
        "job.hung",
        "job.crashed",
        "job.failed",
        "job.finished",
        "job.preempted",
        "job.cancelled",
        "job.slowed",
        "job.resized",
        "tenant.reclaim",
    }
)
"""The ControllerEvent kinds of the job manager (docs/protocol.md, docs/jobs.md)."""
