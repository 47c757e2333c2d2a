"""The agent's TOML configuration (docs/agent.md), validated with a clear error.

A config error names the file, the key and the problem::

    agent.toml: collect.interval_s: Expected `float` >= 0.5, got -1
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import msgspec

from proto.access import ConfigSection, NatsAccess, Seconds
from proto.base import Token
from proto.documents import DocumentError, decode_toml, read_text

MIB = 1024 * 1024


class ConfigError(DocumentError):
    """The config file is unreadable or invalid; the message names file, key, problem."""


_Section = ConfigSection


class NodeSection(_Section, frozen=True):
    """``[node]``: where the node sits and what it is called."""

    region: Token = "default"
    cluster: Token = "default"
    name: str = ""
    """Default: the short host name."""
    uuid: str = ""
    """Default: DMI product_uuid, else /etc/machine-id."""


class NatsSection(NatsAccess, frozen=True):
    """``[nats]``: the shared access settings plus the agent's reconnect backoff."""

    reconnect_base_s: Seconds = 0.5
    reconnect_max_s: Seconds = 30.0


class CollectSection(_Section, frozen=True):
    """``[collect]``: which collectors run, how often, over which roots."""

    interval_s: Annotated[float, msgspec.Meta(ge=0.1)] = 5.0
    enabled: tuple[str, ...] | None = None
    """Collector names; default: every collector enabled by default."""
    intervals: dict[str, Seconds] = {}
    """Per-collector interval overrides, e.g. ``smart = 300``."""
    timeout_s: Seconds = 60.0
    """A collector run longer than this is abandoned and reported."""
    sysfs: str = "/sys"
    procfs: str = "/proc"
    smart_json_dir: str = ""
    smartctl: str = "smartctl"
    smart_timeout_s: Seconds = 30.0
    smart_concurrency: Annotated[int, msgspec.Meta(ge=1, le=64)] = 4
    options: dict[str, Any] = {}
    """Collector-specific options (``[collect.options]``, keys ``<collector>.<key>``)."""


class SpoolSection(_Section, frozen=True):
    """``[spool]``: where batches wait while NATS is unreachable."""

    dir: str = "/var/lib/metalguard/spool"
    max_bytes: Annotated[int, msgspec.Meta(ge=64 * 1024)] = 64 * MIB


class AgentConfig(_Section, frozen=True):
    """The whole agent configuration."""

    node: NodeSection = NodeSection()
    nats: NatsSection = NatsSection()
    collect: CollectSection = CollectSection()
    spool: SpoolSection = SpoolSection()


def parse_config(text: str, source: str = "<config>") -> AgentConfig:
    """Parse TOML text into an AgentConfig; raise ConfigError naming source, key, problem."""
    try:
        return decode_toml(text, AgentConfig, source)
    except DocumentError as exc:
        raise ConfigError(str(exc)) from None


def load_config(path: Path) -> AgentConfig:
    """Read and parse the config file at ``path``."""
    try:
        return parse_config(read_text(path), str(path))
    except DocumentError as exc:
        raise ConfigError(str(exc)) from None
