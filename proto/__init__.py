"""metalguard's wire contract: messages, subjects, codec.  Agent and controller both
import this package and never each other's internals."""

from proto.base import SCHEMA_VERSION, NodeIdentity, Reason
from proto.codec import CodecError, decode, decode_json, encode, encode_json
from proto.events import Command, CommandReply, ControllerEvent, NodeEvent
from proto.jobs import Job, JobStatus
from proto.messages import MESSAGE_TYPES, AnyMessage
from proto.qos import QosProfile
from proto.subjects import DEFAULT_SUBJECTS, SubjectError, Subjects
from proto.telemetry import TelemetryBatch

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
