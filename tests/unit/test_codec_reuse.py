"""proto.codec.SectionReuse decodes exactly what proto.codec.decode decodes, fails the
same way, and hands a sender's unchanged sections back as the very same objects."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metalguard.controller.ingest.consumer import REUSED_SECTIONS
from metalguard.proto.base import NodeIdentity
from metalguard.proto.codec import CodecError, SectionReuse, decode, encode
from metalguard.proto.telemetry import EdacController, TelemetryBatch
from tests.support.batch_strategies import node_batches
from tests.support.scoring_helpers import batch


def canonical_error(data: bytes) -> str:
    with pytest.raises(CodecError) as caught:
        decode(data, TelemetryBatch)
    return caught.value.reason


@settings(max_examples=80, deadline=None)
@given(
    sequence=st.lists(st.tuples(st.sampled_from(["a", "b"]), node_batches()), max_size=8),
    repeats=st.lists(st.booleans(), min_size=8, max_size=8),
)
def test_it_decodes_what_decode_decodes(
    sequence: list[tuple[str, TelemetryBatch]], repeats: list[bool]
) -> None:
    reuse = SectionReuse(TelemetryBatch, REUSED_SECTIONS)
    last: dict[str, TelemetryBatch] = {}
    for (sender, drawn), repeat in zip(sequence, repeats, strict=False):
        b = drawn
        if repeat and sender in last:  # the same sections again, a new time and seq
            b = msgspec.structs.replace(last[sender], ts=drawn.ts + 1, seq=drawn.seq + 1)
        data = encode(b)
        got = reuse.decode(sender, data)
        assert got == decode(data, TelemetryBatch) == b
        assert type(got) is TelemetryBatch
        last[sender] = b


def test_unchanged_sections_come_back_as_the_same_objects() -> None:
    reuse = SectionReuse(TelemetryBatch, ("edac", "pcie"))
    edac = (EdacController(mc=0, ce_count=3),)
    first = reuse.decode("n1", encode(batch(0.0, 1, edac=edac)))
    second = reuse.decode("n1", encode(batch(5.0, 2, edac=edac)))
    assert second.edac is first.edac
    assert second.pcie is first.pcie
    assert (second.seq, second.ts) == (2, first.ts + 5.0)
    other = reuse.decode("n2", encode(batch(5.0, 2, edac=edac)))
    assert other.edac is first.edac  # another sender with the same bytes: shared
    changed = reuse.decode("n1", encode(batch(10.0, 3, edac=(EdacController(mc=0),))))
    assert changed.edac == (EdacController(mc=0),)
    assert changed.edac is not first.edac
    assert changed.pcie is first.pcie
    reuse.forget("n1")
    again = reuse.decode("n1", encode(batch(15.0, 4, edac=(EdacController(mc=0),))))
    assert again.edac is not changed.edac


def test_absent_fields_take_their_defaults() -> None:
    minimal = msgspec.msgpack.encode(
        {
            "type": "telemetry_batch",
            "node": {"region": "r", "cluster": "c", "node": "n"},
            "seq": 1,
            "ts": 1.0,
        }
    )
    got = SectionReuse(TelemetryBatch, REUSED_SECTIONS).decode("n", minimal)
    assert got == decode(minimal, TelemetryBatch)
    assert got.edac == ()
    assert got.topology is None
    assert got.v == 1


def good() -> bytes:
    return encode(batch(0.0, 1, edac=(EdacController(mc=0, ce_count=1),)))


BAD: list[tuple[str, bytes]] = [
    ("not msgpack", b"\xc1\xc1"),
    ("truncated", good()[:-3]),
    ("another type", encode(NodeIdentity(region="r", cluster="c", node="n"))),
    ("bad section", good().replace(b"ce_count\x01", b"ce_count\xa1x")),
    ("negative seq", good().replace(b"seq\x01", b"seq\xff")),
    (
        "newer version",
        msgspec.msgpack.encode(
            {
                "type": "telemetry_batch",
                "v": 9,
                "node": {"region": "r", "cluster": "c", "node": "n"},
                "seq": 1,
                "ts": 1.0,
            }
        ),
    ),
    (
        "newer version, unchanged sections",
        msgspec.msgpack.encode(
            msgspec.structs.asdict(batch(1.0, 2, edac=(EdacController(mc=0, ce_count=1),)))
            | {"type": "telemetry_batch", "v": 2}
        ),
    ),
]


@pytest.mark.parametrize(("case", "data"), BAD, ids=[c for c, _ in BAD])
def test_failures_are_decodes_failures(case: str, data: bytes) -> None:
    reuse = SectionReuse(TelemetryBatch, REUSED_SECTIONS)
    reuse.decode("n1", good())  # sections known: a bad message must still fail
    expected = canonical_error(data)
    with pytest.raises(CodecError) as caught:
        reuse.decode("n1", data)
    assert caught.value.reason == expected, case


def test_it_refuses_unknown_sections() -> None:
    with pytest.raises(ValueError, match="no fields"):
        SectionReuse(TelemetryBatch, ("edac", "nope"))


def test_the_reused_sections_are_batch_fields() -> None:
    assert set(REUSED_SECTIONS) <= set(TelemetryBatch.__struct_fields__)


def test_a_section_is_kept_while_some_sender_has_it() -> None:
    reuse = SectionReuse(TelemetryBatch, ("edac",))
    one, two = (EdacController(mc=0, ce_count=1),), (EdacController(mc=0, ce_count=2),)
    a = reuse.decode("a", encode(batch(0.0, 1, edac=one)))
    b = reuse.decode("b", encode(batch(0.0, 1, edac=one)))
    assert b.edac is a.edac
    assert reuse.distinct == 1
    moved = reuse.decode("a", encode(batch(5.0, 2, edac=two)))  # "b" still has the first
    assert moved.edac == two
    assert reuse.distinct == 2
    assert reuse.decode("c", encode(batch(5.0, 2, edac=one))).edac is a.edac
    reuse.decode("b", encode(batch(5.0, 2, edac=two)))
    reuse.forget("c")  # nobody has the first any more: dropped
    assert reuse.distinct == 1
    again = reuse.decode("c", encode(batch(9.0, 3, edac=one)))
    assert again.edac == one
    assert again.edac is not a.edac


def test_it_forgets_everything_past_max_senders() -> None:
    reuse = SectionReuse(TelemetryBatch, ("edac",), max_senders=2)
    edac = (EdacController(mc=0, ce_count=1),)
    for sender in ("a", "b", "c"):
        got = reuse.decode(sender, encode(batch(0.0, 1, edac=edac)))
        assert got.edac == edac
    assert reuse.distinct == 1  # "c" only: the table was emptied at the third sender


@settings(max_examples=60, deadline=None)
@given(
    sequence=st.lists(
        st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 2), st.booleans()),
        max_size=20,
    )
)
def test_shared_sections_equal_a_plain_decode(sequence: list[tuple[str, int, bool]]) -> None:
    """Senders moving between a few sections, some forgotten: always a plain decode's
    value, and the table holds exactly the sections some sender has now."""
    reuse = SectionReuse(TelemetryBatch, ("edac",))
    has: dict[str, int] = {}
    for step, (sender, count, forget) in enumerate(sequence):
        if forget:
            reuse.forget(sender)
            has.pop(sender, None)
            continue
        data = encode(batch(float(step), step + 1, edac=(EdacController(mc=0, ce_count=count),)))
        assert reuse.decode(sender, data) == decode(data, TelemetryBatch)
        has[sender] = count
        assert reuse.distinct == len(set(has.values()))
