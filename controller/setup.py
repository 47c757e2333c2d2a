"""``metalguard controller setup``: create the streams and buckets on a server."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import nats
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.errors import ServiceUnavailableError

from metalguard.controller.state.streams import StreamSettings, ensure_streams
from metalguard.proto.subjects import SubjectError, Subjects

CONNECT_DEADLINE_S = 10.0
ELECTION_DEADLINE_S = 15.0
"""How long setup retries while a fresh cluster elects its JetStream leaders."""


async def _ensure(js: JetStreamContext, subjects: Subjects, settings: StreamSettings) -> None:
    """ensure_streams, retried while JetStream answers 503 (a cluster still electing its
    meta leader, docs/scaling.md); any other error at once."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + ELECTION_DEADLINE_S
    while True:
        try:
            await ensure_streams(js, subjects, settings)
            return
        except ServiceUnavailableError:
            if loop.time() >= deadline:
                raise
        await asyncio.sleep(0.5)


async def setup_streams(
    url: str, prefix: str, replicas: int, options: dict[str, Any] | None = None
) -> int:
    """Connect, ensure every stream and bucket exists with these settings, report; exit
    status. ``url`` may list several servers of one cluster, comma-separated; ``options``
    (``nats.connect`` keywords, from a controller config's ``[nats]``: credentials, TLS)
    replace the plain ``url``."""
    try:
        subjects = Subjects(prefix)
    except SubjectError as exc:
        print(f"metalguard: bad --prefix: {exc}", file=sys.stderr)
        return 2
    connect = dict(options or {"servers": [u.strip() for u in url.split(",") if u.strip()]})
    connect.update(max_reconnect_attempts=1, connect_timeout=2)
    url = ", ".join(connect["servers"])
    try:
        nc = await asyncio.wait_for(nats.connect(**connect), CONNECT_DEADLINE_S)
    except (TimeoutError, OSError, NatsError) as exc:
        print(f"metalguard: cannot connect to {url}: {exc or type(exc).__name__}", file=sys.stderr)
        return 1
    try:
        await _ensure(nc.jetstream(), subjects, StreamSettings(replicas=replicas))
    except NatsError as exc:
        print(f"metalguard: JetStream setup failed: {exc}", file=sys.stderr)
        return 1
    finally:
        await nc.close()
    print(
        f"streams {subjects.stream_telemetry}, {subjects.stream_events}, "
        f"{subjects.stream_control}, {subjects.stream_dead_letter} and buckets ready on {url}"
    )
    return 0
