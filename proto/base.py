"""Base classes and shared types of the wire contract.

Every top-level message is a frozen, tagged msgspec Struct carrying ``v``, the major
schema version.  Nested records are frozen, untagged Structs.  Compatibility rules
(docs/protocol.md): a new field always has a default and older decoders ignore fields
they do not know, so adding one keeps ``v``; renaming, removing or retyping a field bumps
``v``, and a decoder rejects a major version newer than its own.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

SCHEMA_VERSION = 1
"""The major schema version this build writes and the newest it reads."""

TAG_FIELD = "type"
"""The field that names a message's type on the wire."""

SchemaVersion = Annotated[int, msgspec.Meta(ge=1)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
Priority = Annotated[int, msgspec.Meta(ge=0, le=7)]
Percent = Annotated[float, msgspec.Meta(ge=0, le=100)]
Token = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[^.*>\s]+\Z")]
"""A string that is safe as one NATS subject token."""

DATASET_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z"
"""A dataset's name (``[[cache.datasets]]`` in agent.toml, a job's ``dataset``)."""
DatasetName = Annotated[str, msgspec.Meta(pattern=DATASET_NAME_PATTERN)]

AttrValue = str | int | float | bool | None
"""A scalar for free-form attributes (event details, command arguments, results)."""


class Record(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=False):
    """A nested, immutable record inside a message."""


class Message(msgspec.Struct, frozen=True, kw_only=True, tag_field=TAG_FIELD):
    """A top-level wire message: tagged, versioned, immutable."""

    v: SchemaVersion = SCHEMA_VERSION


def node_handle(region: str, cluster: str, node: str) -> str:
    """A node's global handle, ``region.cluster.node`` (its KV key, its name in the API)."""
    return f"{region}.{cluster}.{node}"


class NodeIdentity(Record, frozen=True):
    """Who a node is: its place in subjects and its global handle.

    ``region.cluster.node`` names it in subjects; ``uuid`` (DMI product_uuid, else
    machine-id) is unique across regions.
    """

    region: Token
    cluster: Token
    node: Token
    uuid: str = ""

    @property
    def handle(self) -> str:
        """``region.cluster.node`` (not a field: never on the wire)."""
        return node_handle(self.region, self.cluster, self.node)


class Reason(Record, frozen=True):
    """Why a decision was taken: one signal measured against one rule."""

    signal: str
    value: float | str | bool | None = None
    threshold: float | str | None = None
    rule: str = ""
    message: str = ""
