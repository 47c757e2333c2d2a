"""A large region's controller state in memory, for the API and dashboard at scale
(tests/integration/test_browser_dashboard.py, bench/api_bench.py).

:func:`fleet_view` builds the node records of ``nodes`` nodes (region ``r1``, 32 nodes a
rack, 100 racks a cluster; about 1 % FAILING, 2 % SUB_HEALTHY, 0.5 % UNREACHABLE, 0.2 % in
maintenance, each bad one with a reason) behind the :class:`ControllerView` the API app
reads, with an event source that has no events.  Seeded: the same fleet every run.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from metalguard.controller.api.sse import NEW_ONLY, Deliver, StartAt, Unsubscribe
from metalguard.controller.core.lifecycle import OperatorAction
from metalguard.controller.core.scoring.signals import NodeSignals
from metalguard.proto.base import NodeIdentity, Reason
from metalguard.proto.events import ControllerEvent
from metalguard.proto.nodes import Grade, NodeRecord

NODES_PER_RACK = 32
RACKS_PER_CLUSTER = 100
BAD: tuple[tuple[float, Grade, str], ...] = (
    (0.010, "FAILING", "ecc_uncorrectable"),
    (0.030, "SUB_HEALTHY", "pcie_aer_correctable_rate"),
    (0.035, "UNREACHABLE", "silent"),
    (0.037, "MAINTENANCE", "operator"),
)


def place(i: int) -> tuple[str, str, str]:
    """Node ``i``'s cluster, rack and name."""
    rack, slot = divmod(i, NODES_PER_RACK)
    cluster = rack // RACKS_PER_CLUSTER
    return f"c{cluster:03d}", f"k{rack:05d}", f"c{cluster:03d}k{rack:05d}n{slot:02d}"


def records(nodes: int, seed: int = 20) -> Iterator[NodeRecord]:
    rng = random.Random(seed)
    for i in range(nodes):
        cluster, rack, name = place(i)
        draw = rng.random()
        grade: Grade = next((g for share, g, _ in BAD if draw < share), "HEALTHY")
        rule = next((r for share, _, r in BAD if draw < share), "")
        reasons = (
            (Reason(signal=rule, value=1, threshold=0, rule=rule, message=rule),) if rule else ()
        )
        yield NodeRecord(
            node=NodeIdentity(region="r1", cluster=cluster, node=name, uuid=f"uuid-{i:08d}"),
            grade=grade,
            score=100.0 if grade == "HEALTHY" else 40.0,
            reasons=reasons,
            rack=rack,
            cordoned=grade == "MAINTENANCE",
            maintenance=grade == "MAINTENANCE",
            last_seen_ts=1_700_000_000.0 + i % 30,
            interval_s=30.0,
        )


@dataclass
class FleetStore:
    records: dict[str, NodeRecord] = field(default_factory=dict)


@dataclass
class FleetView:
    """The region's records; no signals, readings, warm datasets or operator actions."""

    store: FleetStore

    async def operator_action(
        self, handle: str, action: OperatorAction, reason: str, who: str
    ) -> tuple[ControllerEvent, ...]:
        raise KeyError(handle)

    def recent_signals(self, handle: str) -> NodeSignals | None:
        return None

    def recent_readings(self, handle: str) -> dict[str, Any]:
        return {}

    def warm_datasets(self, handle: str) -> frozenset[str]:
        return frozenset()


class NoEvents:
    """An event source without events (the dashboard's stream stays open and quiet)."""

    async def subscribe(self, deliver: Deliver, start: StartAt = NEW_ONLY) -> Unsubscribe:
        async def unsubscribe() -> None:
            return None

        return unsubscribe

    async def history(
        self, start: StartAt, limit: int
    ) -> tuple[list[tuple[ControllerEvent, int]], bool]:
        return [], False


def fleet_view(nodes: int) -> FleetView:
    """The view over ``nodes`` synthetic node records."""
    return FleetView(FleetStore({r.node.handle: r for r in records(nodes)}))
