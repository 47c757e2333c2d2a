"""``GET /v1/fleet`` and ``GET /v1/nodes/by-uuid/{uuid}``: the federation's view
(controller/federation/service.py, docs/federation.md), on the controller's API app."""

from __future__ import annotations

from typing import Any, Final, Protocol

from aiohttp import web

from metalguard.controller.api.auth import check_read
from metalguard.controller.api.errors import ApiError
from metalguard.proto.codec import to_builtins
from metalguard.proto.federation import NodeLookupReply


class FleetApi(Protocol):
    """What the routes need (``controller.federation.service.Federation`` satisfies it)."""

    region: str

    def fleet(self) -> list[dict[str, Any]]: ...

    async def lookup(self, uuid: str) -> NodeLookupReply: ...


FLEET: Final = web.AppKey("fleet", FleetApi)


def add_fleet_routes(app: web.Application, fleet: FleetApi) -> None:
    """Serve the fleet view and node lookups by UUID from ``fleet``."""
    app[FLEET] = fleet
    app.router.add_get("/v1/fleet", get_fleet)
    app.router.add_get("/v1/nodes/by-uuid/{uuid}", get_by_uuid)


async def get_fleet(request: web.Request) -> web.Response:
    """Every region heard (this one from its own state), each marked ``stale`` when its
    newest summary is older than three of its intervals."""
    check_read(request)
    fleet = request.app[FLEET]
    return web.json_response({"region": fleet.region, "regions": fleet.fleet()})


async def get_by_uuid(request: web.Request) -> web.Response:
    """The node with this UUID, from whichever region knows it (404 when none does)."""
    check_read(request)
    uuid = request.match_info["uuid"]
    if not uuid or len(uuid) > 128:
        raise ApiError(400, "bad_request", "uuid: 1-128 characters")
    reply = await request.app[FLEET].lookup(uuid)
    if not reply.found or reply.record is None:
        raise ApiError(404, "not_found", f"no region knows a node with uuid {uuid!r}")
    return web.json_response(
        {
            "uuid": uuid,
            "region": reply.region,
            "handle": reply.handle,
            "record": to_builtins(reply.record),
        }
    )
