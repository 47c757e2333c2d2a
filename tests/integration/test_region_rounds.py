"""A cluster's inputs decided together (controller/round_queue.py) against a real
nats-server: the same decisions as one round per input, each event once, nothing lost
when a round fails."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import pytest
from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.js import JetStreamContext

from metalguard.controller.core.decide import decide, event_input
from metalguard.controller.core.lifecycle import LifecycleConfig
from metalguard.controller.region import RegionController
from metalguard.controller.round_queue import RoundFailedError
from metalguard.controller.state.store import NodeStore
from metalguard.proto.base import NodeIdentity
from metalguard.proto.codec import decode
from metalguard.proto.events import ControllerEvent, NodeEvent
from metalguard.proto.nodes import NodeRecord
from metalguard.proto.subjects import Subjects
from metalguard.proto.telemetry import TelemetryBatch
from tests.support.clock import T0, ManualClock
from tests.support.scoring_helpers import dimm_mc

INTERVAL = 5.0
NODES = 40
FAILING = 20  # past the rail's share of a 40-node cluster: some are refused


def node(i: int) -> NodeIdentity:
    return NodeIdentity(region="r1", cluster="c1", node=f"n{i:02d}")


def fatal(i: int) -> NodeEvent:
    return NodeEvent(
        node=node(i),
        event_id=f"n{i:02d}-ue",
        ts=T0 + 10,
        kind="ecc_uncorrectable",
        source="edac",
        device="mc0",
        message="uncorrectable ECC error on mc0",
    )


async def control_events(js: JetStreamContext, subjects: Subjects) -> list[ControllerEvent]:
    info = await js.stream_info(subjects.stream_control)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        if info.state.messages == 0:
            break
        msg = await js.get_msg(subjects.stream_control, seq)
        assert msg.data is not None
        out.append(decode(msg.data, ControllerEvent))
    return out


async def healthy_fleet(
    js: JetStreamContext, subjects: Subjects, store: NodeStore | None = None
) -> RegionController:
    clock = ManualClock(T0 + 1)
    store = store or await NodeStore.open(js, subjects)
    controller = RegionController(js, store, subjects, "r1", clock=clock)
    await controller.start()
    for i in range(NODES):
        batch = TelemetryBatch(
            node=node(i), seq=1, ts=T0, interval_s=INTERVAL, edac=(dimm_mc(ue=0),)
        )
        await controller.on_batch(batch, T0 + 0.1)
    return controller


def one_round_each(
    records: dict[str, NodeRecord], controller: RegionController, events: list[NodeEvent]
) -> tuple[list[tuple[str, str]], dict[str, NodeRecord]]:
    """The reference: each input decided in a round of its own (pure), in order."""
    records = dict(records)
    rails = dict(controller.store.rails)
    announced: list[tuple[str, str]] = []
    for event in events:
        item = event_input(event, records.get(event.node.handle), T0 + 10.1)
        assert item is not None
        out = decide(records, rails, [item], T0 + 10.1, LifecycleConfig(), {("r1", "c1"): NODES})
        records.update(out.records)
        rails.update(out.rails)
        announced += [(e.kind, e.node.handle) for e in out.events if e.node is not None]
    return announced, records


def rounds_and_inputs(controller: RegionController) -> tuple[float, float]:
    registry = controller.metrics.registry
    rounds = registry.get_sample_value("metalguard_round_inputs_count") or 0.0
    inputs = registry.get_sample_value("metalguard_round_inputs_sum") or 0.0
    return rounds, inputs


async def test_inputs_queued_together_get_the_decisions_of_one_round_each(
    nc: Client, subjects: Subjects
) -> None:
    js = nc.jetstream(timeout=5)
    controller = await healthy_fleet(js, subjects)
    events = [fatal(i) for i in range(FAILING)]
    expected, expected_records = one_round_each(dict(controller.store.records), controller, events)
    assert ("node.isolated", node(0).handle) in expected
    rounds_before, inputs_before = rounds_and_inputs(controller)

    await asyncio.gather(*(controller.on_node_event(e, T0 + 10.1) for e in events))

    rounds, inputs = rounds_and_inputs(controller)
    assert inputs - inputs_before == FAILING
    assert rounds - rounds_before < FAILING  # inputs that waited were decided together
    stream = await control_events(js, subjects)
    assert sorted((e.kind, e.node.handle) for e in stream if e.node is not None) == sorted(expected)
    assert len({e.event_id for e in stream}) == len(stream)  # each event once
    assert controller.store.outbox == {}
    for handle, record in expected_records.items():
        got = controller.store.records[handle]
        assert (got.grade, got.rail_flagged) == (record.grade, record.rail_flagged), handle

    # the same events redelivered: replays, nothing announced again
    await asyncio.gather(*(controller.on_node_event(e, T0 + 10.2) for e in events))
    assert len(await control_events(js, subjects)) == len(stream)
    await controller.stop()

    restarted = await NodeStore.open(js, subjects)
    assert restarted.records == controller.store.records
    assert restarted.outbox == {}


class FailingOnce(NodeStore):
    """A store whose first write of several records at once fails, as a connection lost
    mid-round would (NatsError)."""

    armed = False

    async def put_records(self, records: Iterable[NodeRecord]) -> None:
        records = list(records)
        if self.armed and len(records) > 1:
            self.armed = False
            raise NatsError("injected: connection lost mid-round")
        await super().put_records(records)


async def test_a_failed_round_fails_each_of_its_inputs_and_loses_none(
    nc: Client, subjects: Subjects
) -> None:
    js = nc.jetstream(timeout=5)
    store = await FailingOnce.open(js, subjects)
    assert isinstance(store, FailingOnce)
    controller = await healthy_fleet(js, subjects, store)
    events = [fatal(i) for i in range(4)]  # the rail's share of 40 nodes
    store.armed = True
    # the first takes the free lock alone; the other three queue behind it and are
    # decided together: that round fails
    results = await asyncio.gather(
        *(controller.on_node_event(e, T0 + 10.1) for e in events), return_exceptions=True
    )
    assert not store.armed, "no round of several inputs was written"
    assert [type(r).__name__ for r in results] == [
        "NoneType",
        "Error",  # the round's holder: the round's own error
        "RoundFailedError",
        "RoundFailedError",
    ]
    assert all(
        isinstance(r, RoundFailedError) and isinstance(r.__cause__, NatsError) for r in results[2:]
    )
    # ingest naks the failed ones; their redelivery decides them
    for event, result in zip(events, results, strict=True):
        if isinstance(result, BaseException):
            await controller.on_node_event(event, T0 + 10.3)
    stream = await control_events(js, subjects)
    isolated = sorted(e.node.handle for e in stream if e.kind == "node.isolated" and e.node)
    assert isolated == sorted(e.node.handle for e in events)
    assert len({e.event_id for e in stream}) == len(stream)
    assert controller.store.outbox == {}
    await controller.stop()


@pytest.mark.parametrize("failing", [1, 3])
async def test_a_stale_writer_decides_the_whole_round_again(
    nc: Client, subjects: Subjects, failing: int
) -> None:
    js = nc.jetstream(timeout=5)
    one = await healthy_fleet(js, subjects)
    two = await healthy_fleet(js, subjects)  # its cache is stale once `one` decides
    events = [fatal(i) for i in range(failing)]
    await asyncio.gather(*(one.on_node_event(e, T0 + 10.1) for e in events))
    await asyncio.gather(*(two.on_node_event(e, T0 + 10.1) for e in events))
    stream = await control_events(js, subjects)
    kinds = [(e.kind, e.node.handle) for e in stream if e.node is not None]
    assert sorted(kinds) == sorted(("node.isolated", e.node.handle) for e in events)
    for e in events:
        assert two.store.records[e.node.handle] == one.store.records[e.node.handle]
    for c in (one, two):
        await c.stop()
