"""Provisioning: base images, tenant volumes and instances (docs/provisioning.md).

An *instance* is a tenant's bare-metal node: a node booted from the network with the
tenant's copy-on-write volume as its root.  Its record moves through
:data:`InstanceState`; the node it occupies is "available" again once it is released.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from metalguard.proto.base import Message, NonNegInt, Record

ImageName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")]
"""A base image's name (a KV key and a file name)."""
InstanceId = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}\Z")]
TenantName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}\Z")]
VolumeName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}\Z")]

InstanceState = Literal[
    "deploying",
    "active",
    "switching",
    "releasing",
    "released",
    "deploy_failed",
]
"""deploying -> active -> (switching -> active)* -> releasing -> released; deploying or
switching -> deploy_failed after the deploy timeout (retried on another node for a request
that named none)."""
TERMINAL_INSTANCE_STATES: frozenset[str] = frozenset({"released", "deploy_failed"})
NodeProvisionState = Literal["available", "deploying", "active", "releasing", "deploy_failed"]
"""What a node is for provisioning: the state of the instance on it ("available": none)."""


class Image(Message, frozen=True, tag="image"):
    """A base system image in the region's registry (never written after upload)."""

    name: ImageName
    format: Literal["qcow2", "raw"] = "qcow2"
    size_bytes: NonNegInt = 0
    """Bytes of the image file on the storage host."""
    virtual_size: NonNegInt = 0
    """Bytes of the disk it presents."""
    sha256: str = ""
    created_ts: float = 0.0
    source: str = ""
    """How it was made: ``upload:<file name>`` or ``dir:<path>``."""


class Volume(Record, frozen=True):
    """A tenant's copy-on-write volume over a base image (a qcow2 overlay)."""

    name: VolumeName
    tenant: TenantName
    image: ImageName
    size_bytes: NonNegInt = 0
    """Bytes it takes on the storage host (kilobytes right after creation)."""
    created_ts: float = 0.0


class InstanceTransition(Record, frozen=True):
    """One step of an instance's history, with its reason."""

    ts: float
    state: InstanceState
    reason: str = ""
    node: str = ""


class InstanceRequest(Message, frozen=True, tag="instance_request"):
    """What a caller asks for (POST /v1/instances, ``metalguard provision create``)."""

    tenant: TenantName
    image: ImageName
    node: str = ""
    """A node handle (``region.cluster.node``) or "" to let the service pick one."""
    volume: str = ""
    """An existing volume of the tenant to boot (a replacement, a re-attach), or "" for a
    new one from ``image``."""
    instance_id: str = ""
    user_data: str = ""
    """A script the image runs once booted (like cloud-init's user data)."""
    sensitive: bool = False
    """Only on a node whose DMA isolation posture is ``isolated`` (docs/security.md)."""


class Instance(Message, frozen=True, tag="instance"):
    """An instance as the provisioning service keeps it (KV ``MG_PROVISION``)."""

    instance_id: InstanceId
    tenant: TenantName
    image: ImageName
    volume: VolumeName
    state: InstanceState
    node: str = ""
    """The node handle it is on (or was last on)."""
    user_data: str = ""
    attempts: NonNegInt = 0
    """Deploys tried (a deploy that timed out is retried on another node)."""
    pinned: bool = False
    """The request named the node: a deploy that fails is not retried on another one."""
    sensitive: bool = False
    """Deployed, retried and replaced only on DMA-isolated nodes (docs/security.md)."""
    keep_volume: bool = True
    """What its release does with the volume: keep it for the tenant, or delete it."""
    ready_ts: float | None = None
    ready_report: dict[str, str] = {}
    """What the booted image said when it reported ready (boot id, kernel, output ...)."""
    error: str = ""
    created_ts: float = 0.0
    updated_ts: float = 0.0
    history: tuple[InstanceTransition, ...] = ()
    export: str = ""
    """The secret of the current boot: the NBD export's name and the token of the node's
    ready report and user data.  Never shown by the API or the CLI."""
