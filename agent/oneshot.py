"""``metalguard agent collect --once``: one TelemetryBatch on stdout, exit 0.

Collector failures are entries in ``errors``, not a failing exit status; only a bad
config or bad arguments exit 2.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import TextIO

import msgspec

from metalguard.agent.batch import build_batch
from metalguard.agent.collection import Collection, UnknownCollectorError, resolve_enabled
from metalguard.agent.config import AgentConfig, ConfigError, load_config
from metalguard.agent.render import render_text
from metalguard.agent.settings import collector_settings, node_identity
from metalguard.proto.codec import encode_json
from metalguard.proto.telemetry import TelemetryBatch


def _with_overrides(
    config: AgentConfig,
    sysfs: Path | None,
    procfs: Path | None,
    smart_json_dir: Path | None,
) -> AgentConfig:
    collect = config.collect
    changes: dict[str, str] = {}
    if sysfs is not None:
        changes["sysfs"] = str(sysfs)
    if procfs is not None:
        changes["procfs"] = str(procfs)
    if smart_json_dir is not None:
        changes["smart_json_dir"] = str(smart_json_dir)
    return msgspec.structs.replace(config, collect=msgspec.structs.replace(collect, **changes))


async def collect_once(config: AgentConfig, names: list[str]) -> TelemetryBatch:
    """Run every named collector once and return the batch."""
    collection = Collection(
        names,
        collector_settings(config),
        base_interval_s=config.collect.interval_s,
        timeout_s=config.collect.timeout_s,
    )
    started = time.time()
    try:
        cycle = await collection.run_cycle(force=True)
    finally:
        await collection.close()
    batch = build_batch(
        node_identity(config),
        1,
        cycle,
        ts=time.time(),
        started_ts=started,
        interval_s=config.collect.interval_s,
        topology=config.node.topology(),
    )
    if config.bmc:  # [[bmc]] targets: their readings join the top-level `bmc` list
        from metalguard.agent.bmc.proxy import read_targets

        readings = await read_targets(config.bmc, config.bmc_proxy.concurrency)
        batch = msgspec.structs.replace(batch, bmc=(*batch.bmc, *readings), ts=time.time())
    return batch


def main_collect(
    *,
    config_path: Path | None,
    sysfs: Path | None,
    procfs: Path | None,
    smart_json_dir: Path | None,
    collectors: str | None,
    output_format: str,
    out: TextIO = sys.stdout,
) -> int:
    """CLI body of ``agent collect``; returns the exit status."""
    try:
        config = load_config(config_path) if config_path else AgentConfig()
        config = _with_overrides(config, sysfs, procfs, smart_json_dir)
        wanted = (
            tuple(n.strip() for n in collectors.split(",") if n.strip()) if collectors else None
        )
        names = resolve_enabled(wanted if wanted is not None else config.collect.enabled)
    except (ConfigError, UnknownCollectorError) as exc:
        print(f"metalguard: {exc}", file=sys.stderr)
        return 2
    batch = asyncio.run(collect_once(config, names))
    if output_format == "json":
        out.write(msgspec.json.format(encode_json(batch), indent=2).decode() + "\n")
    else:
        out.write(render_text(batch))
    return 0
