"""The fleet twin's shared records: what goes in (jobs, faults, the failure model, the
policy) and what comes out (the run's result), as plain frozen values.

Everything here is pure data; the modules that read files (:mod:`.fleet`,
:mod:`.trace`, :mod:`.generator`, :mod:`.failures`) build these, :mod:`.engine` runs
them, :mod:`.report` turns a :class:`TwinResult` into the JSON report.
Times are simulated seconds from the start of the run (0.0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from metalguard.controller.core import stragglers as straggler_detector
from metalguard.controller.jobs.scheduler import FleetNode
from metalguard.twin.sync import GangSegment, PlacementMode

DAY_S = 86_400.0

JobSource = Literal["trace", "gang"]
JobOutcome = Literal["succeeded", "failed"]
FaultKind = Literal["hardware", "software", "hang"]
"""``hardware``: the node breaks (its jobs are interrupted, it needs a repair);
``software``: a job's process crashes (the node is fine); ``hang``: a job stops making
progress without exiting (the node is fine)."""
Signal = Literal["", "gpu", "ecc", "pcie", "smart", "thermal", "network"]
"""The hardware signal a cause shows to metalguard's collectors (its precursor and its
fault): which synthesized telemetry :mod:`.signals` writes for it; "" for none."""
PolicyName = Literal["static", "reactive", "metalguard"]
AllocationMode = Literal["dedicated", "pooled"]
"""How the fleet is shared among tenants (docs/twin.md "Allocation"): ``dedicated``
partitions, each tenant's jobs on its own nodes only; ``pooled`` one pool under tenant
quotas (borrowing and reclaim)."""
ALLOCATION_MODES: tuple[AllocationMode, ...] = ("dedicated", "pooled")
POLICY_NAMES: tuple[PolicyName, ...] = ("static", "reactive", "metalguard")


@dataclass(frozen=True, slots=True)
class JobSpec:
    """One job of the workload: when it arrives, what it asks, how much work it is."""

    job_id: str
    submit_s: float
    nodes: int
    """Gang size (members, one per node)."""
    gpus_per_node: int
    """GPUs per member; 0 with cpu == 0 and memory_gb == 0: whole nodes."""
    work_s: float
    """Useful compute the job needs (seconds of progress), without overheads."""
    cpu: int = 0
    memory_gb: int = 0
    gpu_type: str = ""
    priority: int = 0
    preemptible: bool = False
    checkpoint_interval_s: float = 0.0
    """Seconds of progress between periodic checkpoints; 0: the job never checkpoints
    (an interruption loses everything done)."""
    checkpoint_cost_s: float = 0.0
    """Wall seconds one checkpoint pauses the job."""
    restart_cost_s: float = 0.0
    """Wall seconds from a (re)start until progress resumes (load, warm-up)."""
    outcome: JobOutcome = "succeeded"
    """How the job ends by itself once its work is done (a trace's failed task fails)."""
    source: JobSource = "trace"
    origin: str = ""
    """Where it came from, for errors: ``file.csv:row 17`` or ``gang generator #3``."""
    tenant: str = ""
    """The tenant it belongs to ("" : the twin's one default tenant; docs/twin.md
    "Allocation")."""
    min_nodes: int = 0
    """An elastic job's fewest members (0: ``nodes``; docs/twin.md "Elastic jobs"). Its
    ``work_s`` is at ``nodes`` members; at ``k`` it runs ``k / nodes`` as fast."""
    max_nodes: int = 0
    """An elastic job's most members (0: ``nodes``)."""
    resize_interval_s: float = 0.0
    """An elastic job's least time between growths."""

    @property
    def elastic(self) -> bool:
        """Whether it may run at more than one size."""
        return (self.max_nodes or self.nodes) > (self.min_nodes or self.nodes)

    @property
    def gpus(self) -> int:
        """GPUs the whole gang holds (whole-node jobs count their nodes' GPUs elsewhere)."""
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True, slots=True)
class Distribution:
    """A positive random duration in seconds: ``fixed`` (always ``mean_s``),
    ``exponential`` (mean ``mean_s``) or ``lognormal`` (median ``mean_s``, shape
    ``sigma``)."""

    kind: Literal["fixed", "exponential", "lognormal"] = "fixed"
    mean_s: float = 0.0
    sigma: float = 1.0


@dataclass(frozen=True, slots=True)
class FailureCause:
    """One row of the failure model (per cause)."""

    name: str
    rate_per_node_day: float
    kind: FaultKind = "hardware"
    signal: Signal = ""
    precursor_fraction: float = 0.0
    """Share of this cause's faults that show a precursor metalguard detects first."""
    lead_time: Distribution = Distribution("fixed", 0.0)
    """How long before the fault the precursor shows."""
    repair: Distribution = Distribution("fixed", 0.0)
    """Hands-on repair time of the node (hardware faults)."""


@dataclass(frozen=True, slots=True)
class Slowdown:
    """How much slower a fail-slow node computes (0.2: 20 % slower, the job's progress
    rate divided by 1.2): ``discrete`` (``values`` with their ``weights``), ``fixed`` (one
    value) or ``lognormal`` (median ``median``, shape ``sigma``, clipped to
    [``low``, ``high``])."""

    kind: Literal["fixed", "discrete", "lognormal"] = "discrete"
    values: tuple[float, ...] = ()
    weights: tuple[float, ...] = ()
    median: float = 0.0
    sigma: float = 0.0
    low: float = 0.0
    high: float = 1.0

    @property
    def mean(self) -> float:
        """The distribution's mean (a lognormal's before its clipping)."""
        if self.kind == "lognormal":
            return self.median * math.exp(self.sigma**2 / 2)
        total = sum(self.weights)
        if not self.values or total <= 0:
            return 0.0
        return sum(v * w for v, w in zip(self.values, self.weights, strict=True)) / total


DEFAULT_STRAGGLER_RATE_PER_NODE_DAY = 0.002
"""Fail-slow episodes per node-day when a model asks for stragglers without a rate (an
assumption, docs/twin.md "Stragglers": about half Llama 3's fail-stop rate; FALCON found
fail-slows in 16 of 27 large jobs, which this rate gives a job of 64 nodes over a week:
1 - exp(-0.002 x 448) = 0.59)."""
DEFAULT_SLOWDOWN = Slowdown(
    kind="discrete",
    values=(0.05, 0.10, 0.20, 0.30, 0.40, 0.60),
    weights=(10.0, 15.0, 20.0, 20.0, 20.0, 15.0),
)
"""5 % to 60 % slower, mean 0.29 (an assumption near FALCON's 1.34x average job
completion time of the jobs it hit); a tenth below the detector's 8 % threshold."""
DEFAULT_STRAGGLER_DURATION = Distribution("lognormal", 3600.0, 1.0)
"""How long a fail-slow lasts when nothing acts on it (it clears, or a person finds it by
hand): median 1 h, 1st-99th percentile 6 min-10 h (FALCON: "from tens of seconds to
nearly ten hours")."""
DEFAULT_STRAGGLER_REPAIR = Distribution("lognormal", 7200.0, 0.5)
"""Hands-on repair of a node drained as a straggler (reseat a cable, a fan, reset the
GPU clocks): median 2 h (an assumption)."""


@dataclass(frozen=True, slots=True)
class StragglerModel:
    """Fail-slow nodes: a Poisson rate per node-day, each episode's slowdown, how long it
    lasts when nothing acts on it, and the repair of a node drained for it. Rate 0 (the
    default): none."""

    rate_per_node_day: float = 0.0
    slowdown: Slowdown = DEFAULT_SLOWDOWN
    duration: Distribution = DEFAULT_STRAGGLER_DURATION
    repair: Distribution = DEFAULT_STRAGGLER_REPAIR


@dataclass(frozen=True, slots=True)
class FailureModel:
    """Per-node-day fault rates by cause, and the planned maintenance rate."""

    causes: tuple[FailureCause, ...]
    planned_rate_per_node_day: float = 0.0
    """Planned maintenance (a drain with notice, no fault) per node-day."""
    planned_duration: Distribution = Distribution("fixed", 3600.0)
    source: str = ""
    """Where the model came from (a file path, or "llama3 (default)")."""
    stragglers: StragglerModel = StragglerModel()
    """Fail-slow nodes (none unless asked for: ``[stragglers]``, ``--straggler-rate``)."""

    @property
    def total_rate_per_node_day(self) -> float:
        """Unplanned faults per node-day, all causes."""
        return sum(c.rate_per_node_day for c in self.causes)


@dataclass(frozen=True, slots=True)
class Fault:
    """One drawn fault: on which node, when, of which cause, and its precursor."""

    fault_id: int
    node: str
    """The node's handle."""
    at_s: float
    cause: str
    kind: FaultKind
    signal: Signal
    precursor_at_s: float | None
    """When the precursor shows (None: no precursor, the fault comes unannounced)."""
    repair_s: float


@dataclass(frozen=True, slots=True)
class Straggler:
    """One drawn fail-slow episode: a node computing ``slowdown`` slower from ``at_s`` for
    ``duration_s`` (unless repaired sooner); ``repair_s`` if it is drained for it."""

    straggler_id: int
    node: str
    at_s: float
    slowdown: float
    duration_s: float
    repair_s: float


@dataclass(frozen=True, slots=True)
class PlannedMaintenance:
    """One planned maintenance window of a node (announced ahead)."""

    node: str
    at_s: float
    duration_s: float


@dataclass(frozen=True, slots=True)
class Policy:
    """How a fleet is run: what notices faults, who repairs, how the queue works.

    The three named policies are in :data:`metalguard.twin.policies.POLICIES`; every
    parameter is stated in the report.
    """

    name: PolicyName
    auto_isolation: bool
    """The health system isolates a failing node and the job machine moves its jobs."""
    precursors: bool
    """Precursors are acted on: the node is graded by the real scoring, a sub-healthy
    node with running jobs is drained (checkpoint, then move)."""
    preemption: bool
    backfill: bool
    priorities: bool
    """False: every job counts as priority 0 (FIFO by submit time)."""
    hang_detection: bool
    """The job machine's hang timeout restarts a hung job (else a person notices)."""
    hang_timeout_s: float
    human_notice_s: float
    """How long until a person notices a fault, a dead job or a hang (no automation)."""
    resubmit_s: float
    """How long until a user resubmits a job that failed (static: no automatic restart)."""
    delivery_s: float
    """Getting a repaired node back into service (reinstall, burn-in, handover)."""
    pass_interval_s: float = 30.0
    """Queue passes run at most this often (the job manager's pass)."""
    straggler_detection: bool = False
    """The job manager's straggler detector (controller/core/stragglers.py; needs
    ``auto_isolation``): a node slower than its peers in a job of 2 nodes or more is
    marked SUB_HEALTHY (no new work) and the job moved off it when that pays."""
    straggler_window_s: float = 30.0
    """Seconds over which each rank's step timings are batched (``timing_window_s``)."""
    straggler_threshold: float = straggler_detector.DEFAULT_THRESHOLD
    straggler_persistence: int = straggler_detector.DEFAULT_PERSISTENCE
    straggler_warmup_windows: int = straggler_detector.DEFAULT_WARMUP_WINDOWS
    straggler_hold_s: float = DAY_S
    """How long a straggler mark keeps the node SUB_HEALTHY (its repair ends it sooner):
    the controller's ``[jobs] straggler_hold_s``."""

    @property
    def straggler_delay_s(self) -> float:
        """From a slowdown (or a generation's start) to the detector's verdict: the warm-up
        and persistence windows."""
        windows = self.straggler_warmup_windows + self.straggler_persistence
        return windows * self.straggler_window_s


@dataclass(frozen=True, slots=True)
class TwinInputs:
    """Everything one run needs; the same inputs and seed give the same result."""

    nodes: tuple[FleetNode, ...]
    jobs: tuple[JobSpec, ...]
    failures: FailureModel
    days: float
    seed: int
    workload: dict[str, object] = field(default_factory=dict)
    """The workload's stated parameters (trace file, generator settings), for the report."""
    placement: PlacementMode = "topology"
    """What the scheduler sees of the topology (``blind``: one rack of one cluster;
    :mod:`metalguard.twin.sync`)."""
    allocation: AllocationMode | None = None
    """None: one pool, no tenants (the twin's behaviour before issue 31)."""
    partitions: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Each tenant's contract as node handles (``dedicated``: where its jobs may run;
    ``pooled``: its guarantee is these nodes' GPUs)."""


@dataclass(frozen=True, slots=True)
class JobOutcomeRecord:
    """What happened to one job by the end of the run."""

    job_id: str
    source: JobSource
    gpus: int
    submit_s: float
    first_start_s: float | None
    end_s: float | None
    state: str
    """``succeeded``, ``failed``, ``running`` (at the end of the run) or ``queued``."""
    work_s: float
    done_s: float
    """Progress kept (useful work) by the end."""
    redone_s: float
    """Progress lost to interruptions (done again)."""
    held_s: float
    """Wall seconds the job held its nodes (placed to released)."""
    unplanned: int
    """Interruptions by a fault (hardware, software, hang)."""
    planned: int
    """Moves with notice: precursor drains, planned maintenance, preemptions."""
    queue_wait_s: tuple[float, ...]
    """Each wait in the queue: submit (or requeue) to placement."""
    slowed_s: float = 0.0
    """Wall seconds its progress lost to stragglers (it ran slower than its own pace)."""
    straggler_moves: int = 0
    """Moves off a straggler (the detector's, when moving paid)."""
    straggler_move_s: float = 0.0
    """What those moves cost by the job's own costs: a fresh checkpoint and a restart
    each (the wait in the queue not counted)."""
    waiting_s: float | None = None
    """A job still in the queue at the end: how long it has waited there so far (None:
    not waiting)."""
    held_gpu_s: float | None = None
    """An elastic job's GPU-seconds held (its size changes, so ``held_s x gpus`` is not
    it); None: a job of one size."""


@dataclass(frozen=True, slots=True)
class TimePoint:
    """One sample of the fleet (for the figure)."""

    t_s: float
    busy_gpus: int
    running_jobs: int
    in_service_nodes: int


@dataclass(frozen=True, slots=True)
class TwinResult:
    """The outcome of one run: per-job records, fleet totals, samples and faults."""

    policy: Policy
    inputs: TwinInputs
    jobs: tuple[JobOutcomeRecord, ...]
    gpu_seconds_available: float
    gpu_seconds_busy: float
    gpu_seconds_down: float
    """GPU-seconds of nodes out of service (failing, in repair, being delivered)."""
    faults: tuple[Fault, ...]
    """Every fault drawn for the run (hit a job or not)."""
    timeline: tuple[TimePoint, ...]
    events: int
    """Simulation events processed (for the benchmark)."""
    decisions: dict[str, int] = field(default_factory=dict)
    """Counts of the real code's decisions (grade changes, rail holds, placements,
    preemptions, moves) for the report."""
    stragglers: tuple[Straggler, ...] = ()
    """Every fail-slow episode drawn for the run."""
    segments: tuple[GangSegment, ...] = ()
    """Every multi-node gang's placements, from when to when (for the sync model)."""
    tenant_usage: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per tenant (with an allocation): GPU-seconds used, used inside its guarantee,
    borrowed and lent (:class:`metalguard.twin.allocation.TenantMeter`), reclaims made
    and suffered."""
