"""The message union: every top-level wire type, in one list."""

from __future__ import annotations

from typing import Final, get_args

from metalguard.proto.events import Command, CommandReply, ControllerEvent, NodeEvent
from metalguard.proto.federation import (
    JobCancel,
    JobForward,
    JobForwardReply,
    JobLookup,
    JobLookupReply,
    NodeLookup,
    NodeLookupReply,
    RegionPing,
    RegionSummary,
)
from metalguard.proto.jobs import Job, JobStatus
from metalguard.proto.nodes import NodeRecord, RailState
from metalguard.proto.qos import QosProfile
from metalguard.proto.telemetry import TelemetryBatch

AnyMessage = (
    TelemetryBatch
    | NodeEvent
    | ControllerEvent
    | Command
    | CommandReply
    | QosProfile
    | Job
    | JobStatus
    | NodeRecord
    | RailState
    | RegionSummary
    | NodeLookup
    | NodeLookupReply
    | JobForward
    | JobCancel
    | JobForwardReply
    | JobLookup
    | JobLookupReply
    | RegionPing
)
"""Every message that may travel on a subject; the tag table is derived from it."""

MESSAGE_TYPES: Final[tuple[type[AnyMessage], ...]] = get_args(AnyMessage)

TAGS: Final[dict[str, type[AnyMessage]]] = {str(t.__struct_config__.tag): t for t in MESSAGE_TYPES}
"""Wire tag -> message type."""
