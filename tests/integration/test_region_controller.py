"""The region controller against a real nats-server: KV state, the control stream,
restarts without duplicates, the outbox, and ``metalguard controller run``."""

from __future__ import annotations

import asyncio
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest
from nats.aio.client import Client
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext

from metalguard.controller.region import RegionController
from metalguard.controller.state.store import NodeStore, StoreConflictError, outbox_key
from metalguard.proto.base import NodeIdentity
from metalguard.proto.codec import decode, encode
from metalguard.proto.events import ControllerEvent, NodeEvent
from metalguard.proto.nodes import NodeRecord
from metalguard.proto.subjects import Subjects
from metalguard.proto.telemetry import BmcReading, TelemetryBatch
from tests.support.clock import T0, ManualClock
from tests.support.scoring_helpers import DIMM_LABEL, dimm_mc
from tests.support.waiting import wait_for_line, wait_for_value

INTERVAL = 5.0
METALGUARD = Path(sys.executable).parent / "metalguard"
DEADLINE_S = 30.0


@dataclass
class Env:
    js: JetStreamContext
    subjects: Subjects


@pytest.fixture
async def env(nc: Client, subjects: Subjects) -> Env:
    """A private prefix with its streams and buckets (the ``subjects`` fixture)."""
    return Env(nc.jetstream(timeout=5), subjects)


def node(name: str) -> NodeIdentity:
    return NodeIdentity(region="r1", cluster="c1", node=name)


def batch(name: str, seq: int, ue: int = 0) -> TelemetryBatch:
    """A batch of ``name`` sent at ``T0 + seq * INTERVAL`` with mc0's UE count."""
    return TelemetryBatch(
        node=node(name),
        seq=seq,
        ts=T0 + seq * INTERVAL,
        interval_s=INTERVAL,
        edac=(dimm_mc(ue=ue),),
    )


async def new_controller(
    env: Env, clock: ManualClock, js: JetStreamContext | None = None
) -> RegionController:
    """A controller as a (re)started process builds it: state loaded from KV."""
    store = await NodeStore.open(env.js, env.subjects)
    controller = RegionController(js or env.js, store, env.subjects, "r1", clock=clock)
    await controller.start()
    return controller


async def control_events(env: Env) -> list[ControllerEvent]:
    """Every ControllerEvent in the control stream, in order."""
    info = await env.js.stream_info(env.subjects.stream_control)
    first, last = info.state.first_seq, info.state.last_seq
    if info.state.messages == 0:
        return []
    out = []
    for seq in range(first, last + 1):
        msg = await env.js.get_msg(env.subjects.stream_control, seq)
        assert msg.data is not None
        out.append(decode(msg.data, ControllerEvent))
    return out


async def feed(
    controller: RegionController, clock: ManualClock, batches: list[TelemetryBatch]
) -> None:
    for b in batches:
        clock.now = b.ts + 0.1
        await controller.on_batch(b, clock.now)


SCENARIO = [
    batch("n1", 1),
    batch("n2", 1),
    batch("n3", 1),
    batch("n1", 2),
    batch("n2", 2),
    batch("n3", 2, ue=1),
]


async def test_ue_growth_isolates_and_a_restart_neither_loses_nor_repeats(env: Env) -> None:
    clock = ManualClock()
    first = await new_controller(env, clock)
    await feed(first, clock, SCENARIO)

    events = await control_events(env)
    assert [e.kind for e in events] == ["node.isolated"]
    isolated = events[0]
    assert isolated.node == node("n3")
    assert isolated.attributes["action"] == "isolate"
    assert isolated.attributes["grade_to"] == "FAILING"
    reason = isolated.reasons[0]
    assert reason.rule == "ecc_uncorrectable"
    assert "mc0" in reason.message
    assert DIMM_LABEL in reason.message
    assert reason.value == 1
    assert isolated.event_id == f"r1.c1.n3:node.isolated:b2@{round((T0 + 2 * INTERVAL) * 1000)}"

    # the state is in KV, not in the process
    kv = await env.js.key_value(env.subjects.bucket("nodes"))
    stored = decode((await kv.get("r1.c1.n3")).value or b"")
    assert getattr(stored, "grade", None) == "FAILING"
    await first.stop()

    second = await new_controller(env, clock)
    assert second.store.records == first.store.records
    assert second.store.rails == first.store.rails
    assert second.store.outbox == {}
    assert second.store.cluster_size("r1", "c1") == 3
    await feed(second, clock, SCENARIO)  # ingest redelivers what was not acknowledged
    assert [e.event_id for e in await control_events(env)] == [isolated.event_id]
    assert second.store.records == first.store.records
    await second.stop()


async def test_a_silent_node_is_unreachable_not_failing(env: Env) -> None:
    clock = ManualClock()
    controller = await new_controller(env, clock)
    await feed(controller, clock, [batch("n1", 1), batch("n2", 1), batch("n1", 2), batch("n2", 2)])
    clock.now = T0 + 2 * INTERVAL + 3 * INTERVAL - 1
    assert await controller.check_silence() == ()
    await controller.on_batch(batch("n1", 3), clock.now)  # n1 keeps talking, n2 is silent
    clock.now = T0 + 2 * INTERVAL + 3 * INTERVAL + 1
    announced = await controller.check_silence()
    assert [(e.kind, e.node) for e in announced] == [("node.unreachable", node("n2"))]
    assert controller.store.records["r1.c1.n2"].grade == "UNREACHABLE"
    assert controller.store.records["r1.c1.n1"].grade == "HEALTHY"
    assert announced[0].reasons[0].signal == "telemetry.silence_s"
    await controller.stop()

    restarted = await new_controller(env, clock)
    assert restarted.store.records["r1.c1.n2"].grade == "UNREACHABLE"
    clock.now += 60  # now n1 is silent too; n2 is already UNREACHABLE: not re-announced
    again = await restarted.check_silence()
    assert [e.node for e in again] == [node("n1")]
    events = await control_events(env)
    assert [e.node for e in events] == [node("n2"), node("n1")]
    await restarted.stop()


async def test_the_silence_task_runs_on_its_own(env: Env) -> None:
    clock = ManualClock()
    controller = await new_controller(env, clock)
    await feed(controller, clock, [batch("n1", 1)])
    clock.now += 10 * INTERVAL
    await controller.start(silence_interval_s=0.05)
    try:
        events = await wait_for_value(
            lambda: control_events(env), lambda ev: len(ev) == 1, DEADLINE_S, "node.unreachable"
        )
    finally:
        await controller.stop()
    assert events[0].kind == "node.unreachable"


class FailingOnce:
    """A JetStream context whose first publish fails as if the controller died there."""

    def __init__(self, js: JetStreamContext) -> None:
        self._js = js
        self.failed = 0

    async def publish(self, *args: Any, **kwargs: Any) -> Any:
        if not self.failed:
            self.failed += 1
            raise NatsTimeoutError
        return await self._js.publish(*args, **kwargs)


async def test_a_decision_persisted_but_not_published_is_published_once_on_restart(
    env: Env,
) -> None:
    clock = ManualClock()
    flaky = FailingOnce(env.js)
    crashed = await new_controller(env, clock, cast(JetStreamContext, flaky))
    await feed(crashed, clock, [batch("n1", 1), batch("n2", 1), batch("n1", 2, ue=3)])
    assert flaky.failed == 1
    assert await control_events(env) == []
    assert crashed.store.records["r1.c1.n1"].grade == "FAILING"
    [pending] = crashed.store.outbox.values()
    assert pending.kind == "node.isolated"
    # (the process dies here: nothing more of it runs)

    restarted = await new_controller(env, clock)
    assert restarted.store.outbox == {}
    assert [e.event_id for e in await control_events(env)] == [pending.event_id]

    # died after the stream acknowledged it but before the outbox entry was deleted:
    # the republish on the next start is dropped by the stream's duplicate window
    kv = await env.js.key_value(env.subjects.bucket("nodes"))
    await kv.put(outbox_key(pending.event_id), encode(pending))
    again = await new_controller(env, clock)
    assert again.store.outbox == {}
    assert [e.event_id for e in await control_events(env)] == [pending.event_id]
    await feed(again, clock, [batch("n1", 2, ue=3)])  # the redelivered batch: a replay
    assert len(await control_events(env)) == 1
    for c in (crashed, restarted, again):
        await c.stop()


async def test_a_fatal_node_event_acts_before_the_next_batch(env: Env) -> None:
    clock = ManualClock()
    controller = await new_controller(env, clock)
    await feed(controller, clock, [batch("n1", 1), batch("n2", 1)])
    event = NodeEvent(
        node=node("n1"),
        event_id="n1-ev-7",
        ts=T0 + 7,
        kind="aer_fatal",
        source="pcie",
        device="0000:41:00.0",
        message="fatal AER error on 0000:41:00.0",
    )
    await controller.on_node_event(event, T0 + 7.1)
    await controller.on_node_event(event, T0 + 7.2)  # redelivered
    events = await control_events(env)
    assert [(e.kind, e.node) for e in events] == [("node.isolated", node("n1"))]
    assert events[0].reasons[0].value == "0000:41:00.0"
    await controller.stop()


async def test_operator_action_is_persisted_and_announced(env: Env) -> None:
    clock = ManualClock()
    controller = await new_controller(env, clock)
    await feed(controller, clock, [batch("n1", 1)])
    announced = await controller.operator_action("r1.c1.n1", "cordon", "swap PSU", "ana")
    assert [e.kind for e in announced] == ["node.cordoned"]
    assert await controller.operator_action("r1.c1.n1", "cordon", "swap PSU", "ana") == ()
    with pytest.raises(KeyError):
        await controller.operator_action("r1.c1.nope", "cordon", "x", "ana")
    await controller.stop()
    restarted = await new_controller(env, clock)
    assert restarted.store.records["r1.c1.n1"].cordoned
    assert [e.kind for e in await control_events(env)] == ["node.cordoned"]
    await restarted.stop()


async def test_controller_run_starts_consumes_and_stops_on_sigterm(
    env: Env, nats_url: str, tmp_path: Path
) -> None:
    config = tmp_path / "controller.toml"
    config.write_text(
        f'region = "r1"\nsilence_check_s = 0.2\n'
        f'[nats]\nservers = ["{nats_url}"]\nprefix = "{env.subjects.prefix}"\n'
    )
    proc = await asyncio.create_subprocess_exec(
        str(METALGUARD),
        "controller",
        "run",
        "--config",
        str(config),
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stderr is not None
    seen: list[str] = []
    try:
        await wait_for_line(proc.stderr, "running", DEADLINE_S, seen)
        b = batch("n1", 1, ue=2)
        await env.js.publish(env.subjects.telemetry("r1", "c1", "n1"), encode(b))
        events = await wait_for_value(
            lambda: control_events(env), lambda ev: len(ev) >= 1, DEADLINE_S, "node.isolated"
        )
        assert events[0].kind == "node.isolated"
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), DEADLINE_S)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, "".join(seen) + err.decode()
    assert "stopped" in err.decode()


async def test_controller_run_rejects_a_bad_config(tmp_path: Path) -> None:
    config = tmp_path / "controller.toml"
    config.write_text('region = "r1"\n[lifecycle]\nrail_max_fraction = 2\n')
    proc = await asyncio.create_subprocess_exec(
        str(METALGUARD),
        "controller",
        "run",
        "--config",
        str(config),
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(proc.communicate(), DEADLINE_S)
    assert proc.returncode == 2
    assert f"{config}: lifecycle.rail_max_fraction:" in err.decode()


async def test_store_compare_and_set(env: Env) -> None:
    a = await NodeStore.open(env.js, env.subjects)
    b = await NodeStore.open(env.js, env.subjects)
    first = NodeRecord(node=node("n1"), score=90.0)
    await a.put_record(first)
    with pytest.raises(StoreConflictError):
        await b.put_record(NodeRecord(node=node("n1"), score=10.0))
    assert b.records["r1.c1.n1"] == first  # reloaded: the caller decides again from it
    assert b.cluster_size("r1", "c1") == 1
    stale = await NodeStore.open(env.js, env.subjects)
    second = NodeRecord(node=node("n1"), score=80.0)
    await a.put_record(second)
    await stale.put_record(second)  # a write that landed but whose reply was lost
    await stale.put_record(NodeRecord(node=node("n1"), score=70.0))


async def test_a_second_writer_decides_again_from_the_stored_state(env: Env) -> None:
    clock = ManualClock()
    one = await new_controller(env, clock)
    two = await new_controller(env, clock)
    await feed(one, clock, [batch("n1", 1), batch("n2", 1), batch("n1", 2, ue=1)])
    await feed(two, clock, [batch("n1", 2, ue=1)])  # stale cache: conflict, reload, a replay
    assert [e.kind for e in await control_events(env)] == ["node.isolated"]
    assert two.store.records["r1.c1.n1"] == one.store.records["r1.c1.n1"]
    for c in (one, two):
        await c.stop()


async def stored_record(env: Env, handle: str) -> NodeRecord:
    kv = await env.js.key_value(env.subjects.bucket("nodes"))
    return decode((await kv.get(handle)).value or b"", NodeRecord)


async def test_steady_batches_write_liveness_lazily_and_decisions_at_once(env: Env) -> None:
    clock = ManualClock()
    controller = await new_controller(env, clock)
    await feed(controller, clock, [batch("n1", 1), batch("n1", 2), batch("n1", 3)])
    assert controller.store.records["r1.c1.n1"].last_seq == 3
    assert (await stored_record(env, "r1.c1.n1")).last_seq == 1  # steady: not written yet
    assert controller.store.unwritten == {"r1.c1.n1"}

    assert await controller.flush_liveness() == 1
    assert (await stored_record(env, "r1.c1.n1")).last_seq == 3
    assert await controller.flush_liveness() == 0  # nothing newer

    await feed(controller, clock, [batch("n1", 4), batch("n1", 5, ue=1)])  # a decision
    stored = await stored_record(env, "r1.c1.n1")
    assert (stored.grade, stored.last_seq) == ("FAILING", 5)  # written at once, liveness too
    assert controller.store.unwritten == frozenset()

    await feed(controller, clock, [batch("n1", 6, ue=1)])
    await controller.stop()  # a clean stop writes what is left
    assert (await stored_record(env, "r1.c1.n1")).last_seq == 6


async def test_a_restarted_controller_counts_silence_from_its_start(env: Env) -> None:
    clock = ManualClock()
    first = await new_controller(env, clock)
    await feed(first, clock, [batch("n1", 1)])
    await first.stop()

    clock.now += 100 * INTERVAL  # the controller was down a long time
    second = await new_controller(env, clock)
    assert await second.check_silence() == ()  # its batches may still be in the stream
    clock.now += 3 * INTERVAL + 1
    (event,) = await second.check_silence()
    assert (event.kind, event.node) == ("node.unreachable", node("n1"))
    await second.stop()


def oob(name: str, seq: int, power: str, health: str = "ok") -> TelemetryBatch:
    """What a bmc-proxy publishes for ``name`` (its own seq, the BMC's reading)."""
    reading = BmcReading(source="redfish", reachable=True, power_state=power, health=health)
    return TelemetryBatch(
        node=node(name),
        seq=seq,
        ts=T0 + seq * INTERVAL,
        interval_s=INTERVAL,
        bmc=(reading,),
        out_of_band=True,
    )


async def test_out_of_band_batches_are_no_sign_of_life_but_speak_in_silence(env: Env) -> None:
    clock = ManualClock()
    controller = await new_controller(env, clock)
    await feed(controller, clock, [batch("n1", 1), batch("n2", 1), batch("n3", 1)])
    # the proxy keeps reporting the BMCs while the nodes' own agents fall silent
    for seq in (2, 3, 4):
        clock.now = T0 + seq * INTERVAL + 0.1
        await controller.on_batch(oob("n1", seq, "off"), clock.now)
        await controller.on_batch(oob("n2", seq, "on", health="critical"), clock.now)
    assert controller.store.records["r1.c1.n1"].last_seq == 1  # not taken as the node's batch
    clock.now = T0 + 4 * INTERVAL + 1
    announced = {e.node.node: e for e in await controller.check_silence() if e.node}
    assert set(announced) == {"n1", "n2", "n3"}
    assert all(e.kind == "node.unreachable" for e in announced.values())
    assert "powered off" in announced["n1"].message
    assert announced["n1"].attributes["bmc_power_on"] is False
    assert "powered on" in announced["n2"].message
    assert "health critical" in announced["n2"].message
    assert "no out-of-band reading" in announced["n3"].message
    await controller.stop()


async def test_out_of_band_bmc_readings_join_the_nodes_next_batch(env: Env) -> None:
    clock = ManualClock()
    controller = await new_controller(env, clock)
    await feed(controller, clock, [batch("n1", 1)])
    clock.now = T0 + 1.5 * INTERVAL
    await controller.on_batch(oob("n1", 7, "on", health="critical"), clock.now)
    await feed(controller, clock, [batch("n1", 2)])
    record = controller.store.records["r1.c1.n1"]
    assert [r.rule for r in record.reasons] == ["bmc_health"]
    assert record.score < 100


async def test_a_sharded_controller_judges_silence_of_its_own_nodes_only(env: Env) -> None:
    """Two processes split a region by cluster ([ingest] clusters): each sees the other's
    nodes in KV but never their batches, so it must not call them silent."""
    clock = ManualClock()
    first = await new_controller(env, clock)
    other = TelemetryBatch(
        node=NodeIdentity(region="r1", cluster="c2", node="m1"),
        seq=1,
        ts=T0 + INTERVAL,
        interval_s=INTERVAL,
    )
    await feed(first, clock, [batch("n1", 1), other])
    await first.stop()

    store = await NodeStore.open(env.js, env.subjects)
    owner_of_c1 = RegionController(
        env.js, store, env.subjects, "r1", clock=clock, owns=lambda r, c, n: c == "c1"
    )
    await owner_of_c1.start()
    clock.now += 10 * INTERVAL
    announced = await owner_of_c1.check_silence()
    assert [(e.kind, e.node) for e in announced] == [("node.unreachable", node("n1"))]
    assert owner_of_c1.store.records["r1.c2.m1"].grade == "HEALTHY"  # not its node
    await owner_of_c1.stop()


async def test_silence_counts_only_the_controllers_receiving_time(env: Env) -> None:
    """A stall of the controller's own intake (no word from ingest) is no node's silence;
    after it, the backlog first, then a full threshold of receiving time."""
    clock = ManualClock()
    controller = await new_controller(env, clock)
    await feed(controller, clock, [batch("n1", 1), batch("n2", 1)])
    seen = clock.now  # both last seen here; the threshold is 3 intervals of 5 s
    controller.on_intake(0)
    clock.now = seen + 40  # 40 s without a word from ingest: a stall, not silence
    assert await controller.check_silence() == ()
    controller.on_intake(120)  # back, with a backlog: still nobody judged
    clock.now += 1
    controller.on_intake(30)
    assert await controller.check_silence() == ()
    assert controller.intake.catching_up
    await controller.on_batch(batch("n1", 9), clock.now)  # n1's spooled batches come in
    controller.on_intake(0)  # drained
    assert not controller.intake.catching_up
    for seq in range(10, 24):  # 14 s of receiving time: n1 talks, n2 stays quiet
        clock.now += 1
        await controller.on_batch(batch("n1", seq), clock.now)
        controller.on_intake(0)
    assert await controller.check_silence() == ()
    clock.now += 1.5
    controller.on_intake(0)
    announced = await controller.check_silence()
    assert [(e.kind, e.node) for e in announced] == [("node.unreachable", node("n2"))]
    assert "stalled intake not counted" in announced[0].reasons[0].message
    await controller.stop()
