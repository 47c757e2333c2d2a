"""The shard map of ``[shards]`` and the pure decisions over it (docs/scaling.md).

A shard is a named group of the region's clusters.  Its owner holds the lease
``shard.<region>.<name>`` in ``<P>_LEASES`` (the same :class:`controller.leader.Lease`
as the HA leader's ``leader.<region>``), consumes the group's clusters through the
shard's own durable consumers (shared by whichever process holds it) and decides for
them alone.  A process takes its ``home`` shards at start; once ``takeover_after_s``
has passed it also polls every other shard's lease, so a dead owner's clusters are
taken within the bucket's TTL plus ``[ha] poll_s``.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from metalguard.proto.access import ConfigSection, Seconds
from metalguard.proto.base import Token
from metalguard.proto.events import ControllerEvent

KEY_PREFIX = "shard."


class ShardsSection(ConfigSection, frozen=True):
    """``[shards]``: the region's shard map and which shards this process prefers."""

    groups: Annotated[dict[Token, tuple[Token, ...]], msgspec.Meta(min_length=1)]
    """Shard name -> its clusters; the same map in every shard process of the region,
    clusters disjoint across shards."""
    home: tuple[Token, ...] = ()
    """Shards this process takes at start (empty: none, a spare)."""
    takeover: bool = True
    """Take other shards whose lease has expired (a dead owner's clusters)."""
    takeover_after_s: Seconds = 5.0
    """How long after start this process waits before taking other shards (their
    owners, starting too, take their home shards first)."""

    def __post_init__(self) -> None:
        seen: dict[str, str] = {}
        for name, clusters in self.groups.items():
            if not clusters:
                raise ValueError(f"groups.{name}: a shard has at least one cluster")
            for cluster in clusters:
                if cluster in seen:
                    raise ValueError(
                        f"groups: cluster {cluster!r} is in shards {seen[cluster]!r} and {name!r}"
                    )
                seen[cluster] = name
        for name in self.home:
            if name not in self.groups:
                raise ValueError(f"home: {name!r} is not a shard of groups")
        if len(set(self.home)) != len(self.home):
            raise ValueError("home repeats a shard")


def shard_key(region: str, name: str) -> str:
    """A shard's lease key in ``<P>_LEASES``."""
    return f"{KEY_PREFIX}{region}.{name}"


def durable_prefix(name: str) -> str:
    """The durable consumers' prefix of a shard: one set per shard, whoever holds it (a
    new owner resumes at the acknowledged position)."""
    return f"mg-shard-{name}"


def candidates(section: ShardsSection) -> list[tuple[str, bool]]:
    """The shards this process competes for, home ones first: (name, home)."""
    if section.takeover:
        names = list(section.home) + sorted(n for n in section.groups if n not in section.home)
    else:
        names = list(section.home)
    return [(n, n in section.home) for n in names]


def event_clusters(event: ControllerEvent) -> str | None:
    """The cluster an event is about (None: none named, e.g. a region-wide event)."""
    if event.node is not None:
        return event.node.cluster
    cluster = event.attributes.get("cluster")
    return cluster if isinstance(cluster, str) else None


def owns_event(event: ControllerEvent, clusters: frozenset[str]) -> bool:
    """Whether a shard owning ``clusters`` publishes this pending event: its own clusters'
    events, and those naming none (a duplicate of those is dropped by the stream)."""
    cluster = event_clusters(event)
    return cluster is None or cluster in clusters
