"""Serving the HTTP API from ``metalguard controller run`` (the ``[http]`` section)."""

from __future__ import annotations

import logging
import ssl
from pathlib import Path

from aiohttp import web
from prometheus_client import CollectorRegistry

from metalguard.controller.api.app import make_app
from metalguard.controller.api.fleet import FleetApi, add_fleet_routes
from metalguard.controller.api.jobs import JobsView
from metalguard.controller.api.leader import LeaderView, add_leader_route
from metalguard.controller.api.nodes import ControllerView
from metalguard.controller.api.provision import ProvisionView
from metalguard.controller.api.sse import EventSource
from metalguard.controller.api.tenants import TenantsView
from metalguard.controller.config import ConfigError, HttpSection
from metalguard.controller.qos import QosStore
from metalguard.proto import addresses

log = logging.getLogger(__name__)


def load_tokens(path: str, key: str) -> frozenset[str]:
    """Tokens from a file, one per line; blank lines and ``#`` comments ignored."""
    if not path:
        return frozenset()
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"http.{key}: cannot read {path}: {exc}") from None
    lines = (line.strip() for line in text.splitlines())
    return frozenset(line for line in lines if line and not line.startswith("#"))


def https_context(cfg: HttpSection) -> ssl.SSLContext | None:
    """The server TLS context of ``http.tls_*`` (None: plain HTTP); ConfigError naming
    the key when a file is missing or unusable."""
    if not cfg.tls_cert and not cfg.tls_key and not cfg.tls_client_ca:
        return None
    if not cfg.tls_cert or not cfg.tls_key:
        raise ConfigError("http.tls_cert: HTTPS needs both tls_cert and tls_key")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(cfg.tls_cert, cfg.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"http.tls_cert: unusable ({cfg.tls_cert}): {exc}") from None
    if cfg.tls_client_ca:
        try:
            ctx.load_verify_locations(cfg.tls_client_ca)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"http.tls_client_ca: unusable: {exc}") from None
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def parse_listen(listen: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port``; ConfigError naming ``http.listen`` otherwise
    (:func:`metalguard.proto.addresses.parse_listen`)."""
    try:
        parsed = addresses.parse_listen(listen)
    except addresses.AddressError as exc:
        raise ConfigError(f"http.listen: {exc}") from None
    assert parsed.port is not None  # a listen address always has one
    return parsed.host, parsed.port


async def start_api(
    cfg: HttpSection,
    view: ControllerView,
    source: EventSource,
    registry: CollectorRegistry | None = None,
    qos: QosStore | None = None,
    leader: LeaderView | None = None,
    jobs: JobsView | None = None,
    fleet: FleetApi | None = None,
    provision: ProvisionView | None = None,
    tenants: TenantsView | None = None,
) -> web.AppRunner:
    """Load the tokens, bind ``cfg.listen`` and serve; ``runner.cleanup()`` stops it.

    ConfigError for bad tokens files or listen address; OSError when it cannot bind.
    """
    host, port = parse_listen(cfg.listen)
    app = make_app(
        view,
        source,
        read_tokens=load_tokens(cfg.read_tokens_file, "read_tokens_file"),
        admin_tokens=load_tokens(cfg.admin_tokens_file, "admin_tokens_file"),
        registry=registry,
        qos=qos,
        jobs=jobs,
        provision=provision,
        tenants=tenants,
    )
    if leader is not None:
        add_leader_route(app, leader)
    if fleet is not None:
        add_fleet_routes(app, fleet)
    tls = https_context(cfg)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, ssl_context=tls).start()
    except OSError:
        await runner.cleanup()
        raise
    log.info("HTTP API on %s://%s", "https" if tls else "http", cfg.listen)
    return runner
