"""The Slurm bridge's TOML configuration (docs/slurm.md).

A config error names the file, the key and the problem::

    slurm-bridge.toml: jobs.signal_scope: Expected `str` matching ...
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import msgspec

from metalguard.controller.config import ConfigError, NatsSection
from metalguard.proto.access import ConfigSection, Seconds
from metalguard.proto.base import Token, node_handle
from metalguard.proto.documents import load_document

DEFAULT_REASON_PREFIX = "metalguard:"
Fraction = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
Count = Annotated[int, msgspec.Meta(ge=0)]


class SlurmSection(ConfigSection, frozen=True):
    """``[slurm]``: how Slurm's own tools are run."""

    bin_dir: str = ""
    """Where ``scontrol``, ``squeue``, ``sinfo``, ``scancel`` live; empty: ``PATH``."""
    conf: str = ""
    """``SLURM_CONF`` for the tools; empty: Slurm's default (``/etc/slurm/slurm.conf``)."""
    output: Literal["auto", "json", "text"] = "auto"
    """``json``: ``sinfo --json``/``squeue --json``; ``text``: parsed text (Slurm < 21.08);
    ``auto``: JSON unless this Slurm refuses ``--json``."""
    command_timeout_s: Seconds = 15.0
    """One run of one command; past it the command is killed and counts as failed."""
    attempts: Annotated[int, msgspec.Meta(ge=1, le=20)] = 4
    """Runs of a failing command before it is reported as failed."""
    backoff_s: Seconds = 0.5
    """Delay before the first retry; doubled each retry (full jitter)."""
    backoff_max_s: Seconds = 15.0
    poll_s: Seconds = 10.0
    """How often Slurm's own view is read (DOWN / NOT_RESPONDING nodes and each node's
    count of active jobs flow back)."""


class JobsSection(ConfigSection, frozen=True):
    """``[jobs]``: how the jobs on an isolated node are checkpointed and requeued."""

    checkpoint_signal: str = "USR1"
    """Sent with ``scancel --signal``; the workload checkpoints on it (and keeps running)."""
    signal_scope: Literal["batch", "full"] = "batch"
    """``batch``: ``scancel --batch`` (the batch script, which should ``exec`` the trainer);
    ``full``: ``scancel --full`` (the batch script, its children and every step)."""
    checkpoint_wait_s: Seconds = 60.0
    """How long the checkpoint may take before ``scontrol requeue``."""


class DrainSection(ConfigSection, frozen=True):
    """``[drain]``: the bridge's own cap on automatic drains (beside the controller's rail)."""

    max_fraction: Fraction = 0.10
    """At most this share of Slurm's nodes drained by metalguard at once (rounded down)."""
    min_nodes: Count = 1
    """Drains always allowed, however small the cluster."""


class BridgeConfig(ConfigSection, frozen=True):
    """The whole file."""

    region: Token
    """The region whose controller's events drive this Slurm cluster (required)."""
    cluster: Token
    """The metalguard cluster of Slurm nodes not named in ``[nodes]`` (required)."""
    reason_prefix: str = DEFAULT_REASON_PREFIX
    """Starts every drain reason the bridge sets; only such nodes are ever resumed."""
    consumer: Token = "slurm-bridge"
    """The durable consumer's name on ``<P>_CONTROL`` (one per bridge)."""
    reconcile_on_start: bool = True
    """At start, drain (and evacuate) what the controller's node records hold out of
    service, as their events would have; never resumes anything."""
    nats: NatsSection = NatsSection()
    slurm: SlurmSection = SlurmSection()
    jobs: JobsSection = JobsSection()
    drain: DrainSection = DrainSection()
    nodes: dict[str, str] = {}
    """metalguard handle (``region.cluster.node``) -> Slurm NodeName, where they differ
    (default: the node's own name)."""

    def __post_init__(self) -> None:
        if not self.reason_prefix.strip():
            raise ValueError("reason_prefix: must not be empty")
        for handle in self.nodes:
            if handle.count(".") != 2:
                raise ValueError(f"nodes: {handle!r} is not region.cluster.node")

    def slurm_name(self, handle: str) -> str:
        """The Slurm NodeName of a metalguard node handle."""
        return self.nodes.get(handle) or handle.rsplit(".", 1)[-1]

    def handle_of(self, slurm_name: str) -> str:
        """The metalguard handle of a Slurm NodeName (the reverse of :meth:`slurm_name`)."""
        for handle, name in self.nodes.items():
            if name == slurm_name:
                return handle
        return node_handle(self.region, self.cluster, slurm_name)


def parse_bridge_config(text: str, source: str = "<config>") -> BridgeConfig:
    """Parse TOML text; ConfigError naming source, key and problem."""
    return load_document(text, BridgeConfig, source=source, error=ConfigError)


def load_bridge_config(path: Path) -> BridgeConfig:
    """Read and parse the bridge's config file."""
    return load_document(path, BridgeConfig, error=ConfigError)
