"""The scoring rules, one module per hardware area; each rule is a pure function.

``RULES`` is every rule in evaluation order; ``COUNTER_SOURCES`` every function that names
the counters whose history the rules read.
"""

from __future__ import annotations

from metalguard.controller.core.rules import (
    bmc,
    cooling,
    disks,
    gpu,
    kmsg,
    memory,
    network,
    pcie,
    pipeline,
    rdma,
)
from metalguard.controller.core.rules.base import Context, CounterSource, Finding, Rule

RULES: tuple[Rule, ...] = (
    *memory.RULES,
    *pcie.RULES,
    *disks.RULES,
    *gpu.RULES,
    *cooling.RULES,
    *bmc.RULES,
    *network.RULES,
    *rdma.RULES,
    *kmsg.RULES,
    *pipeline.RULES,
)
COUNTER_SOURCES: tuple[CounterSource, ...] = (
    memory.counters,
    pcie.counters,
    disks.counters,
    gpu.counters,
    network.counters,
    rdma.counters,
    kmsg.counters,
)

__all__ = ["COUNTER_SOURCES", "RULES", "Context", "CounterSource", "Finding", "Rule"]
