"""Shared fixtures: a real nats-server per test session (JetStream in a temp dir)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from uuid import uuid4

import nats
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext

from metalguard.controller.broker.server import NatsServer
from metalguard.controller.state.streams import (
    StreamSettings,
    bucket_configs,
    ensure_streams,
    stream_configs,
)
from metalguard.proto.subjects import Subjects

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="session")
def nats_server() -> Iterator[NatsServer]:
    """One real nats-server for the whole session, on a free loopback port."""
    server = NatsServer()
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def nats_url(nats_server: NatsServer) -> str:
    """The session server's client URL."""
    return nats_server.url


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[Client]:
    """A connected client, drained at the end of the test."""
    client = await nats.connect(nats_url, connect_timeout=2, max_reconnect_attempts=1)
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
def fresh_server(tmp_path: Path) -> Iterator[NatsServer]:
    """A private server for tests that stop and restart it (same port, same store)."""
    server = NatsServer(store_dir=tmp_path / "js")
    server.start()
    try:
        yield server
    finally:
        server.close()


async def drop_streams(js: JetStreamContext, subjects: Subjects) -> None:
    """Delete every stream and bucket that ``ensure_streams`` made for ``subjects``."""
    settings = StreamSettings()
    for stream in stream_configs(subjects, settings):
        await js.delete_stream(stream.name or "")
    for bucket in bucket_configs(subjects, settings):
        await js.delete_key_value(bucket.bucket)


@pytest.fixture
async def subjects(nc: Client) -> AsyncIterator[Subjects]:
    """The design's streams and buckets under a prefix of this test's own (tests share the
    session server), deleted afterwards."""
    private = Subjects(f"t{uuid4().hex[:8]}")
    js = nc.jetstream(timeout=5)
    await ensure_streams(js, private)
    try:
        yield private
    finally:
        await drop_streams(js, private)
