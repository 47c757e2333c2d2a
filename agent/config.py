"""The agent's TOML configuration (docs/agent.md), validated with a clear error.

A config error names the file, the key and the problem::

    agent.toml: collect.interval_s: Expected `float` >= 0.5, got -1
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import msgspec

from metalguard.agent.bmc.targets import BmcTarget
from metalguard.proto.access import ConfigSection, NatsAccess, Seconds
from metalguard.proto.addresses import AddressError, parse_listen
from metalguard.proto.base import DatasetName, Token
from metalguard.proto.documents import DocumentError, load_document
from metalguard.proto.topology import NodeTopology

MIB = 1024 * 1024


class ConfigError(DocumentError):
    """The config file is unreadable or invalid; the message names file, key, problem."""


_Section = ConfigSection


class NodeSection(NodeTopology, _Section, frozen=True, forbid_unknown_fields=True):
    """``[node]``: where the node sits and what it is called, and its topology and
    capacity for the scheduler (the NodeTopology keys: docs/scheduler.md), sent in every
    batch."""

    region: Token = "default"
    cluster: Token = "default"
    name: str = ""
    """Default: the short host name."""
    uuid: str = ""
    """Default: DMI product_uuid, else /etc/machine-id."""

    def topology(self) -> NodeTopology | None:
        """The ``NodeTopology`` these keys describe; None when none is set."""
        topo = NodeTopology(**{f: getattr(self, f) for f in NodeTopology.__struct_fields__})
        return None if topo == NodeTopology() else topo


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


class EventsSection(_Section, frozen=True):
    """``[events]``: sources that publish NodeEvents the moment the kernel or driver
    reports them (docs/collectors-udev-gpu.md)."""

    udev: bool | None = None
    """The kernel uevent monitor; default: on when ``collect.enabled`` is not set."""
    udev_subsystems: tuple[str, ...] = ("pci", "block", "nvme", "net", "hwmon", "infiniband")
    gpu_xid: bool = True
    """Wait for NVML XID events while the gpu collector is enabled."""

    def udev_on(self, collect: CollectSection) -> bool:
        """Whether the agent runs the uevent monitor under ``collect``."""
        return self.udev if self.udev is not None else collect.enabled is None


class KmsgSection(_Section, frozen=True):
    """``[kmsg]``: the kernel log monitor (docs/kmsg.md)."""

    enabled: bool | None = None
    """Default: on when ``collect.enabled`` is not set (the agent reads its own machine)."""
    path: str = "/dev/kmsg"
    """The kernel log: /dev/kmsg, or a file in its format (a simulated node's)."""
    rules: str = ""
    """Your rules (TOML, or node-problem-detector's kernel-monitor.json), read before the
    shipped ones; a rule with a shipped rule's name replaces it."""
    backfill_s: Annotated[float, msgspec.Meta(ge=0)] = 300.0
    """At a first start or after a reboot, the records of the last this many seconds."""
    storm_window_s: Annotated[float, msgspec.Meta(gt=0)] = 60.0
    """Findings of one kind on one device within this are one event with a count."""
    trust_user_records: bool = False
    """Take records written from user space (facility != 0) too: tests, the demo."""
    pstore: tuple[str, ...] = ("/sys/fs/pstore", "/var/lib/systemd/pstore")
    """Where the previous boot's kernel log dumps are (a panic survives only there); each
    dump is read once (docs/kmsg.md "Panics")."""
    journalctl: str = "journalctl"
    """Reads the previous boot's kernel log from the journal, once a boot, for what the
    agent did not see while that boot ran ("" : not read; docs/kmsg.md "Panics")."""

    def on(self, collect: CollectSection) -> bool:
        """Whether the agent runs the kernel log monitor under ``collect``."""
        return self.enabled if self.enabled is not None else collect.enabled is None


class BmcProxySection(_Section, frozen=True):
    """``[bmc_proxy]``: how the agent polls its ``[[bmc]]`` targets (docs/bmc.md)."""

    interval_s: Annotated[float, msgspec.Meta(ge=1)] = 30.0
    concurrency: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 32


class QosSection(_Section, frozen=True):
    """``[qos]``: the flow-control reconciler (docs/qos.md)."""

    enabled: bool = False
    reconcile_interval_s: Annotated[float, msgspec.Meta(ge=0.1)] = 30.0
    """How often the applied state is read back and repaired."""
    interfaces: tuple[str, ...] = ()
    """Interface names overriding the profile's ``interfaces`` selection."""
    netns: str = ""
    """Network namespace whose interfaces are managed (default: the agent's own)."""
    sysfs: str = ""
    """sysfs root of the mlx5 DCQCN knobs (default: ``collect.sysfs``)."""


class WorkloadSection(_Section, frozen=True):
    """``[workload]``: the runner of training processes (docs/workloads.md)."""

    enabled: bool = False
    work_dir: str = "/var/lib/metalguard/work"
    """Each member runs in ``<work_dir>/<job_id>.<rank>/``, its output in ``output.log``."""
    socket: str = "/var/lib/metalguard/workload.sock"
    """The client library's unix socket (``MG_WORKLOAD_SOCKET``)."""
    stop_grace_s: Seconds = 30.0
    """``stop``: SIGTERM, then SIGKILL after this."""
    checkpoint_timeout_s: Seconds = 60.0
    progress_interval_s: Annotated[float, msgspec.Meta(ge=0.1)] = 2.0
    """At most one ``job_progress`` event per member per this many seconds."""
    remember_commands: Annotated[int, msgspec.Meta(ge=16)] = 1024
    """Command ids (with their replies) kept for idempotency."""
    python: str = ""
    """What a ``python``/``python3`` command runs (default: the agent's interpreter)."""
    nvidia_smi: Annotated[str, msgspec.Meta(min_length=1)] = "nvidia-smi"
    """The ``gpu_reset`` verb runs ``<nvidia_smi> --gpu-reset -i N`` (split like a shell)."""
    gpu_reset_timeout_s: Seconds = 120.0
    """How long one GPU's reset may take before the command fails."""


CachePolicyName = Annotated[str, msgspec.Meta(pattern=r"^(auto|lru|pin)$")]


class CacheDataset(_Section, frozen=True):
    """``[[cache.datasets]]``: one node-local dataset cache (docs/cache.md)."""

    name: DatasetName
    source: Annotated[str, msgspec.Meta(min_length=1)]
    """A path (a local, NFS or Lustre mount) or an fsspec URL (``s3://``, ``http://``, ...)."""
    cache_dir: Annotated[str, msgspec.Meta(min_length=1)]
    """The cache's directory on the node's NVMe (its ``stats.json`` is what the agent reads)."""
    max_bytes: Annotated[int, msgspec.Meta(ge=1)]
    mountpoint: str = ""
    """Where ``metalguard cache mount`` presents it (empty: the fsspec path only)."""
    policy: CachePolicyName = "auto"
    min_free_bytes: Annotated[int, msgspec.Meta(ge=0)] = 1024 * MIB
    """Free space kept on the cache's disk: below it the cache stops filling (pass-through)."""
    metadata_ttl_s: Annotated[float, msgspec.Meta(ge=0)] = 30.0
    """How long a listing of the source (sizes, mtimes, ETags) is trusted before re-reading."""


class CacheSection(_Section, frozen=True):
    """``[cache]``: the node's dataset caches (docs/cache.md)."""

    stats_interval_s: Annotated[float, msgspec.Meta(ge=0.1)] = 2.0
    """How often a cache process rewrites its ``stats.json``."""
    datasets: tuple[CacheDataset, ...] = ()

    def __post_init__(self) -> None:
        names = [d.name for d in self.datasets]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"datasets: name {duplicates[0]!r} is used twice")


ListenAddress = Annotated[
    str, msgspec.Meta(pattern=r"^$|^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.\-]+):[0-9]{1,5}$")
]
"""``host:port`` (``[v6]:port``), or empty."""


class MetricsSection(_Section, frozen=True):
    """``[metrics]``: the agent's own Prometheus endpoint (docs/agent.md "Metrics")."""

    listen: ListenAddress = ""
    """``host:port`` serving ``GET /metrics`` (e.g. ``127.0.0.1:9464``); empty: off."""

    def __post_init__(self) -> None:
        if self.listen:
            try:
                parse_listen(self.listen)  # the port's range, the host's form
            except AddressError as exc:
                raise ValueError(f"listen: {exc}") from None


class AgentConfig(_Section, frozen=True):
    """The whole agent configuration."""

    node: NodeSection = NodeSection()
    nats: NatsSection = NatsSection()
    collect: CollectSection = CollectSection()
    spool: SpoolSection = SpoolSection()
    qos: QosSection = QosSection()
    bmc: tuple[BmcTarget, ...] = ()
    """``[[bmc]]``: BMCs this agent reads out of band (the bmc-proxy, docs/bmc.md)."""
    bmc_proxy: BmcProxySection = BmcProxySection()
    events: EventsSection = EventsSection()
    kmsg: KmsgSection = KmsgSection()
    workload: WorkloadSection = WorkloadSection()
    metrics: MetricsSection = MetricsSection()
    cache: CacheSection = CacheSection()


def parse_config(text: str, source: str = "<config>") -> AgentConfig:
    """Parse TOML text into an AgentConfig; raise ConfigError naming source, key, problem."""
    return load_document(text, AgentConfig, source=source, error=ConfigError)


def load_config(path: Path) -> AgentConfig:
    """Read and parse the config file at ``path``."""
    return load_document(path, AgentConfig, error=ConfigError)
