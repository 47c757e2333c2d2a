"""The region controller's HTTP API app (aiohttp; docs/api.md).

:func:`make_app` builds the app over a :class:`~metalguard.controller.api.nodes.ControllerView`
(the RegionController satisfies it) and an :class:`~metalguard.controller.api.sse.EventSource`:
the JSON error middleware (errors.py), the tokens (auth.py), ``/healthz`` (here) and each
resource's routes from its own module (see this package's docstring for the map).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from typing import Any, Final

from aiohttp import web
from prometheus_client import CollectorRegistry

from metalguard.controller.api.auth import TOKENS, Tokens
from metalguard.controller.api.dashboard import add_dashboard_routes
from metalguard.controller.api.errors import error_middleware
from metalguard.controller.api.events import add_event_routes
from metalguard.controller.api.jobs import JobsView, add_jobs_routes
from metalguard.controller.api.leader import LEADER
from metalguard.controller.api.metrics import add_metrics_route
from metalguard.controller.api.nodes import ControllerView, add_node_routes
from metalguard.controller.api.openapi import add_openapi_route
from metalguard.controller.api.provision import (
    ProvisionView,
    add_provision_disabled,
    add_provision_routes,
)
from metalguard.controller.api.qos import add_qos_routes
from metalguard.controller.api.sse import EventSource
from metalguard.controller.api.tenants import TenantsView, add_tenant_routes
from metalguard.controller.qos import QosStore

MAX_BODY: Final = 16 * 1024


def make_app(
    view: ControllerView,
    events_source: EventSource,
    *,
    read_tokens: Collection[str] = (),
    admin_tokens: Collection[str] = (),
    open_reads: bool = False,
    registry: CollectorRegistry | None = None,
    keepalive_s: float = 15.0,
    event_queue_size: int = 1000,
    qos: QosStore | None = None,
    clock: Callable[[], float] = time.time,
    jobs: JobsView | None = None,
    provision: ProvisionView | None = None,
    tenants: TenantsView | None = None,
) -> web.Application:
    """The API app; ``registry`` (ingest's metrics) is exposed with the grade counts;
    ``qos`` (the MG_QOS profiles) adds the ``/v1/qos`` routes, ``jobs`` (the job manager)
    the ``/v1/jobs`` routes (``tenants``, the same manager, ``/v1/tenants``),
    ``provision`` (the provisioning service) ``/v1/images``, ``/v1/instances`` and
    ``/v1/volumes`` (without it those paths answer a 404 that says
    provisioning is not enabled).  ``/v1/leader`` and ``/v1/fleet`` are added by their modules'
    ``add_*`` functions (server.py).  ``open_reads``: reads need no token even with tokens
    set (the demo's)."""
    app = web.Application(middlewares=[error_middleware], client_max_size=MAX_BODY)
    app[TOKENS] = Tokens(read_tokens, admin_tokens, open_reads=open_reads)
    app.router.add_get("/healthz", healthz)
    add_openapi_route(app)  # GET /v1/openapi.json: the routes this app serves
    add_metrics_route(app, view, registry)
    add_node_routes(app, view)
    add_event_routes(
        app, events_source, keepalive_s=keepalive_s, queue_size=event_queue_size, clock=clock
    )
    add_dashboard_routes(app)  # the fleet dashboard: /, /ui/
    if qos is not None:
        add_qos_routes(app, qos)
    if jobs is not None:
        add_jobs_routes(app, jobs)
    if tenants is not None:
        add_tenant_routes(app, tenants)
    if provision is not None:
        add_provision_routes(app, provision)
    else:
        add_provision_disabled(app)
    return app


async def healthz(request: web.Request) -> web.Response:
    """Liveness: the process serves HTTP; with HA, who leads."""
    body: dict[str, Any] = {"status": "ok"}
    leader = request.app.get(LEADER)
    if leader is not None:
        status = leader.status()
        body |= {k: status[k] for k in ("leading", "leader", "region", "self") if k in status}
    return web.json_response(body)
