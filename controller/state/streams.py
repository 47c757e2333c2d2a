"""Create the design's JetStream streams and KV buckets, idempotently."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, KeyValueConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BucketNotFoundError, NotFoundError

from metalguard.proto.subjects import DEFAULT_SUBJECTS, Subjects

log = logging.getLogger(__name__)

HOUR = 3600.0
DAY = 24 * HOUR


@dataclass(frozen=True, slots=True)
class StreamSettings:
    """Retention and replication of the streams and buckets (docs/protocol.md)."""

    replicas: int = 1
    telemetry_max_age_s: float = DAY
    events_max_age_s: float = 7 * DAY
    control_max_age_s: float = 30 * DAY
    dead_letter_max_age_s: float = 7 * DAY
    duplicate_window_s: float = 600.0
    """Dedup window for message ids (node + seq); covers a replay after a short outage."""
    lease_ttl_s: float = 10.0
    telemetry_max_bytes: int = -1


def stream_configs(subjects: Subjects, settings: StreamSettings) -> list[StreamConfig]:
    """The streams of the design for one prefix."""

    def stream(name: str, family: str, max_age: float, max_bytes: int = -1) -> StreamConfig:
        return StreamConfig(
            name=name,
            subjects=[subjects.all_of(family)],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            discard=DiscardPolicy.OLD,
            max_age=max_age,
            max_bytes=max_bytes,
            num_replicas=settings.replicas,
            duplicate_window=settings.duplicate_window_s,
        )

    return [
        stream(
            subjects.stream_telemetry,
            "tel",
            settings.telemetry_max_age_s,
            settings.telemetry_max_bytes,
        ),
        stream(subjects.stream_events, "evt", settings.events_max_age_s),
        stream(subjects.stream_control, "ctl", settings.control_max_age_s),
        stream(subjects.stream_dead_letter, "dlq", settings.dead_letter_max_age_s),
    ]


def bucket_configs(subjects: Subjects, settings: StreamSettings) -> list[KeyValueConfig]:
    """The KV buckets of the design for one prefix."""
    r = settings.replicas
    return [
        KeyValueConfig(bucket=subjects.bucket("nodes"), history=5, replicas=r),
        KeyValueConfig(bucket=subjects.bucket("jobs"), history=10, replicas=r),
        KeyValueConfig(bucket=subjects.bucket("qos"), history=10, replicas=r),
        KeyValueConfig(bucket=subjects.bucket("tenants"), history=10, replicas=r),
        KeyValueConfig(bucket=subjects.bucket("provision"), history=10, replicas=r),
        KeyValueConfig(
            bucket=subjects.bucket("leases"), history=1, ttl=settings.lease_ttl_s, replicas=r
        ),
    ]


async def ensure_streams(
    js: JetStreamContext,
    subjects: Subjects = DEFAULT_SUBJECTS,
    settings: StreamSettings | None = None,
) -> None:
    """Create every missing stream and bucket; safe to repeat.

    With ``settings`` (``metalguard controller setup``), existing streams are updated to
    them too. Without (a controller starting), existing streams are left as they are: a
    region set up with ``--replicas 3`` or longer retention keeps it.
    """
    update = settings is not None
    settings = settings or StreamSettings()
    for config in stream_configs(subjects, settings):
        try:
            await js.stream_info(config.name or "")
        except NotFoundError:
            await js.add_stream(config)
            log.info("created stream %s", config.name)
        else:
            if update:
                await js.update_stream(config)
    for kv in bucket_configs(subjects, settings):
        try:
            await js.key_value(kv.bucket)
        except BucketNotFoundError:
            await js.create_key_value(kv)
            log.info("created bucket %s", kv.bucket)
