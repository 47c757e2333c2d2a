"""How the region's state names its nodes and clusters (pure): a node by its
``NodeIdentity.handle`` (``region.cluster.node``), a cluster by its :data:`ClusterKey`."""

from __future__ import annotations

ClusterKey = tuple[str, str]
"""(region, cluster)"""
