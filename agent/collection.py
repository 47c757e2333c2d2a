"""Runs the enabled collectors on their own intervals and assembles each cycle's readings.

Every collector keeps its last readings; each batch carries the newest readings of every
collector (a snapshot of the node), while ``collectors`` lists only the runs of this
cycle.  A collector still running from an earlier cycle is not started twice; one that
exceeds its timeout is abandoned and reported as an error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from metalguard.agent.batch import CycleResult
from metalguard.agent.collectors import load_builtin
from metalguard.agent.collectors.base import (
    REGISTRY,
    BatchField,
    Clock,
    Collected,
    Collector,
    CollectorSettings,
    run_guarded,
)
from metalguard.proto.telemetry import CollectorError, CollectorRun

log = logging.getLogger(__name__)


class UnknownCollectorError(ValueError):
    """A configured collector name is not registered."""


@dataclass(slots=True)
class _Slot:
    collector: Collector
    interval_s: float
    next_due: float = 0.0
    last: Collected | None = None
    running: asyncio.Task[tuple[Collected, CollectorRun]] | None = None
    expedited: bool = False
    """Run in the next cycle whatever its schedule (:meth:`Collection.expedite`)."""


def resolve_enabled(enabled: tuple[str, ...] | None) -> list[str]:
    """Collector names to run: the given ones (validated) or every default one."""
    load_builtin()
    if enabled is None:
        return [name for name, reg in REGISTRY.items() if reg.enabled_by_default]
    unknown = [name for name in enabled if name not in REGISTRY]
    if unknown:
        known = ", ".join(sorted(REGISTRY))
        raise UnknownCollectorError(f"unknown collector(s) {', '.join(unknown)}; known: {known}")
    return list(dict.fromkeys(enabled))


class Collection:
    """The agent's collectors with their schedules and last readings."""

    def __init__(
        self,
        names: list[str],
        settings: CollectorSettings,
        *,
        base_interval_s: float,
        intervals: dict[str, float] | None = None,
        timeout_s: float = 60.0,
        clock: Clock = time.monotonic,
    ) -> None:
        load_builtin()
        intervals = intervals or {}
        self._clock = clock
        self._timeout_s = timeout_s
        self._slots: dict[str, _Slot] = {}
        for name in names:
            reg = REGISTRY[name]
            interval = intervals.get(name, reg.default_interval_s)
            self._slots[name] = _Slot(reg.factory(settings), interval)
        self._base_interval_s = base_interval_s

    @property
    def names(self) -> list[str]:
        """Names of the collectors in this collection."""
        return list(self._slots)

    @property
    def tick_s(self) -> float:
        """How often the agent must wake: the shortest collector or batch interval."""
        return min([self._base_interval_s, *(s.interval_s for s in self._slots.values())])

    def expedite(self, names: Iterable[str]) -> bool:
        """Run these collectors in the next cycle, before they are due (a device came or
        went: their readings may be stale).  One still running runs again after it ends.
        Names not in this collection are ignored; True when one of them is in it."""
        found = False
        for name in names:
            slot = self._slots.get(name)
            if slot is not None:
                slot.expedited = found = True
        return found

    async def run_cycle(self, *, force: bool = False) -> CycleResult:
        """Run every due (or expedited) collector, all when ``force``, concurrently;
        never raises."""
        now = self._clock()
        errors: list[CollectorError] = []
        due: dict[str, _Slot] = {}
        for name, slot in self._slots.items():
            if slot.running is not None and not slot.running.done():
                if force or now >= slot.next_due:
                    errors.append(
                        CollectorError(collector=name, message="previous run still in progress")
                    )
                continue
            if force or slot.expedited or now >= slot.next_due:
                slot.expedited = False
                slot.next_due = now + slot.interval_s
                slot.running = asyncio.create_task(run_guarded(slot.collector), name=name)
                due[name] = slot
        runs: list[CollectorRun] = []
        if due:
            _done, pending = await asyncio.wait(
                [s.running for s in due.values() if s.running], timeout=self._timeout_s
            )
            for name, slot in due.items():
                task = slot.running
                if task is None:
                    continue
                if task in pending:
                    errors.append(
                        CollectorError(
                            collector=name, message=f"timed out after {self._timeout_s:g}s"
                        )
                    )
                    runs.append(
                        CollectorRun(collector=name, duration_s=self._timeout_s, success=False)
                    )
                    continue
                result, run = task.result()
                slot.last = result
                slot.running = None
                runs.append(run)
                errors.extend(result.errors)
        readings: dict[BatchField, list[object]] = {}
        for slot in self._slots.values():
            if slot.last is not None:
                readings.setdefault(slot.last.field, []).extend(slot.last.items)
        return CycleResult(
            readings={k: tuple(v) for k, v in readings.items()},
            runs=tuple(runs),
            errors=tuple(errors),
            ran=frozenset(due),
        )

    async def close(self) -> None:
        """Cancel collector runs still in flight."""
        for slot in self._slots.values():
            if slot.running is not None and not slot.running.done():
                slot.running.cancel()
        tasks = [s.running for s in self._slots.values() if s.running is not None]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
