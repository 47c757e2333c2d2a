"""``metalguard controller setup``: create the streams and buckets on a server."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import nats
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.errors import BadRequestError, ServiceUnavailableError

from metalguard.controller.state.streams import StreamSettings, ensure_streams
from metalguard.proto.subjects import SubjectError, Subjects
from metalguard.runtime.deadlines import within

CONNECT_DEADLINE_S = 10.0
ELECTION_DEADLINE_S = 15.0
"""How long setup retries while a fresh cluster elects its JetStream leaders."""


NO_SUITABLE_PEERS = 10005
"""JetStream's error code for a stream whose replicas cannot be placed yet."""


async def ensure_streams_electing(
    js: JetStreamContext, subjects: Subjects, settings: StreamSettings
) -> None:
    """ensure_streams, retried for ELECTION_DEADLINE_S while a fresh cluster still elects
    its meta leader (503) or has not heard from enough peers to place the replicas ("no
    suitable peers", docs/scaling.md); any other error at once."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + ELECTION_DEADLINE_S
    while True:
        try:
            await ensure_streams(js, subjects, settings)
            return
        except ServiceUnavailableError:
            if loop.time() >= deadline:
                raise
        except BadRequestError as exc:
            if exc.err_code != NO_SUITABLE_PEERS or loop.time() >= deadline:
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
        nc = await within(nats.connect(**connect), CONNECT_DEADLINE_S)
    except (TimeoutError, OSError, NatsError) as exc:
        print(f"metalguard: cannot connect to {url}: {exc or type(exc).__name__}", file=sys.stderr)
        return 1
    try:
        await ensure_streams_electing(nc.jetstream(), subjects, StreamSettings(replicas=replicas))
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
