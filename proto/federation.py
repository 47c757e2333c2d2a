"""What regions tell each other (docs/federation.md): summaries, node and job lookups,
forwarded jobs, pings."""

from __future__ import annotations

from metalguard.proto.base import Message, NonNegInt, Record
from metalguard.proto.jobs import Job, JobStatus
from metalguard.proto.nodes import NodeRecord


class GpuCapacity(Record, frozen=True):
    """A region's nodes of one GPU type (``""``: nodes without GPUs)."""

    gpu_type: str
    nodes: NonNegInt
    healthy_nodes: NonNegInt
    """HEALTHY and not cordoned: where new work may go."""
    gpus: NonNegInt
    healthy_gpus: NonNegInt
    free_nodes: NonNegInt | None = None
    """Healthy nodes that no unfinished job holds: where a new gang may go now (None: a
    region that does not tell; its ``healthy_nodes`` stand in)."""
    free_in: dict[str, NonNegInt] = {}
    """The most free nodes within one ``rack``, one ``cluster`` and one ``zone`` (the
    levels of a job's ``max_spread``); empty: a region that does not tell."""


class RegionSummary(Message, frozen=True, tag="region_summary"):
    """One region's state for the others (``<p>.fed.summary.<region>``, every interval)."""

    region: str
    ts: float
    """When the summary was made (the publishing controller's clock)."""
    interval_s: float
    """How often the region publishes one: older than 3 intervals is stale."""
    controller: str = ""
    """The publishing controller (its HA instance name, if any)."""
    nodes: NonNegInt = 0
    grades: dict[str, NonNegInt] = {}
    capacity: tuple[GpuCapacity, ...] = ()
    queued_jobs: NonNegInt = 0
    running_jobs: NonNegInt = 0


class NodeLookup(Message, frozen=True, tag="node_lookup"):
    """Which region knows the node with this UUID (request, ``<p>.fed.lookup.<region>``)."""

    uuid: str


class NodeLookupReply(Message, frozen=True, tag="node_lookup_reply"):
    """The answer: the node's region, handle and record, or ``found`` false.  Also the
    answer to a request on ``<p>.fed.lookup.<region>`` that is no lookup at all (``error``
    ``rejected``, ``reasons`` why)."""

    uuid: str
    found: bool
    region: str = ""
    handle: str = ""
    record: NodeRecord | None = None
    error: str = ""
    """``rejected`` when the request was undecodable or not a lookup; empty otherwise.
    Optional: older controllers neither send nor read it."""
    reasons: tuple[str, ...] = ()


class JobForward(Message, frozen=True, tag="job_forward"):
    """A job its home region cannot run, sent to the region chosen for it (request on
    ``<p>.fed.submit.<region>``; docs/federation.md)."""

    job: Job
    origin: str
    """The submitter's region."""


class JobCancel(Message, frozen=True, tag="job_cancel"):
    """Cancel a job that runs in another region (request on ``<p>.fed.submit.<region>``,
    answered with a :class:`JobForwardReply`)."""

    job_id: str
    origin: str


class JobForwardReply(Message, frozen=True, tag="job_forward_reply"):
    """The answer to a :class:`JobForward` or :class:`JobCancel`: the job's status there,
    or why not."""

    ok: bool
    region: str = ""
    status: JobStatus | None = None
    error: str = ""
    """``not_leader``, ``exists``, ``rejected``, ``not_found`` or ``unavailable`` when not
    ``ok``."""
    reasons: tuple[str, ...] = ()


class JobLookup(Message, frozen=True, tag="job_lookup"):
    """Which region holds job ``job_id`` (request on ``<p>.fed.lookup.<region>``)."""

    job_id: str


class JobLookupReply(Message, frozen=True, tag="job_lookup_reply"):
    """The answer to a :class:`JobLookup`."""

    job_id: str
    found: bool
    region: str = ""
    status: JobStatus | None = None


class RegionPing(Message, frozen=True, tag="region_ping"):
    """A round trip between two regions' controllers (request on ``<p>.fed.lookup.<region>``,
    answered with the same message): the measured inter-region latency."""

    region: str
    """Who answers (the asker sends the region it asks)."""
    ts: float
