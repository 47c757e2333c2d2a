"""``GET /v1/leader``: who leads the region, with HA (controller/leader.py, docs/api.md)."""

from __future__ import annotations

from typing import Any, Final, Protocol

from aiohttp import web

from metalguard.controller.api.auth import check_read


class LeaderView(Protocol):
    """Who leads the region (controller/leader.py's Leadership)."""

    def status(self) -> dict[str, Any]: ...


LEADER: Final = web.AppKey("leader", LeaderView)


def add_leader_route(app: web.Application, leader: LeaderView) -> None:
    """``GET /v1/leader`` (and the leader fields of ``/healthz``) over ``leader``."""
    app[LEADER] = leader
    app.router.add_get("/v1/leader", leader_status)


async def leader_status(request: web.Request) -> web.Response:
    """Who leads the region: region, leader, self, term, revision, expires_in_s."""
    check_read(request)
    return web.json_response(request.app[LEADER].status())


def leader_elsewhere(request: web.Request) -> str | None:
    """Where the leader is when this controller follows (None: it leads, or no HA)."""
    leader = request.app.get(LEADER)
    if leader is None or (status := leader.status()).get("leading", True):
        return None
    return str(status.get("leader") or "unknown (no leader right now)")
