"""Derive runtime objects (identity, collector settings) from an AgentConfig."""

from __future__ import annotations

from pathlib import Path

from metalguard.agent.collectors.base import CollectorSettings
from metalguard.agent.config import AgentConfig
from metalguard.agent.identity import default_node_name, read_node_uuid, token_from_hostname
from metalguard.proto.base import NodeIdentity


def node_identity(config: AgentConfig) -> NodeIdentity:
    """The node's identity: config values, defaults from the host."""
    node = config.node
    name = token_from_hostname(node.name) if node.name else default_node_name()
    uuid = node.uuid or read_node_uuid(Path(config.collect.sysfs))
    return NodeIdentity(region=node.region, cluster=node.cluster, node=name, uuid=uuid)


def collector_settings(config: AgentConfig) -> CollectorSettings:
    """What the collectors need from the config."""
    c = config.collect
    return CollectorSettings(
        sysfs=Path(c.sysfs),
        procfs=Path(c.procfs),
        smart_json_dir=Path(c.smart_json_dir) if c.smart_json_dir else None,
        smartctl=c.smartctl,
        smart_timeout_s=c.smart_timeout_s,
        smart_concurrency=c.smart_concurrency,
        options=dict(c.options),
        cache=config.cache,
    )
