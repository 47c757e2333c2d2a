"""NodeEvent (what must not wait for the next cycle) and ControllerEvent (decisions)."""

from __future__ import annotations

from metalguard.proto.base import AttrValue, Message, NodeIdentity, Reason, Token
from metalguard.proto.jobs import JOB_EVENT_KINDS

NODE_EVENT_KINDS: frozenset[str] = frozenset(
    {
        "ecc_uncorrectable",
        "aer_fatal",
        "aer_nonfatal",
        "link_downgrade",
        "smart_failed",
        "device_added",
        "device_removed",
        "device_changed",
        "device_bound",
        "device_unbound",
        "gpu_xid",
        "gpu_ecc_dbe",
        "gpu_row_remap_failure",
        "gpu_pcie_downgrade",
        "bmc_alert",
        "collector_failed",
        "qos_applied",
        "qos_partial",
        "qos_unsupported",
        "qos_failed",
        "qos_drift",
        "qos_degraded",
        "job_started",
        "job_exited",
        "job_progress",
        "job_timing",
        "job_checkpointed",
        "slurm_down",
        "slurm_up",
        "slurm_jobs",
    }
)
"""Kinds the agent (and the Slurm bridge, for Slurm's own view) emits today; consumers
must accept kinds they do not know."""
SLURM_JOBS_KIND = "slurm_jobs"
"""The Slurm bridge's count of a node's active Slurm jobs (attributes ``running``: int,
``jobs``: the job ids, comma-separated); the region controller takes it in as the node's
``NodeRecord.slurm_jobs`` (docs/slurm.md)."""

CONTROLLER_EVENT_KINDS: frozenset[str] = (
    frozenset(
        {
            "node.graded",
            "node.isolated",
            "node.sub_healthy",
            "node.maintenance",
            "node.unreachable",
            "node.returned",
            "node.held",
            "node.cordoned",
            "node.uncordoned",
            "node.straggler",
            "node.isolation_lost",
            "rail.tripped",
            "slurm.drained",
            "slurm.resumed",
            "slurm.job_signalled",
            "slurm.job_requeued",
            "slurm.skipped",
            "slurm.command_failed",
        }
    )
    | JOB_EVENT_KINDS
)
"""Documented decision kinds (docs/protocol.md); the set grows without a version bump."""


class NodeEvent(Message, frozen=True, tag="node_event"):
    """A hardware event published at once (``<p>.evt.<region>.<cluster>.<node>.<kind>``)."""

    node: NodeIdentity
    event_id: str
    """Unique per node; also the JetStream message id, so a retry never duplicates."""
    ts: float
    kind: Token
    source: str = ""
    """The collector that saw it (edac, pcie, smart, udev, bmc_*, gpu)."""
    device: str = ""
    """The component: DIMM label, PCI address, disk path, GPU index."""
    severity: str = "critical"
    """info | warning | critical"""
    message: str = ""
    attributes: dict[str, AttrValue] = {}


class ControllerEvent(Message, frozen=True, tag="controller_event"):
    """One decision of a region's controller (``<p>.ctl.<region>.<kind>``)."""

    event_id: str
    ts: float
    region: Token
    kind: str
    """Dotted, e.g. ``node.isolated``; each dot-separated part is a subject token."""
    node: NodeIdentity | None = None
    job_id: str | None = None
    reasons: tuple[Reason, ...] = ()
    message: str = ""
    command_id: str | None = None
    """The action this decision caused, if any (idempotency key of the executor)."""
    attributes: dict[str, AttrValue] = {}


class CommandStatus:
    """Values of ``CommandReply.status``."""

    DONE = "done"
    ACCEPTED = "accepted"
    REJECTED = "rejected"
    FAILED = "failed"


class Command(Message, frozen=True, tag="command"):
    """A request to one node (``<p>.cmd.<region>.<cluster>.<node>.<verb>``).

    Idempotent by ``command_id``: a node that has already executed an id answers with
    the stored reply and ``duplicate`` set, never executing twice.
    """

    command_id: str
    ts: float
    node: NodeIdentity
    verb: Token
    args: dict[str, AttrValue | list[str]] = {}
    expires_ts: float | None = None
    """After this wall-clock time the node rejects the command unexecuted."""
    issued_by: str = ""


class CommandReply(Message, frozen=True, tag="command_reply"):
    """The answer to a Command."""

    command_id: str
    ts: float
    ok: bool
    status: str = CommandStatus.DONE
    message: str = ""
    duplicate: bool = False
    result: dict[str, AttrValue | list[str]] = {}
    node: NodeIdentity | None = None
