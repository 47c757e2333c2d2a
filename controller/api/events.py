"""The event routes (docs/api.md, docs/events.md): ``GET /v1/events`` (a Server-Sent
Events stream of ControllerEvents, through controller/api/sse.py) and ``GET
/v1/events/history`` (the kept events as JSON).  Both filter by ``kind`` and ``node``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Final

from aiohttp import web

from metalguard.controller.api.auth import check_read
from metalguard.controller.api.errors import ApiError, query_params
from metalguard.controller.api.sse import (
    NEW_ONLY,
    EventFilter,
    EventSource,
    SseHub,
    parse_last_event_id,
    parse_since,
)
from metalguard.proto.codec import to_builtins

EVENT_FILTERS: Final = ("kind", "node")
EVENT_QUERY: Final = (*EVENT_FILTERS, "since")
HISTORY_QUERY: Final = (*EVENT_QUERY, "after", "limit")
HISTORY_LIMIT_MAX: Final = 10_000
LIMIT: Final = re.compile(r"^[0-9]{1,6}$", re.ASCII)

HUB: Final = web.AppKey("hub", SseHub)
CLOCK: Final = web.AppKey[Callable[[], float]]("clock")


def add_event_routes(
    app: web.Application,
    source: EventSource,
    *,
    keepalive_s: float,
    queue_size: int,
    clock: Callable[[], float],
) -> None:
    """Register the ``/v1/events`` routes over ``source``; the streams close at shutdown."""
    app[HUB] = SseHub(source, keepalive_s, queue_size)
    app[CLOCK] = clock
    app.on_shutdown.append(_close_streams)
    app.router.add_get("/v1/events", events)
    app.router.add_get("/v1/events/history", event_history)


async def events(request: web.Request) -> web.StreamResponse:
    """SSE stream of ControllerEvents, filtered by ``kind`` and ``node``; from ``since``
    (or just after the ``Last-Event-ID`` header's stream sequence), else new ones only."""
    check_read(request)
    query = query_params(request, EVENT_QUERY)
    since = query.pop("since", "")
    last_id = request.headers.get("Last-Event-ID", "")
    try:
        if last_id:
            start = parse_last_event_id(last_id)
        elif since:
            start = parse_since(since, request.app[CLOCK]())
        else:
            start = NEW_ONLY
    except ValueError as exc:
        raise ApiError(400, "bad_request", str(exc)) from None
    return await request.app[HUB].stream(request, EventFilter(**query), start)


async def event_history(request: web.Request) -> web.Response:
    """Kept ControllerEvents as JSON, oldest first: from ``since`` (default ``1h``) or
    after the stream sequence ``after``; at most ``limit`` (default 1000)."""
    check_read(request)
    query = query_params(request, HISTORY_QUERY)
    limit_text = query.pop("limit", "1000")
    after, since = query.pop("after", ""), query.pop("since", "1h")
    if not LIMIT.match(limit_text) or not 1 <= int(limit_text) <= HISTORY_LIMIT_MAX:
        raise ApiError(400, "bad_request", f"limit: {limit_text!r} is not 1-{HISTORY_LIMIT_MAX}")
    try:
        start = parse_last_event_id(after) if after else parse_since(since, request.app[CLOCK]())
    except ValueError as exc:
        raise ApiError(400, "bad_request", str(exc).replace("Last-Event-ID", "after")) from None
    keep = EventFilter(**query)
    found, more = await request.app[HUB].source.history(start, int(limit_text))
    kept = [(e, seq) for e, seq in found if keep(e)]
    return web.json_response(
        {
            "events": [to_builtins(e) | {"seq": seq} for e, seq in kept],
            "last_seq": found[-1][1] if found else None,
            "more": more,
        }
    )


async def _close_streams(app: web.Application) -> None:
    await app[HUB].close()
