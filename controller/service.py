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

from metalguard.controller.api.jobs import JobsView
from metalguard.controller.api.server import start_api
from metalguard.controller.api.sse import NatsEventSource
from metalguard.controller.compose import configured_controller
from metalguard.controller.config import (
    ConfigError,
    ControllerConfig,
    IngestSection,
    JobsSection,
    NatsSection,
    configured_quotas,
    load_config,
)
from metalguard.controller.core.scoring.config import ScoringConfig
from metalguard.controller.core.stragglers import Settings as DetectorSettings
from metalguard.controller.federation.jobs import FederatedJobs
from metalguard.controller.federation.service import Federation
from metalguard.controller.federation.view import busy_nodes, job_counts
from metalguard.controller.ingest.consumer import Ingest, IngestSettings
from metalguard.controller.ingest.settings import tune_gc
from metalguard.controller.jobs.manager import JobManager, JobSettings
from metalguard.controller.jobs.store import JobStore
from metalguard.controller.jobs.straggler_watch import WatchSettings
from metalguard.controller.jobs.tenant_store import TenantStore
from metalguard.controller.leader import Leadership, region_leadership
from metalguard.controller.listener_metrics import ListenerCollector
from metalguard.controller.provision.run import Provisioning
from metalguard.controller.provision.storage import StorageError
from metalguard.controller.qos import QosStore
from metalguard.controller.region import RegionController
from metalguard.controller.remediation import Remediation, remediation_verbs
from metalguard.controller.shards.service import serve_shards
from metalguard.controller.state.store import NodeStore
from metalguard.controller.state.streams import ensure_streams
from metalguard.controller.task_dump import log_task_stacks
from metalguard.proto.access import connect_options as access_options
from metalguard.proto.access import tls_context
from metalguard.proto.subjects import Subjects

log = logging.getLogger(__name__)

RECONNECT_WAIT_S = 1.0
"""Between the controller's reconnect attempts (it retries for ever)."""


def connect_options(cfg: NatsSection) -> dict[str, Any]:
    """Keyword arguments of ``nats.connect`` for the ``[nats]`` section."""
    try:
        ctx = tls_context(cfg.tls_ca, cfg.tls_cert, cfg.tls_key)
    except ValueError as exc:
        raise ConfigError(f"nats.tls_*: {exc}") from None
    options = access_options(
        cfg, name="metalguard-controller", tls=ctx, reconnect_wait_s=RECONNECT_WAIT_S
    )
    options["error_cb"] = _on_error
    return options


async def _on_error(exc: Exception) -> None:
    log.warning("NATS: %s", exc or type(exc).__name__)


def ingest_settings(
    region: str, section: IngestSection | None = None, instance: str = ""
) -> IngestSettings:
    """The ingest settings of ``[ingest]`` for ``region``; an HA ``instance`` has consumers
    of its own (every controller of the region sees every message)."""
    section = section or IngestSection()
    shard = None
    if section.shard_index is not None and section.shard_count is not None:
        shard = (section.shard_index, section.shard_count)
    return IngestSettings(
        region=region,
        durable_prefix=f"mg-controller-{instance}" if instance else "mg-controller",
        clusters=section.clusters,
        shard=shard,
        fetch_batch=section.fetch_batch,
        max_ack_pending=section.max_ack_pending,
        node_queue_size=section.node_queue_size,
        max_concurrent_nodes=section.max_concurrent_nodes,
    )


def start_ingest(
    js: JetStreamContext,
    subjects: Subjects,
    region: str,
    handler: RegionController,
    instance: str = "",
    settings: IngestSettings | None = None,
) -> Ingest:
    """The ingest consumers for ``region`` (``settings``: from ``[ingest]``), feeding
    ``handler`` (not yet started); its metrics registry also holds the handler's decision
    metrics."""
    registry = handler.metrics.registry
    settings = settings or ingest_settings(region, instance=instance)
    return Ingest(js, subjects, settings, handler, registry=registry)


async def start_leadership(
    js: JetStreamContext, subjects: Subjects, cfg: ControllerConfig
) -> Leadership:
    """The HA gate of ``[ha]`` (a lease in ``<P>_LEASES``), or one that always leads."""
    if cfg.ha is None:
        return Leadership.always()
    kv = await js.key_value(subjects.bucket("leases"))
    return await region_leadership(
        kv,
        cfg.region,
        cfg.ha.instance,
        renew_s=cfg.ha.renew_s,
        poll_s=cfg.ha.poll_s,
        margin_s=cfg.ha.margin_s,
    )


def reload_on_election(leadership: Leadership, controller: RegionController) -> None:
    """On taking the lease, the controller reloads its records from KV (the previous
    leader's decisions) before it may act; in place, so the job manager and the
    federation, which hold the same store, see them too."""

    async def reload() -> None:
        await controller.store.reload()

    leadership.on_elected = reload


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
    loop.add_signal_handler(signal.SIGUSR1, log_task_stacks)  # where is it stuck?
    try:
        nc = await _connect(options, cfg.nats.connect_deadline_s, stop)
        if nc is None:
            return 0 if stop.is_set() else 1
        try:
            if cfg.shards is not None:  # docs/scaling.md
                return await serve_shards(nc, cfg, subjects, scoring, stop)
            return await _serve(nc, cfg, subjects, scoring, stop)
        finally:
            await nc.close()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
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
        job_store = await JobStore.open(js, subjects)
        tenant_store = await TenantStore.open(js, subjects)
        await tenant_store.seed(configured_quotas(cfg))  # docs/scheduler.md "Tenant quotas"
        leadership = await start_leadership(js, subjects, cfg)
        provisioning = None
        if cfg.provision.enabled:  # docs/provisioning.md
            provisioning = await Provisioning.open(
                nc, js, subjects, cfg.region, cfg.provision, store, leadership.leading
            )
    except NatsError as exc:
        print(f"metalguard: JetStream setup failed: {exc}", file=sys.stderr)
        return 1
    instance = cfg.ha.instance if cfg.ha is not None else ""
    settings = ingest_settings(cfg.region, cfg.ingest, instance)
    controller = configured_controller(
        js, store, subjects, cfg, scoring, leading=leadership.leading, owns=settings.owns
    )
    reload_on_election(leadership, controller)
    jobs = JobManager(  # docs/jobs.md
        nc,
        js,
        job_store,
        store,
        subjects,
        cfg.region,
        JobSettings(
            hang_timeout_s=cfg.jobs.hang_timeout_s,
            blame_min_jobs=cfg.jobs.blame_min_jobs,
            blame_window_s=cfg.jobs.blame_window_s,
            stragglers=straggler_settings(cfg.jobs),
        ),
        fleet=controller.topology.fleet,
        leading=leadership.leading,
        report_running=controller.report_running,
        report_suspects=controller.report_suspects,
        report_stragglers=controller.report_stragglers,
        tenants=tenant_store,
    )
    remediation = Remediation(  # docs/decisions.md, "GPU"
        nc,
        js,
        store,
        subjects,
        cfg.region,
        verbs=remediation_verbs(cfg.remediation),
        timeout_s=cfg.remediation.timeout_s,
        leading=leadership.leading,
    )
    ingest = start_ingest(js, subjects, cfg.region, controller, instance, settings)
    federation = None
    if cfg.federation.enabled:
        federation = Federation(
            nc,
            subjects,
            cfg.region,
            lambda: controller.store.records,
            lambda: controller.topology.fleet(controller.store.records),
            interval_s=cfg.federation.interval_s,
            controller=instance,
            jobs=lambda: job_counts(jobs.jobs),
            busy=lambda: busy_nodes(jobs.jobs),
            leading=leadership.leading,
            latency_ms=cfg.federation.latency_ms,
        )
    ingest.metrics.registry.register(
        ListenerCollector(
            lambda: jobs.bad_events,
            (lambda: federation.bad_messages) if federation is not None else None,
        )
    )
    served_jobs: JobsView = jobs
    if federation is not None:  # docs/federation.md: forwarding and lookups
        served_jobs = FederatedJobs(jobs, federation, leading=leadership.leading)
    api = None
    if cfg.http is not None:
        source = NatsEventSource(nc, subjects, cfg.region)
        try:
            qos = await QosStore.open(js, subjects)
            api = await start_api(
                cfg.http,
                controller,
                source,
                ingest.metrics.registry,
                qos,
                leadership,
                served_jobs,
                fleet=federation,
                provision=provisioning.service if provisioning is not None else None,
                tenants=jobs,
            )
        except ConfigError as exc:
            print(f"metalguard: {exc}", file=sys.stderr)
            return 2
        except NatsError as exc:
            print(f"metalguard: QoS bucket unavailable: {exc}", file=sys.stderr)
            return 1
        except OSError as exc:
            print(f"metalguard: cannot serve HTTP on {cfg.http.listen}: {exc}", file=sys.stderr)
            return 1
    try:
        await leadership.start()
        await controller.start(silence_interval_s=cfg.silence_check_s)
        tune_gc()  # state loaded: freeze it, raise the thresholds (docs/ingest.md)
        await ingest.start()
        await jobs.start()
        await remediation.start()
        if provisioning is not None:
            await provisioning.start()
        if federation is not None:
            await federation.start()
        log.info("controller for region %s running: %d nodes known", cfg.region, len(store.records))
        await stop.wait()
        log.info("stopping")
    except NatsError as exc:
        print(f"metalguard: controller failed: {exc}", file=sys.stderr)
        return 1
    except (StorageError, OSError) as exc:
        print(f"metalguard: provisioning failed to start: {exc}", file=sys.stderr)
        return 1
    finally:
        if api is not None:
            await api.cleanup()
        if provisioning is not None:
            await provisioning.stop()
        if federation is not None:
            await federation.stop()
        await remediation.stop()
        await jobs.stop()
        await ingest.stop()
        await controller.stop()
        await leadership.stop()
    log.info("stopped")
    return 0


def straggler_settings(jobs: JobsSection) -> WatchSettings:
    """The straggler watch's settings from ``[jobs]`` (docs/jobs.md "Stragglers")."""
    return WatchSettings(
        detector=DetectorSettings(
            threshold=jobs.straggler_threshold,
            persistence=jobs.straggler_persistence,
            warmup_windows=jobs.straggler_warmup_windows,
        ),
        hold_s=jobs.straggler_hold_s,
        restart_cost_s=jobs.straggler_restart_cost_s,
    )
