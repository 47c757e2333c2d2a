"""``metalguard controller setup``: create the streams and buckets on a server."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import nats
from nats.errors import Error as NatsError

from metalguard.controller.state.streams import StreamSettings, ensure_streams
from metalguard.proto.subjects import SubjectError, Subjects

CONNECT_DEADLINE_S = 10.0


async def setup_streams(
    url: str, prefix: str, replicas: int, options: dict[str, Any] | None = None
) -> int:
    """Connect, ensure every stream and bucket exists with these settings, report; exit
    status. ``options`` (``nats.connect`` keywords, from a controller config's ``[nats]``:
    credentials, TLS) replace the plain ``url``."""
    try:
        subjects = Subjects(prefix)
    except SubjectError as exc:
        print(f"metalguard: bad --prefix: {exc}", file=sys.stderr)
        return 2
    connect = dict(options or {"servers": [url]})
    connect.update(max_reconnect_attempts=1, connect_timeout=2)
    url = ", ".join(connect["servers"])
    try:
        nc = await asyncio.wait_for(nats.connect(**connect), CONNECT_DEADLINE_S)
    except (TimeoutError, OSError, NatsError) as exc:
        print(f"metalguard: cannot connect to {url}: {exc or type(exc).__name__}", file=sys.stderr)
        return 1
    try:
        await ensure_streams(nc.jetstream(), subjects, StreamSettings(replicas=replicas))
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
