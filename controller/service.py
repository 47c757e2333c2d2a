"""``metalguard controller run --config controller.toml``: the region controller process.

Connect (the first connect is bounded), create the streams and buckets if missing, load
the state from KV, publish what a previous run left pending, then consume until SIGTERM
or SIGINT and stop cleanly: ingest first (queued work finishes), then the controller.
Exit status: 0 after a clean stop, 1 when NATS is unreachable, 2 for a bad config.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.js import JetStreamContext

from controller.api_server import start_api
from controller.api_sse import NatsEventSource
from controller.config import ConfigError, ControllerConfig, NatsSection, load_config
from controller.ingest import Ingest, IngestSettings
from controller.region import RegionController
from controller.scoring_config import ScoringConfig
from controller.state import NodeStore
from controller.streams import ensure_streams
from proto.access import tls_context
from proto.subjects import Subjects

log = logging.getLogger(__name__)


def connect_options(cfg: NatsSection) -> dict[str, Any]:
    """Keyword arguments of ``nats.connect`` for the ``[nats]`` section."""
    options: dict[str, Any] = {
        "servers": list(cfg.servers),
        "name": "metalguard-controller",
        "connect_timeout": cfg.connect_timeout_s,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 1.0,
        "error_cb": _on_error,
    }
    if cfg.credentials:
        options["user_credentials"] = cfg.credentials
    if cfg.nkey_seed:
        options["nkeys_seed"] = cfg.nkey_seed
    try:
        ctx = tls_context(cfg.tls_ca, cfg.tls_cert, cfg.tls_key)
    except ValueError as exc:
        raise ConfigError(f"nats.tls_*: {exc}") from None
    if ctx is not None:
        options["tls"] = ctx
    return options


async def _on_error(exc: Exception) -> None:
    log.warning("NATS: %s", exc or type(exc).__name__)


def start_ingest(
    js: JetStreamContext, subjects: Subjects, region: str, handler: RegionController
) -> Ingest:
    """The ingest consumers for ``region``, feeding ``handler`` (not yet started)."""
    return Ingest(js, subjects, IngestSettings(region=region), handler)


async def run_controller(config_path: Path) -> int:
    """Run until SIGTERM/SIGINT; the exit status."""
    try:
        cfg = load_config(config_path)
        scoring = cfg.scoring_config(config_path.parent)
        subjects = Subjects(cfg.nats.prefix)
        options = connect_options(cfg.nats)
    except (ConfigError, ValueError) as exc:
        print(f"metalguard: {exc}", file=sys.stderr)
        return 2
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        nc = await _connect(options, cfg.nats.connect_deadline_s, stop)
        if nc is None:
            return 0 if stop.is_set() else 1
        try:
            return await _serve(nc, cfg, subjects, scoring, stop)
        finally:
            await nc.close()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def _connect(
    options: dict[str, Any], deadline_s: float, stop: asyncio.Event
) -> Client | None:
    """The first connect, bounded by ``deadline_s`` and by a stop signal."""
    connecting = asyncio.ensure_future(nats.connect(**options))
    stopping = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait(
        {connecting, stopping}, timeout=deadline_s, return_when=asyncio.FIRST_COMPLETED
    )
    stopping.cancel()
    await asyncio.gather(stopping, return_exceptions=True)
    if connecting in done and connecting.exception() is None:
        return connecting.result()
    connecting.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await connecting
    if not stop.is_set():
        print(f"metalguard: cannot connect to {', '.join(options['servers'])}", file=sys.stderr)
    return None


async def _serve(
    nc: Client,
    cfg: ControllerConfig,
    subjects: Subjects,
    scoring: ScoringConfig,
    stop: asyncio.Event,
) -> int:
    js = nc.jetstream(timeout=cfg.nats.publish_timeout_s)
    try:
        await ensure_streams(js, subjects)
        store = await NodeStore.open(js, subjects)
    except NatsError as exc:
        print(f"metalguard: JetStream setup failed: {exc}", file=sys.stderr)
        return 1
    controller = RegionController(
        js,
        store,
        subjects,
        cfg.region,
        cfg.lifecycle,
        scoring,
        publish_timeout_s=cfg.nats.publish_timeout_s,
    )
    ingest = start_ingest(js, subjects, cfg.region, controller)
    api = None
    if cfg.http is not None:
        source = NatsEventSource(nc, subjects, cfg.region)
        try:
            api = await start_api(cfg.http, controller, source, ingest.metrics.registry)
        except ConfigError as exc:
            print(f"metalguard: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:
            print(f"metalguard: cannot serve HTTP on {cfg.http.listen}: {exc}", file=sys.stderr)
            return 1
    try:
        await controller.start(silence_interval_s=cfg.silence_check_s)
        await ingest.start()
        log.info("controller for region %s running: %d nodes known", cfg.region, len(store.records))
        await stop.wait()
        log.info("stopping")
    except NatsError as exc:
        print(f"metalguard: controller failed: {exc}", file=sys.stderr)
        return 1
    finally:
        if api is not None:
            await api.cleanup()
        await ingest.stop()
        await controller.stop()
    log.info("stopped")
    return 0
