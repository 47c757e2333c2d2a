"""``metalguard controller run`` with ``[shards]``: a shard process (docs/scaling.md).

It runs one :class:`ShardRunner` per shard it competes for (its home shards at once,
the others after ``takeover_after_s``), each with the lease ``shard.<region>.<name>``
and, while held, the shard's controller and ingest.  A shard process decides and
publishes; it serves no HTTP API and runs no jobs, provisioning or federation (run an
unsharded controller, or ``[http]`` on a process of its own, for those).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable

from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.js import JetStreamContext

from metalguard.controller.compose import configured_controller
from metalguard.controller.config import ControllerConfig, IngestSection
from metalguard.controller.core.scoring.config import ScoringConfig
from metalguard.controller.ingest.consumer import IngestSettings
from metalguard.controller.leader import Lease, LeaseTiming, lease_ttl
from metalguard.controller.region import RegionController
from metalguard.controller.shards.plan import (
    ShardsSection,
    candidates,
    durable_prefix,
    shard_key,
)
from metalguard.controller.shards.runner import ShardRunner
from metalguard.controller.state.store import NodeStore
from metalguard.controller.state.streams import ensure_streams
from metalguard.proto.subjects import Subjects

log = logging.getLogger(__name__)


def shard_settings(
    region: str, name: str, clusters: tuple[str, ...], section: IngestSection
) -> IngestSettings:
    """A shard's ingest settings: its clusters, its own durables, ``[ingest]``'s limits."""
    return IngestSettings(
        region=region,
        durable_prefix=durable_prefix(name),
        clusters=clusters,
        fetch_batch=section.fetch_batch,
        max_ack_pending=section.max_ack_pending,
        node_queue_size=section.node_queue_size,
        max_concurrent_nodes=section.max_concurrent_nodes,
    )


async def shard_runners(
    js: JetStreamContext,
    subjects: Subjects,
    cfg: ControllerConfig,
    scoring: ScoringConfig,
    *,
    instance: str,
    section: ShardsSection,
    renew_s: float = 3.0,
    poll_s: float = 0.5,
    margin_s: float = 1.0,
    clock: Callable[[], float] = time.time,
) -> list[ShardRunner]:
    """The runners of the shards this process competes for (not started)."""
    kv = await js.key_value(subjects.bucket("leases"))
    ttl = await lease_ttl(kv, 10.0)
    timing = LeaseTiming(ttl_s=ttl, renew_s=min(renew_s, ttl / 3), poll_s=poll_s, margin_s=margin_s)
    runners = []
    for name, home in candidates(section):
        clusters = section.groups[name]
        settings = shard_settings(cfg.region, name, clusters, cfg.ingest)

        def make(
            store: NodeStore, leading: Callable[[], bool], s: IngestSettings = settings
        ) -> RegionController:
            return configured_controller(
                js, store, subjects, cfg, scoring, leading=leading, owns=s.owns, clock=clock
            )

        lease = Lease(
            kv, cfg.region, instance, timing, key=shard_key(cfg.region, name), clock=clock
        )
        runners.append(
            ShardRunner(
                js,
                subjects,
                name,
                clusters,
                lease,
                make,
                settings,
                silence_interval_s=cfg.silence_check_s,
                start_after_s=0.0 if home else section.takeover_after_s,
            )
        )
    return runners


async def serve_shards(
    nc: Client,
    cfg: ControllerConfig,
    subjects: Subjects,
    scoring: ScoringConfig,
    stop: asyncio.Event,
) -> int:
    """Run this process's shards until ``stop``; the exit status."""
    assert cfg.shards is not None
    if cfg.ha is None:
        print("metalguard: [shards] needs [ha] instance (the lease holder's name)", file=sys.stderr)
        return 2
    js = nc.jetstream(timeout=cfg.nats.publish_timeout_s)
    try:
        await ensure_streams(js, subjects)
        runners = await shard_runners(
            js,
            subjects,
            cfg,
            scoring,
            instance=cfg.ha.instance,
            section=cfg.shards,
            renew_s=cfg.ha.renew_s,
            poll_s=cfg.ha.poll_s,
            margin_s=cfg.ha.margin_s,
        )
    except NatsError as exc:
        print(f"metalguard: JetStream setup failed: {exc}", file=sys.stderr)
        return 1
    for runner in runners:
        await runner.start()
    log.info(
        "shard process %s of region %s: home %s, competing for %s",
        cfg.ha.instance,
        cfg.region,
        ", ".join(cfg.shards.home) or "none",
        ", ".join(r.name for r in runners),
    )
    try:
        await stop.wait()
        log.info("stopping")
    finally:
        for runner in runners:  # first stop competing everywhere, then hand the leases over
            await runner.quiesce()
        for runner in runners:
            await runner.release()
    log.info("stopped")
    return 0
