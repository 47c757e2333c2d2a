"""Serving the HTTP API from ``metalguard controller run`` (the ``[http]`` section)."""

from __future__ import annotations

import logging
from pathlib import Path

from aiohttp import web
from prometheus_client import CollectorRegistry

from controller.api import ControllerView, make_app
from controller.api_sse import EventSource
from controller.config import ConfigError, HttpSection

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


def parse_listen(listen: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port``; ConfigError naming ``http.listen`` otherwise."""
    host, sep, port = listen.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"http.listen: expected host:port, got {listen!r}")
    return host, int(port)


async def start_api(
    cfg: HttpSection,
    view: ControllerView,
    source: EventSource,
    registry: CollectorRegistry | None = None,
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
    )
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError:
        await runner.cleanup()
        raise
    log.info("HTTP API on http://%s", cfg.listen)
    return runner
