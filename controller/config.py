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
from metalguard.controller.provision.spec import node_problems
from metalguard.controller.shards.plan import ShardsSection
from metalguard.proto.access import ConfigSection, NatsAccess, Seconds
from metalguard.proto.addresses import AddressError, parse_listen
from metalguard.proto.base import Token
from metalguard.proto.documents import DocumentError, load_document
from metalguard.proto.tenants import TenantQuota


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
    max_concurrent_nodes: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 256

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


class JobsSection(_Section, frozen=True):
    """``[jobs]``: the job manager's defaults (docs/jobs.md)."""

    hang_timeout_s: Annotated[float, msgspec.Meta(ge=0)] = 1800.0
    """The hang timeout of a job that sets no ``hang_timeout``: a member whose step stands
    still this long, once it has reported progress, makes the job hung (0: off)."""
    blame_min_jobs: Annotated[int, msgspec.Meta(ge=1)] = 3
    """A node blamed by the failed, crashed or hung generations of this many different
    jobs (their other nodes not failing) ..."""
    blame_window_s: Annotated[float, msgspec.Meta(gt=0)] = 86_400.0
    """... within this window is suspected: SUB_HEALTHY for the window (docs/jobs.md)."""
    straggler_threshold: Annotated[float, msgspec.Meta(gt=0)] = 0.08
    """A node whose ranks compute this much slower than their same-role peers ...
    (docs/jobs.md "Stragglers")"""
    straggler_persistence: Annotated[int, msgspec.Meta(ge=1)] = 4
    """... in this many consecutive timing windows (each a job's ``timing_window_s``, 30 s
    by default) ..."""
    straggler_warmup_windows: Annotated[int, msgspec.Meta(ge=0)] = 1
    """... not counting this many windows after each (re)start ..."""
    straggler_hold_s: Annotated[float, msgspec.Meta(gt=0)] = 86_400.0
    """... is a straggler: SUB_HEALTHY for this long (an uncordon ends it sooner)."""
    straggler_restart_cost_s: Annotated[float, msgspec.Meta(ge=0)] = 300.0
    """A restart's cost for a job that states no ``restart_cost_s`` (the move rule)."""


class TenantSection(_Section, frozen=True):
    """One ``[[tenants]]`` table: a tenant's quota (docs/scheduler.md "Tenant quotas").
    Seeds the quota store; ``metalguard tenants set`` changes it later."""

    name: Token
    gpus: Annotated[int, msgspec.Meta(ge=0)] = 0
    """GPUs guaranteed."""
    gpus_by_type: dict[str, Annotated[int, msgspec.Meta(ge=0)]] = {}
    """Per GPU type, where the fleet mixes types (each part of ``gpus``)."""
    borrow_limit: Annotated[int, msgspec.Meta(ge=0)] | None = None
    """GPUs it may use beyond its guarantee (unset: any idle capacity)."""
    lend_limit: Annotated[int, msgspec.Meta(ge=0)] | None = None
    """GPUs of its unused guarantee others may borrow (unset: all of it)."""

    def __post_init__(self) -> None:
        typed = sum(self.gpus_by_type.values())
        if typed > self.gpus:
            raise ValueError(f"gpus_by_type sums to {typed}, above the tenant's gpus ({self.gpus})")
        if self.lend_limit is not None and self.lend_limit > self.gpus:
            raise ValueError(
                f"lend_limit {self.lend_limit} is above the tenant's gpus ({self.gpus})"
            )


class RemediationSection(_Section, frozen=True):
    """``[remediation]``: what the controller asks of a node's own hardware once the node
    is out of the way (docs/decisions.md, "GPU")."""

    gpu_reset: bool = True
    """Reset the GPUs of a drained node whose GPUs wait for a reset (``gpu_reset``)."""
    power_cycle: bool = True
    """Power-cycle through its BMC a node FAILING for a lost GPU (XID 79)."""
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 300.0
    """How long one remedy's reply may take."""


class ProvisionNodeSection(_Section, frozen=True):
    """One ``[[provision.nodes]]`` entry: a node the service may deploy and its boot MAC."""

    node: str
    """The node's handle, ``region.cluster.node``."""
    mac: str
    """The MAC its firmware network-boots with (``52:54:00:12:34:01``)."""


class ProvisionSection(_Section, frozen=True):
    """``[provision]``: network boot, tenant volumes, instances (docs/provisioning.md).
    Without ``enabled = true`` no provisioning service runs."""

    enabled: bool = False
    data_dir: str = "/var/lib/metalguard/provision"
    """Base images (``images/``) and tenant volumes (``volumes/``) on the storage host."""
    boot_listen: str = "127.0.0.1:8490"
    """Where the boot server (iPXE scripts, kernel, initrd, ready reports) listens."""
    boot_url: str = ""
    """The boot server's base URL as the nodes reach it ("" = ``http://<boot_listen>``)."""
    nbd_listen: str = "127.0.0.1:10809"
    """Where the NBD export server (one qemu-storage-daemon) listens."""
    nbd_host: str = ""
    """The NBD server's address as the nodes reach it ("" = ``nbd_listen``'s host)."""
    nbd_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    """... and its port (0 = ``nbd_listen``'s port)."""
    kernel: str = ""
    """The kernel served as ``/files/vmlinuz``."""
    initrd: str = ""
    """The initramfs (with the ``nbdroot=`` client) served as ``/files/initrd``."""
    kernel_args: str = ""
    """More kernel command-line words for every boot, after the boot chain's own (a VM
    under TCG boots ~3-10 s faster with ``quiet cryptomgr.notests rodata=off acpi=off``)."""
    deploy_timeout_s: Seconds = 600.0
    """A boot with no ready report by then failed (retried on another node for a request
    that named none)."""
    deploy_attempts: Annotated[int, msgspec.Meta(ge=1, le=100)] = 3
    """The most nodes one request is tried on."""
    max_failures: Annotated[int, msgspec.Meta(ge=0)] = 3
    """Consecutive failed deploys after which a node is flagged (0: never)."""
    bmc_timeout_s: Seconds = 300.0
    """How long a BMC command (PXE override, power cycle) may take to answer."""
    tick_s: Seconds = 1.0
    """How often deadlines, node grades and unfinished releases are looked at."""
    image_source_dirs: tuple[str, ...] = ()
    """Directories an image may be built from (``POST /v1/images`` with a ``directory``):
    the directory must lie below one of them.  Empty: any directory the controller can
    read (what an admin token then reaches: keep it set in production)."""
    nodes: tuple[ProvisionNodeSection, ...] = ()

    def __post_init__(self) -> None:
        relative = [d for d in self.image_source_dirs if not d.startswith("/")]
        if relative:
            raise ValueError(f"image_source_dirs: {relative[0]!r} is not an absolute path")
        for key in ("boot_listen", "nbd_listen"):
            try:
                parse_listen(getattr(self, key))
            except AddressError as exc:
                raise ValueError(f"{key}: {exc}") from None
        if self.boot_url and not self.boot_url.startswith(("http://", "https://")):
            raise ValueError("boot_url: must start with http:// or https://")
        problems = node_problems((n.node, n.mac) for n in self.nodes)
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def base_url(self) -> str:
        """The boot server's URL as the nodes reach it, without a trailing slash."""
        if self.boot_url:
            return self.boot_url.rstrip("/")
        return f"http://{self.boot_listen}"

    @property
    def nbd_endpoint(self) -> tuple[str, int]:
        """The NBD server's (host, port) as the nodes reach it."""
        listen = parse_listen(self.nbd_listen)
        return self.nbd_host or listen.host, self.nbd_port or listen.port or 10809


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
    shards: ShardsSection | None = None
    """``[shards]``: this process is one of the region's controller shards, each owning
    a group of clusters by a lease (docs/scaling.md); needs ``[ha] instance``."""
    federation: FederationSection = FederationSection()
    jobs: JobsSection = JobsSection()
    """``[jobs]``: the job manager's defaults (docs/jobs.md)."""
    tenants: tuple[TenantSection, ...] = ()
    """``[[tenants]]``: the tenants' quotas (docs/scheduler.md "Tenant quotas")."""
    remediation: RemediationSection = RemediationSection()
    """``[remediation]``: GPU resets and power cycles (docs/decisions.md)."""
    topology: TopologySection = TopologySection()
    """``[topology]``: zones of clusters, per-rack and per-node overrides of what the
    nodes report (docs/scheduler.md)."""
    provision: ProvisionSection = ProvisionSection()
    """``[provision]``: network boot and tenant volumes (docs/provisioning.md)."""

    def __post_init__(self) -> None:
        names = [t.name for t in self.tenants]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"tenants: {', '.join(twice)} listed more than once")
        if self.shards is not None and self.ha is None:
            raise ValueError("[shards] needs [ha] instance (the shard leases' holder)")
        if self.shards is not None and (self.ingest.clusters or self.ingest.shard_count):
            raise ValueError(
                "[shards] gives each shard its clusters: leave [ingest] clusters and shard_* unset"
            )

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


def configured_quotas(cfg: ControllerConfig) -> list[TenantQuota]:
    """The ``[[tenants]]`` tables as quotas (what seeds MG_TENANTS)."""
    return [
        TenantQuota(
            name=t.name,
            gpus=t.gpus,
            gpus_by_type=dict(t.gpus_by_type),
            borrow_limit=t.borrow_limit,
            lend_limit=t.lend_limit,
            updated_by="config",
        )
        for t in cfg.tenants
    ]


def parse_config(text: str, source: str = "<config>") -> ControllerConfig:
    """Parse TOML text into a ControllerConfig; raise ConfigError naming source, key, problem."""
    return load_document(text, ControllerConfig, source=source, error=ConfigError)


def load_config(path: Path) -> ControllerConfig:
    """Read and parse the config file at ``path``."""
    return load_document(path, ControllerConfig, error=ConfigError)
