"""The region controller's TOML configuration (docs/controller.md).

A config error names the file, the key and the problem::

    controller.toml: lifecycle.rail_max_fraction: Expected `float` <= 1.0, got 2
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import msgspec

from metalguard.controller.core.lifecycle import LifecycleConfig
from metalguard.controller.core.scoring.config import (
    DEFAULT_SCORING,
    ScoringConfig,
    ScoringConfigError,
    load_scoring_config,
)
from metalguard.controller.core.topology import TopologySection
from metalguard.proto.access import ConfigSection, NatsAccess, Seconds
from metalguard.proto.addresses import AddressError, parse_listen
from metalguard.proto.base import Token
from metalguard.proto.documents import DocumentError, load_document


class ConfigError(DocumentError):
    """The config file is unreadable or invalid; the message names file, key, problem."""


_Section = ConfigSection


class NatsSection(NatsAccess, frozen=True):
    """``[nats]``: the shared access settings plus the first connect's deadline."""

    connect_deadline_s: Seconds = 30.0
    """The first connect gives up (exit 1) after this long."""


class HttpSection(_Section, frozen=True):
    """``[http]``: the HTTP API (docs/api.md); without the section no API is served."""

    listen: str = "127.0.0.1:8480"
    """``host:port`` (``[::1]:8480`` for IPv6)."""
    read_tokens_file: str = ""
    """Read-only bearer tokens, one per line (``#`` comments and blank lines ignored)."""
    admin_tokens_file: str = ""
    """Admin bearer tokens (also read); writes need one of these."""
    tls_cert: str = ""
    """Serve HTTPS with this certificate chain (PEM); empty: plain HTTP."""
    tls_key: str = ""
    """The certificate's private key (PEM)."""
    tls_client_ca: str = ""
    """Require client certificates signed by this CA (PEM); empty: none asked for."""

    def __post_init__(self) -> None:
        try:
            parse_listen(self.listen)
        except AddressError as exc:
            raise ValueError(f"listen: {exc}") from None


class HaSection(_Section, frozen=True):
    """``[ha]``: one of several controllers of the region; one leads by a KV lease
    (docs/operations.md).  Without the section this controller always leads."""

    instance: Token
    """This controller's name, unique in the region and stable across restarts (it
    names its ingest consumers and the lease's holder)."""
    renew_s: Seconds = 3.0
    """How often the leader renews the lease (below the bucket's TTL minus margin)."""
    poll_s: Seconds = 0.5
    """How often a follower tries to take the lease."""
    margin_s: float = 1.0
    """The leader steps down this long before the TTL after its last renewal."""


class IngestSection(_Section, frozen=True):
    """``[ingest]``: which of the region's nodes this process handles, and how it pulls
    (docs/ingest.md). Without the section: every node of the region, the defaults."""

    clusters: tuple[Token, ...] = ()
    """The clusters this process owns (consumer filter subjects); empty: all. Processes
    of one region must own disjoint sets that together cover it."""
    shard_index: Annotated[int, msgspec.Meta(ge=0)] | None = None
    shard_count: Annotated[int, msgspec.Meta(ge=1)] | None = None
    """Hash sharding by node: this process takes the nodes with
    crc32(region.cluster.node) % shard_count == shard_index (both or neither)."""
    fetch_batch: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 256
    max_ack_pending: Annotated[int, msgspec.Meta(ge=1)] = 4096
    node_queue_size: Annotated[int, msgspec.Meta(ge=1)] = 64
    max_concurrent_nodes: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 64

    def __post_init__(self) -> None:
        if (self.shard_index is None) != (self.shard_count is None):
            raise ValueError("shard_index and shard_count go together")
        if (
            self.shard_index is not None
            and self.shard_count is not None
            and self.shard_index >= self.shard_count
        ):
            raise ValueError("shard_index must be below shard_count")


class FederationSection(_Section, frozen=True):
    """``[federation]``: tell the other regions this one's state and hear theirs
    (docs/federation.md)."""

    enabled: bool = False
    interval_s: Annotated[float, msgspec.Meta(ge=0.1)] = 5.0
    """How often this region's summary is published; older than 3 intervals is stale."""
    latency_ms: dict[Token, Annotated[float, msgspec.Meta(ge=0)]] = {}
    """Round-trip latency from this region to others (ms), for jobs' ``max_latency_ms``;
    a region not listed uses the latency measured between controllers over NATS."""


class ControllerConfig(_Section, frozen=True):
    """The whole file."""

    region: Token
    """The region this controller decides for (required)."""
    scoring: str = ""
    """A scoring TOML file (docs/scoring.md); empty: the defaults."""
    silence_check_s: Seconds = 1.0
    """How often silent nodes are looked for (and pending events retried)."""
    nats: NatsSection = NatsSection()
    lifecycle: LifecycleConfig = LifecycleConfig()
    http: HttpSection | None = None
    ha: HaSection | None = None
    ingest: IngestSection = IngestSection()
    federation: FederationSection = FederationSection()
    topology: TopologySection = TopologySection()
    """``[topology]``: zones of clusters, per-rack and per-node overrides of what the
    nodes report (docs/scheduler.md)."""

    def scoring_config(self, base: Path | None = None) -> ScoringConfig:
        """The scoring config (a relative path is read from ``base``); ConfigError if bad."""
        if not self.scoring:
            return DEFAULT_SCORING
        path = Path(self.scoring)
        if base is not None and not path.is_absolute():
            path = base / path
        try:
            return load_scoring_config(path)
        except ScoringConfigError as exc:
            raise ConfigError(str(exc)) from None


def parse_config(text: str, source: str = "<config>") -> ControllerConfig:
    """Parse TOML text into a ControllerConfig; raise ConfigError naming source, key, problem."""
    return load_document(text, ControllerConfig, source=source, error=ConfigError)


def load_config(path: Path) -> ControllerConfig:
    """Read and parse the config file at ``path``."""
    return load_document(path, ControllerConfig, error=ConfigError)
