"""The steady-node shortcut (controller.decide.steady) decides exactly what a full round
would: the same record, no event, over random records and observations; and
``steady_batch`` (the shortcut taken straight from a batch) is ``steady`` of its input."""

from __future__ import annotations

import dataclasses

import msgspec
from hypothesis import event, given, settings
from hypothesis import strategies as st

from metalguard.controller.core.decide import NodeInput, batch_input, decide, steady, steady_batch
from metalguard.controller.core.lifecycle import LifecycleConfig, Observation
from metalguard.controller.core.rules import Finding
from metalguard.controller.core.scoring.engine import Assessment
from metalguard.proto.base import NodeIdentity, Reason
from metalguard.proto.nodes import NodeRecord
from metalguard.proto.telemetry import TelemetryBatch

CFG = LifecycleConfig()
T0 = 1_800_000_000.0
NODE = NodeIdentity(region="r1", cluster="c1", node="n1")
WARN = Reason(signal="hwmon.fan_rpm", value=900.0, rule="fan_below_min", message="slow")


def mostly(usual: object, *rare: object) -> st.SearchStrategy[object]:
    """``usual`` five times in six: most draws land where the shortcut applies."""
    return st.sampled_from([usual] * 5 + list(rare))


reasons = mostly((), (WARN,))
records = st.builds(
    NodeRecord,
    node=st.just(NODE),
    grade=mostly("HEALTHY", "SUB_HEALTHY", "FAILING", "UNREACHABLE", "MAINTENANCE"),
    score=mostly(100.0, 90.0),
    reasons=reasons,
    cordoned=mostly(False, True),
    maintenance=mostly(False, True),
    held=mostly(False, True),
    rail_flagged=mostly(False, True),
    clean_cycles=mostly(0, 1),
    isolations=mostly((), (T0 - 100.0,), (T0 - 10 * 86400.0,)),
    last_seen_ts=mostly(T0, None),
    last_sent_ts=st.just(T0),
    last_seq=mostly(1, 3),
    interval_s=st.sampled_from([0.0, 5.0]),
    rack=mostly("k1", "", "k2"),
)
racks = mostly(None, "k1", "", "k2")
"""The rack an input says (None: it does not), mostly the record's."""
observations = st.builds(
    Observation,
    ts=st.sampled_from([T0 + 5, T0 + 600, T0 + 30 * 86400]),
    seq=mostly(2, 1, 4),
    score=mostly(100.0, 90.0),
    grade=mostly("HEALTHY", "SUB_HEALTHY", "FAILING"),
    fatal=mostly(False, True),
    reasons=reasons,
    interval_s=st.sampled_from([0.0, 5.0, 15.0]),
    running_jobs=mostly(None, 0, 1),
    sent_ts=mostly(T0 + 5, T0 - 5, None),
)


@settings(max_examples=1000, deadline=None)
@given(record=records, obs=observations, rack=racks)
def test_steady_is_the_full_round_when_it_applies(
    record: NodeRecord, obs: Observation, rack: str | None
) -> None:
    item = NodeInput(NODE, obs, f"b{obs.seq}", rack)
    shortcut = steady(record, item)
    event("shortcut" if shortcut else "full round")
    if shortcut is None:
        return
    full = decide({"r1.c1.n1": record}, {}, [item], obs.ts, CFG, {("r1", "c1"): 10})
    assert full.events == ()
    assert full.records.get("r1.c1.n1", record) == shortcut


def test_it_applies_to_the_common_case_only() -> None:
    record = NodeRecord(node=NODE, last_seen_ts=T0, last_sent_ts=T0, last_seq=1, interval_s=5.0)
    obs = Observation(ts=T0 + 5, seq=2, score=100.0, grade="HEALTHY", sent_ts=T0 + 5)
    item = NodeInput(NODE, obs, "b2")
    after = steady(record, item)
    assert after == msgspec.structs.replace(
        record, last_seen_ts=T0 + 5, last_sent_ts=T0 + 5, last_seq=2, updated_ts=T0 + 5
    )
    lower = dataclasses.replace(obs, score=90.0, reasons=(WARN,))
    assert steady(record, NodeInput(NODE, lower, "b2")) is None  # a score change: a round
    assert steady(record, NodeInput(NODE, dataclasses.replace(obs, seq=1), "b1")) is None
    assert steady(None, item) is None
    assert steady(record, dataclasses.replace(item, rack="k2")) is None  # moved: a round
    assert steady(record, dataclasses.replace(item, rack="")) == after


OTHER = Reason(signal="hwmon.temp", value=90.0, rule="temp_high", message="hot")
assessments = st.builds(
    Assessment,
    score=mostly(100.0, 90.0),
    grade=mostly("HEALTHY", "SUB_HEALTHY", "FAILING"),
    fatal=mostly(False, True),
    findings=mostly(
        (),
        (Finding(reason=WARN, severity="warning", penalty=10.0),),
        (Finding(reason=OTHER, severity="warning", penalty=10.0),),
        tuple(Finding(reason=r, severity="warning", penalty=5.0) for r in (WARN, OTHER)),
    ),
)
batches = st.builds(
    TelemetryBatch,
    node=st.just(NODE),
    seq=mostly(2, 1, 4),
    ts=mostly(T0 + 5, T0 - 5),
    interval_s=st.sampled_from([0.0, 5.0, 15.0]),
)


@settings(max_examples=1000, deadline=None)
@given(
    record=st.none() | records,
    b=batches,
    assessment=assessments,
    received=st.sampled_from([T0 + 5, T0 + 600]),
    rack=racks,
)
def test_steady_batch_is_steady_of_the_batch_input(
    record: NodeRecord | None,
    b: TelemetryBatch,
    assessment: Assessment,
    received: float,
    rack: str | None,
) -> None:
    shortcut = steady_batch(record, b, assessment, received, rack)
    event("shortcut" if shortcut else "full round")
    assert shortcut == steady(record, batch_input(b, assessment, received, rack))
