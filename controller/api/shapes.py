"""The shapes of the HTTP API's bodies (docs/api.md) as msgspec Structs: what the handlers
answer where no wire message fits, and the request bodies they read.

controller/api/openapi.py turns them (with the wire messages they embed: NodeRecord,
ControllerEvent, JobStatus, QosProfile, ...) into the OpenAPI document's schemas.  A
field that is absent from some answers is ``UNSET`` (left out of the JSON).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import UNSET, UnsetType

from metalguard.proto.base import Reason
from metalguard.proto.events import ControllerEvent
from metalguard.proto.jobs import JobState, JobStatus
from metalguard.proto.nodes import Grade, NodeRecord
from metalguard.proto.provision import (
    Image,
    ImageName,
    InstanceState,
    InstanceTransition,
    NodeProvisionState,
)
from metalguard.proto.qos import QosProfile
from metalguard.proto.telemetry import BmcReading, QosInterfaceStatus
from metalguard.proto.tenants import TenantQuota, TenantUsage

MAX_REASON = 500
MAX_WHO = 64


class Shape(msgspec.Struct, frozen=True, kw_only=True):
    """An API body (not a wire message: no ``type`` tag, no ``v``)."""


# --- errors ------------------------------------------------------------------------------


class ErrorDetail(Shape, frozen=True):
    """What went wrong: a stable ``code``, a message for people, and for an invalid
    document every ``reasons`` found."""

    code: str
    message: str
    reasons: list[str] | UnsetType = UNSET


class ErrorBody(Shape, frozen=True):
    """Every 4xx and 5xx answer: ``{"error": {"code", "message"}}``."""

    error: ErrorDetail


# --- health and leadership -------------------------------------------------------------


class Health(Shape, frozen=True):
    """``GET /healthz``: the process serves HTTP; from ``controller run`` who leads."""

    status: Literal["ok"]
    leading: bool | UnsetType = UNSET
    leader: str | UnsetType | None = UNSET
    region: str | UnsetType = UNSET
    self_: str | UnsetType = msgspec.field(default=UNSET, name="self")


class LeaderAnswer(Shape, frozen=True):
    """``GET /v1/leader``: without ``[ha]`` only ``ha`` (false) and ``leading``."""

    ha: bool
    leading: bool
    region: str | UnsetType = UNSET
    leader: str | UnsetType | None = UNSET
    self_: str | UnsetType = msgspec.field(default=UNSET, name="self")
    term: int | UnsetType | None = UNSET
    revision: int | UnsetType | None = UNSET
    expires_in_s: float | UnsetType | None = UNSET


# --- nodes -----------------------------------------------------------------------------


class NodeSummary(Shape, frozen=True):
    """A node's line in ``GET /v1/nodes``."""

    handle: str
    region: str
    cluster: str
    node: str
    rack: str
    grade: Grade
    score: float
    cordoned: bool
    maintenance: bool
    held: bool
    last_seen_ts: float | None
    reasons: list[Reason]
    warm_datasets: list[str] = []
    """The datasets whose node-local cache is warm on the node (docs/scheduler.md)."""
    provision: NodeProvision | UnsetType = UNSET
    """Its instance state and tenant, when provisioning is enabled and knows the node."""


class NodeList(Shape, frozen=True):
    """``GET /v1/nodes``: one page of the matching nodes, sorted by handle."""

    nodes: list[NodeSummary]
    total: int
    """How many nodes match (on every page)."""
    next: str | None
    """The cursor of the next page (pass it as ``cursor``); null on the last page."""


class GroupSummary(Shape, frozen=True):
    """One cluster's or rack's line in ``GET /v1/summary``."""

    region: str
    cluster: str
    nodes: int
    grades: dict[Grade, int]
    """Nodes per grade (the grades it has)."""
    cordoned: int
    """Nodes cordoned, in maintenance or held."""
    rack: str | UnsetType = UNSET
    """With ``by=rack`` (``""``: nodes without a rack)."""


class FleetSummary(Shape, frozen=True):
    """``GET /v1/summary``: the region's grade counts and its groups, in key order."""

    by: Literal["rack", "cluster"]
    total: int
    grades: dict[Grade, int]
    groups: list[GroupSummary]


class CounterSamples(Shape, frozen=True):
    """One counter's recent samples ``[ts, value]`` (oldest first) and its resets."""

    samples: list[tuple[float, float]]
    resets: int


class BmcAnswer(Shape, frozen=True):
    """The newest out-of-band word of a node's BMC (docs/bmc.md)."""

    received_ts: float
    power_on: bool | None
    health: Literal["ok", "warning", "critical", "unreachable", ""]
    readings: list[BmcReading]


class NodeDetail(Shape, frozen=True):
    """``GET /v1/nodes/{node}``: the record, signals, QoS verdicts, scores, BMC word."""

    handle: str
    record: NodeRecord
    signals: dict[str, CounterSamples]
    qos: list[QosInterfaceStatus]
    scores: list[tuple[float, float]]
    bmc: BmcAnswer | UnsetType = UNSET


class OperatorRequest(Shape, frozen=True):
    """The body of ``POST /v1/nodes/{node}/cordon|uncordon|maintenance``."""

    reason: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_REASON, pattern=r"\S")]
    who: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_WHO, pattern=r"\S")] = "api"


class ActionAnswer(Shape, frozen=True):
    """An operator action's answer: the events it announced (none when nothing changed)
    and the node's record after it."""

    handle: str
    action: Literal["cordon", "uncordon", "maintenance"]
    events: list[ControllerEvent]
    record: NodeRecord


class NodeByUuid(Shape, frozen=True):
    """``GET /v1/nodes/by-uuid/{uuid}``: the node, from whichever region knows it."""

    uuid: str
    region: str
    handle: str
    record: NodeRecord


class FleetRegion(Shape, frozen=True):
    """One region's line in ``GET /v1/fleet``: its RegionSummary's fields (docs/federation.md)
    and how this controller sees it."""

    region: str
    age_s: float
    stale: bool
    latency_ms: float | None
    rtt_ms: float | None
    nodes: int | UnsetType = UNSET


class FleetAnswer(Shape, frozen=True):
    """``GET /v1/fleet``: this region and every region heard."""

    region: str
    regions: list[FleetRegion]


# --- events ----------------------------------------------------------------------------


class EventPage(Shape, frozen=True):
    """``GET /v1/events/history``: ControllerEvents with their stream ``seq``, oldest first."""

    events: list[ControllerEvent]
    last_seq: int | None
    more: bool


# --- jobs ------------------------------------------------------------------------------


class JobSummary(Shape, frozen=True):
    """A job's line in ``GET /v1/jobs``."""

    id: str
    name: str
    tenant: str
    priority: int
    nodes: int
    state: JobState
    placement: list[str]
    restarts: int
    step: int | None
    last_checkpoint_step: int | None
    reason: str
    updated_ts: float


class JobList(Shape, frozen=True):
    """``GET /v1/jobs``: oldest first."""

    jobs: list[JobSummary]


class JobDetail(JobSummary, frozen=True):
    """One job: its summary, the whole stored JobStatus and, with federation, its region."""

    status: JobStatus
    region: str | UnsetType = UNSET


# --- QoS -------------------------------------------------------------------------------


class ProfileEntry(Shape, frozen=True):
    """One stored revision of a QoS profile key."""

    key: str
    revision: int
    version: int
    profile: QosProfile


class ProfileAnswer(ProfileEntry, frozen=True):
    """``GET``/``PUT /v1/qos/...``: the profile served and where it is stored."""

    cluster: str
    node: str | None
    source: Literal["cluster", "node"]
    history: list[ProfileEntry] | UnsetType = UNSET
    previous_version: int | UnsetType | None = UNSET


class CongestedNode(Shape, frozen=True):
    """A node among its cluster's most congested: its rates over its last interval."""

    handle: str
    node: str
    share: float
    """Its largest share of the cluster's pause frames or transmit waits (0-1)."""
    pause_frames_per_s: float | None
    """Pause frames received and sent per second (null: no interface counts them)."""
    rx_pause_per_s: float | None
    tx_pause_per_s: float | None
    xmit_wait_per_s: float | None
    """RDMA ``port_xmit_wait`` ticks per second, all ports (null: no port counts them)."""


class DegradedQosNode(Shape, frozen=True):
    """A node whose newest batch has interfaces in QoS status ``degraded``."""

    handle: str
    node: str
    interfaces: list[QosInterfaceStatus]


class QosClusterView(Shape, frozen=True):
    """One cluster in ``GET /v1/qos``: its profile, its congestion, its degraded nodes."""

    region: str
    cluster: str
    profile_version: int | None
    """The version of the cluster's profile in ``<P>_QOS`` (null: none stored)."""
    nodes: int
    """Nodes of the cluster the controller has a record of."""
    nodes_reporting: int
    """Nodes heard within ``stale_after_s`` whose counters gave a rate."""
    pause_frames_per_s: float
    rx_pause_per_s: float
    tx_pause_per_s: float
    xmit_wait_per_s: float
    top: list[CongestedNode]
    """The most congested reporting nodes, largest share first (at most 5)."""
    degraded: list[DegradedQosNode]


class QosFleetAnswer(Shape, frozen=True):
    """``GET /v1/qos``: every cluster's flow-control view, sorted by region and cluster."""

    ts: float
    """The controller's time of the view."""
    stale_after_s: float
    """A node not heard for this long counts no more in its cluster's rates."""
    clusters: list[QosClusterView]


# --- tenants (docs/scheduler.md "Tenant quotas") --------------------------------------


class TenantList(Shape, frozen=True):
    """``GET /v1/tenants``: every tenant with a quota or a job, by name."""

    fleet_gpus: int
    """The GPUs of the nodes that take work or run it now (the quotas' ceiling)."""
    tenants: list[TenantUsage]


class QuotaBody(Shape, frozen=True, forbid_unknown_fields=True):
    """``PUT /v1/tenants/{tenant}``: the tenant's quota (every field as in ``[[tenants]]``)."""

    gpus: Annotated[int, msgspec.Meta(ge=0)] = 0
    gpus_by_type: dict[str, Annotated[int, msgspec.Meta(ge=0)]] = {}
    borrow_limit: Annotated[int, msgspec.Meta(ge=0)] | None = None
    lend_limit: Annotated[int, msgspec.Meta(ge=0)] | None = None


class TenantAnswer(Shape, frozen=True):
    """``GET``/``PUT /v1/tenants/{tenant}``: its usage, with the quota stored."""

    usage: TenantUsage
    quota: TenantQuota | None


# --- provisioning (docs/provisioning.md) -------------------------------------------------


class InstanceAnswer(Shape, frozen=True):
    """An instance as the API shows it: the stored Instance without its secret ``export``
    (the NBD export's name and the token of the node's ready report) and without its user
    data (only its size)."""

    instance_id: str
    tenant: str
    image: str
    volume: str
    state: InstanceState
    node: str
    attempts: int
    pinned: bool
    sensitive: bool
    """Only on DMA-isolated nodes (docs/security.md "DMA isolation")."""
    """The request named the node: a failed deploy is not retried on another one."""
    keep_volume: bool
    """What its release does with the volume (kept for the tenant, or deleted)."""
    ready_ts: float | None
    ready_report: dict[str, str]
    error: str
    created_ts: float
    updated_ts: float
    history: list[InstanceTransition]
    user_data_bytes: int
    """Bytes of the user data the image runs once booted (the data itself is not shown)."""


class InstanceList(Shape, frozen=True):
    """``GET /v1/instances``: oldest first."""

    instances: list[InstanceAnswer]


class ImageList(Shape, frozen=True):
    """``GET /v1/images``: by name."""

    images: list[Image]


class VolumeLine(Shape, frozen=True):
    """A tenant volume in ``GET /v1/volumes``, with the live instance that boots it."""

    name: str
    tenant: str
    image: str
    size_bytes: int
    """Bytes it takes on the storage host (copy-on-write: kilobytes when fresh)."""
    created_ts: float
    instance: str | None
    """The id of the instance (not released) whose root it is, or null."""


class VolumeList(Shape, frozen=True):
    """``GET /v1/volumes``: by name."""

    volumes: list[VolumeLine]


class ImageBuild(Shape, frozen=True, forbid_unknown_fields=True):
    """``POST /v1/images`` as JSON: build an ext4 image from a directory of the storage
    host (the other form uploads a qcow2 or raw file)."""

    name: ImageName
    directory: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
    """An absolute path on the controller's (storage) host."""
    size_bytes: Annotated[int, msgspec.Meta(ge=0, le=1 << 44)] = 0
    """The file system's size (0: fit the directory, with room to spare)."""


class NodeProvision(Shape, frozen=True):
    """A node's provisioning line in ``GET /v1/nodes`` (only the nodes provisioning may
    deploy: those of ``[[provision.nodes]]``)."""

    state: NodeProvisionState
    instance: str | None
    """The live instance on the node (null: none)."""
    tenant: str | None
    image: str | None
    flagged: bool
    """Failed deploys flagged it: not deployed until an operator clears it."""


class ProvisionNodeLine(Shape, frozen=True):
    """A node provisioning may deploy, in ``GET /v1/provision/nodes``."""

    node: str
    """Its handle ``region.cluster.node``."""
    mac: str
    """The MAC it network-boots from (lower case, colons)."""
    state: NodeProvisionState
    instance_id: str
    tenant: str
    image: str
    grade: str
    """Its grade in the controller's records ("": no record yet)."""
    cordoned: bool
    failures: int
    """Consecutive failed deploys on it."""
    flagged: bool


class ProvisionNodeList(Shape, frozen=True):
    """``GET /v1/provision/nodes``: by handle."""

    nodes: list[ProvisionNodeLine]
