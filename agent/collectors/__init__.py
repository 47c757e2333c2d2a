"""Collectors: one module per source.

Importing this package imports none of them (and no heavy library); :func:`load_builtin`
does, and each module registers itself in :data:`agent.collectors.base.REGISTRY`.
"""

from __future__ import annotations


def load_builtin() -> None:
    """Import the built-in collector modules so that they register themselves."""
    from metalguard.agent.collectors import (  # noqa: F401
        cache,
        edac,
        gpu,
        hwmon,
        iommu,
        netdev,
        pcie,
        rdma,
        smart,
    )
