"""A test's private copy of the design's streams and buckets on the shared nats-server:
made under a prefix of its own (``private_subjects``), deleted afterwards (``drop_streams``).
The ``subjects`` fixture (tests/integration/conftest.py) is built on these."""

from __future__ import annotations

from uuid import uuid4

from nats.js import JetStreamContext

from metalguard.controller.state.streams import (
    StreamSettings,
    bucket_configs,
    ensure_streams,
    stream_configs,
)
from metalguard.proto.subjects import Subjects


async def private_subjects(js: JetStreamContext) -> Subjects:
    """Subjects under a fresh prefix, their streams and buckets made."""
    private = Subjects(f"t{uuid4().hex[:8]}")
    await ensure_streams(js, private)
    return private


async def drop_streams(js: JetStreamContext, subjects: Subjects) -> None:
    """Delete every stream and bucket that ``ensure_streams`` made for ``subjects``."""
    settings = StreamSettings()
    for stream in stream_configs(subjects, settings):
        await js.delete_stream(stream.name or "")
    for bucket in bucket_configs(subjects, settings):
        await js.delete_key_value(bucket.bucket)
