"""The scorer's memo (controller.scoring.ScoringMemo) changes no result.

Every function marked ``@reads(...)`` depends on those batch fields only (else reusing its
output would be wrong), ``assess`` with a memo equals ``assess`` without one over random
sequences in which sections are reused by identity (as ingest's decoder does) or change,
and the reuse really happens.
"""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from metalguard.controller.core.rules import COUNTER_SOURCES, RULES, Context
from metalguard.controller.core.rules.base import READS
from metalguard.controller.core.scoring.config import DEFAULT_SCORING, ScoringConfig
from metalguard.controller.core.scoring.engine import (
    MEMO_FIELDS,
    Assessment,
    NodeSignals,
    ScoringMemo,
    assess,
)
from metalguard.controller.core.scoring.signals import observe
from metalguard.controller.ingest.consumer import REUSED_SECTIONS
from metalguard.proto.telemetry import EdacController, EdacDimm, TelemetryBatch
from tests.support.batch_strategies import node_batches
from tests.support.scoring_helpers import batch, pci

RETENTION_S = DEFAULT_SCORING.retention_s()


def history(b: TelemetryBatch, earlier: TelemetryBatch) -> NodeSignals:
    """A history of ``earlier``'s then ``b``'s counters."""
    signals = None
    for x in (earlier, b):
        values: dict[str, int] = {}
        for source in COUNTER_SOURCES:
            values.update(source(x))
        signals = observe(signals, x.ts, values, retention_s=RETENTION_S, max_samples=16)
    assert signals is not None
    return signals


def test_the_marks_name_rules_and_sources() -> None:
    marked = set(READS)
    assert marked <= set(RULES) | set(COUNTER_SOURCES)
    assert len([f for f in RULES if f in marked]) >= 15  # the reading rules
    assert all(source in marked for source in COUNTER_SOURCES)


@settings(max_examples=100, deadline=None)
@given(a=node_batches(), b=node_batches(), gap=st.sampled_from([1.0, 600.0, 86400.0]))
def test_a_marked_function_reads_only_its_fields(
    a: TelemetryBatch, b: TelemetryBatch, gap: float
) -> None:
    b = msgspec.structs.replace(b, ts=a.ts + gap, seq=a.seq + 7)
    for fn, fields in READS.items():
        # b with fn's fields taken from a: everything else differs (time, seq, history)
        mixed = msgspec.structs.replace(b, **{f: getattr(a, f) for f in fields})
        if fn in COUNTER_SOURCES:
            assert list(fn(a)) == list(fn(mixed)), fn.__name__
            continue
        here = Context(batch=a, signals=history(a, b), config=DEFAULT_SCORING)
        there = Context(batch=mixed, signals=history(mixed, a), config=DEFAULT_SCORING)
        assert list(fn(here)) == list(fn(there)), fn.__name__


def share(b: TelemetryBatch, previous: TelemetryBatch) -> TelemetryBatch:
    """``b`` with every section equal to ``previous``'s replaced by ``previous``'s object
    (what ingest's decoder hands the scorer)."""
    same = {
        f: getattr(previous, f)
        for f in TelemetryBatch.__struct_fields__
        if f not in ("ts", "seq") and getattr(b, f) == getattr(previous, f)
    }
    return msgspec.structs.replace(b, **same)


steps = st.tuples(
    st.sampled_from([1.0, 5.0, 600.0, RETENTION_S, 2 * RETENTION_S, -1.0]),
    st.sampled_from(["repeat", "repeat", "new", "mix"]),
)


@settings(max_examples=120, deadline=None)
@given(
    first=node_batches(),
    rest=st.lists(st.tuples(steps, node_batches()), min_size=1, max_size=8),
    other_config=st.booleans(),
)
def test_assess_with_a_memo_is_assess(
    first: TelemetryBatch,
    rest: list[tuple[tuple[float, str], TelemetryBatch]],
    other_config: bool,
) -> None:
    tighter = msgspec.structs.replace(
        DEFAULT_SCORING,
        grades=msgspec.structs.replace(DEFAULT_SCORING.grades, healthy_min=99.0),
    )
    sequence = [first]
    for (gap, how), drawn in rest:
        current = sequence[-1]
        base = {"repeat": current, "new": drawn}.get(how)
        if base is None:  # some sections kept, the others new
            base = msgspec.structs.replace(drawn, edac=current.edac, pcie=current.pcie)
        nxt = msgspec.structs.replace(base, ts=current.ts + gap, seq=current.seq + 1)
        sequence.append(share(nxt, current))
    memos = [ScoringMemo(), ScoringMemo(REUSED_SECTIONS), ScoringMemo(("edac",))]
    plain: NodeSignals | None = None
    memoed: list[NodeSignals | None] = [None] * len(memos)
    for i, b in enumerate(sequence):
        config: ScoringConfig = tighter if other_config and i % 3 == 2 else DEFAULT_SCORING
        plain, expected = assess(plain, b, config)
        for k, memo in enumerate(memos):  # keeping every field, ingest's sections, one
            memoed[k], got = assess(memoed[k], b, config, memo)
            assert memoed[k] == plain
            assert got == expected


def test_the_memo_reuses_outputs_and_the_assessment() -> None:
    edac = (EdacController(mc=0, dimms=(EdacDimm(name="dimm0", ce_count=1, ue_count=1),)),)
    pcie = (pci(width=8),)  # a downgraded link: a finding every batch
    memo = ScoringMemo()
    signals, first = assess(None, batch(0.0, 1, edac=edac, pcie=pcie), memo=memo)
    assert first.fatal
    assert len(first.findings) == 2
    signals, second = assess(signals, batch(5.0, 2, edac=edac, pcie=pcie), memo=memo)
    assert second.findings is first.findings  # the same outputs: the same assessment
    signals, third = assess(signals, batch(10.0, 3, edac=edac, pcie=(pci(width=16),)), memo=memo)
    assert not any(f.reason.rule == "link_downgrade" for f in third.findings)
    fresh: Assessment = assess(None, batch(0.0, 1, edac=edac, pcie=pcie))[1]
    assert fresh == first
    assert fresh is not first


def test_a_memo_with_stable_fields_keeps_only_those() -> None:
    """The fields ingest never hands back unchanged (fans, temperatures, collector
    timings) are not kept from one batch to the next: the previous batch is not held."""
    edac = (EdacController(mc=0, dimms=(EdacDimm(name="dimm0", ce_count=1),)),)
    memo = ScoringMemo(("edac",))
    first = batch(0.0, 1, edac=edac)
    assess(None, first, memo=memo)
    assert memo.read[0] == ("edac",)
    assert memo.fields is not None
    assert len(memo.fields) == 1
    assert memo.fields[0] is first.edac
    assert set(MEMO_FIELDS) > {"edac", "hwmon", "collectors"}
    assert memo.unchanged(batch(5.0, 2, edac=edac), DEFAULT_SCORING) == {"edac"}
