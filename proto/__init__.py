"""metalguard's wire contract: messages, subjects, codec.  Agent and controller both
import this package and never each other's internals."""

from metalguard.proto.base import SCHEMA_VERSION, NodeIdentity, Reason
from metalguard.proto.codec import CodecError, decode, decode_json, encode, encode_json
from metalguard.proto.events import Command, CommandReply, ControllerEvent, NodeEvent
from metalguard.proto.jobs import Job, JobStatus
from metalguard.proto.messages import MESSAGE_TYPES, AnyMessage
from metalguard.proto.qos import QosProfile
from metalguard.proto.subjects import DEFAULT_SUBJECTS, SubjectError, Subjects
from metalguard.proto.telemetry import TelemetryBatch

__all__ = [
    "DEFAULT_SUBJECTS",
    "MESSAGE_TYPES",
    "SCHEMA_VERSION",
    "AnyMessage",
    "CodecError",
    "Command",
    "CommandReply",
    "ControllerEvent",
    "Job",
    "JobStatus",
    "NodeEvent",
    "NodeIdentity",
    "QosProfile",
    "Reason",
    "SubjectError",
    "Subjects",
    "TelemetryBatch",
    "decode",
    "decode_json",
    "encode",
    "encode_json",
]
