"""The collector interface, its registry, and the runner that times and guards each run.

A collector module holds pure parse functions (text or JSON in, proto Structs out) and a
thin class whose async ``collect()`` reads its inputs and calls them.  It registers
itself with :func:`register`; the agent enables collectors by name from its config.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

from metalguard.proto.telemetry import CollectorError, CollectorRun

if TYPE_CHECKING:
    from metalguard.agent.collectors.gpu_xids import XidLedger
    from metalguard.agent.config import CacheSection

log = logging.getLogger(__name__)

BatchField = Literal[
    "edac", "pcie", "hwmon", "smart", "bmc", "gpu", "net", "rdma", "cache", "iommu"
]
"""The TelemetryBatch field a collector fills."""

Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class CollectorSettings:
    """What every collector may need from the agent's configuration."""

    sysfs: Path = Path("/sys")
    procfs: Path = Path("/proc")
    smart_json_dir: Path | None = None
    smartctl: str = "smartctl"
    smart_timeout_s: float = 30.0
    smart_concurrency: int = 4
    options: dict[str, object] = field(default_factory=dict)
    """Collector-specific options, keyed ``<collector>.<key>`` (e.g. BMC addresses)."""
    cache: CacheSection | None = None
    """``[cache]``: the dataset caches whose stats files the ``cache`` collector reads."""
    nvml: object | None = None
    """The NVML binding of the ``gpu`` collector (None: nvidia-ml-py's ``pynvml``; a
    simulated fleet gives its own)."""
    xid_ledger: XidLedger | None = None
    """The agent's XIDs per GPU (filled by its XID watcher), reported in ``xid_errors``."""


@dataclass(frozen=True, slots=True)
class Collected:
    """One collector run's output: readings for one batch field, plus its errors."""

    field: BatchField
    items: tuple[object, ...] = ()
    errors: tuple[CollectorError, ...] = ()


class Collector(Protocol):
    """One source of readings.  ``collect`` must not raise for bad input; the runner
    still guards it, so a bug becomes an error entry instead of a crash."""

    name: str
    field: BatchField

    async def collect(self) -> Collected:
        """Read the source once."""
        ...


CollectorFactory = Callable[[CollectorSettings], Collector]


@dataclass(frozen=True, slots=True)
class Registration:
    """A registered collector kind."""

    name: str
    factory: CollectorFactory
    default_interval_s: float
    enabled_by_default: bool


REGISTRY: dict[str, Registration] = {}


def register(
    name: str, *, default_interval_s: float, enabled_by_default: bool = True
) -> Callable[[CollectorFactory], CollectorFactory]:
    """Class decorator: make a collector available under ``name``."""

    def wrap(factory: CollectorFactory) -> CollectorFactory:
        if name in REGISTRY:
            raise ValueError(f"collector {name!r} registered twice")
        REGISTRY[name] = Registration(name, factory, default_interval_s, enabled_by_default)
        return factory

    return wrap


async def run_guarded(
    collector: Collector, clock: Clock = time.perf_counter
) -> tuple[Collected, CollectorRun]:
    """Run one collector, timed; any exception becomes an error entry, never escapes."""
    start = clock()
    try:
        result = await collector.collect()
        success = not result.errors or bool(result.items)
    except Exception as exc:
        log.exception("collector %s failed", collector.name)
        result = Collected(
            field=collector.field,
            errors=(
                CollectorError(collector=collector.name, message=f"{type(exc).__name__}: {exc}"),
            ),
        )
        success = False
    return result, CollectorRun(
        collector=collector.name, duration_s=clock() - start, success=success
    )
