"""The region controller as controller.toml describes it: the one place that builds it,
for ``controller run`` (controller/service.py) and for each shard a process owns
(controller/shards/service.py)."""

from __future__ import annotations

import time
from collections.abc import Callable

from nats.js import JetStreamContext

from metalguard.controller.config import ControllerConfig
from metalguard.controller.core.scoring.config import ScoringConfig
from metalguard.controller.core.topology import TopologyView
from metalguard.controller.region import RegionController
from metalguard.controller.state.store import NodeStore
from metalguard.proto.subjects import Subjects


def configured_controller(
    js: JetStreamContext,
    store: NodeStore,
    subjects: Subjects,
    cfg: ControllerConfig,
    scoring: ScoringConfig,
    *,
    leading: Callable[[], bool],
    owns: Callable[[str, str, str], bool],
    clock: Callable[[], float] = time.time,
) -> RegionController:
    """A RegionController over ``store`` with ``cfg``'s region, lifecycle, publish timeout
    and topology, deciding for the nodes ``owns`` accepts while ``leading()``."""
    return RegionController(
        js,
        store,
        subjects,
        cfg.region,
        cfg.lifecycle,
        scoring,
        publish_timeout_s=cfg.nats.publish_timeout_s,
        leading=leading,
        owns=owns,
        topology=TopologyView(cfg.topology),
        clock=clock,
    )
