"""Property tests of proto.codec over every wire message type.

Valid instances are generated from the types themselves (``msgspec.inspect``), honouring
their ``Meta`` constraints, so a message type added to ``proto.messages.MESSAGE_TYPES``
is covered without touching this file; a field type the generator does not understand
fails the tests loudly instead of being skipped.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metalguard.proto.base import SCHEMA_VERSION, TAG_FIELD, NodeIdentity
from metalguard.proto.codec import CodecError, decode, decode_json, encode, encode_json
from metalguard.proto.messages import MESSAGE_TYPES, TAGS, AnyMessage
from metalguard.proto.qos import QosProfile
from metalguard.proto.subjects import SubjectError, check_token
from metalguard.proto.telemetry import TelemetryBatch

INT_MIN = -(2**63)
INT_MAX = 2**64 - 1
"""The integer range both msgpack and msgspec's JSON decoder carry."""
MAX_ITEMS = 2
"""Elements per generated tuple/list/dict: nesting multiplies, keep it small."""

EXAMPLES = settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

FieldPath = tuple[str | int, ...]
"""Where a value sits inside a message's builtins (dict keys and list indexes)."""


# --- generating valid messages from their types -----------------------------------------


def strategy_for(t: mi.Type) -> st.SearchStrategy[Any]:
    """A strategy of valid Python values of a msgspec type, constraints honoured."""
    match t:
        case mi.StructType():
            return _struct_strategy(t)
        case mi.IntType():
            return _int_strategy(t)
        case mi.FloatType():
            return _float_strategy(t)
        case mi.StrType():
            return _str_strategy(t)
        case mi.BoolType():
            return st.booleans()
        case mi.NoneType():
            return st.none()
        case mi.LiteralType():
            return st.sampled_from(t.values)
        case mi.UnionType():
            return st.one_of([strategy_for(member) for member in t.types])
        case mi.VarTupleType():
            return st.lists(strategy_for(t.item_type), max_size=MAX_ITEMS).map(tuple)
        case mi.ListType():
            return st.lists(strategy_for(t.item_type), max_size=MAX_ITEMS)
        case mi.DictType():
            return st.dictionaries(
                strategy_for(t.key_type), strategy_for(t.value_type), max_size=MAX_ITEMS
            )
    raise NotImplementedError(f"no strategy for {t!r}: extend tests/unit/test_codec.py")


def _int_strategy(t: mi.IntType) -> st.SearchStrategy[int]:
    lo = t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else INT_MIN)
    hi = t.le if t.le is not None else (t.lt - 1 if t.lt is not None else INT_MAX)
    if t.multiple_of is None:
        return st.integers(lo, hi)
    step = t.multiple_of
    return st.integers(-(-lo // step), hi // step).map(lambda k: k * step)


def _float_strategy(t: mi.FloatType) -> st.SearchStrategy[float]:
    if t.multiple_of is not None:
        raise NotImplementedError(f"no strategy for {t!r}: extend tests/unit/test_codec.py")
    return st.floats(
        min_value=t.ge if t.ge is not None else t.gt,
        max_value=t.le if t.le is not None else t.lt,
        exclude_min=t.gt is not None,
        exclude_max=t.lt is not None,
        allow_nan=False,  # JSON cannot carry NaN or infinities
        allow_infinity=False,
    )


def _str_strategy(t: mi.StrType) -> st.SearchStrategy[str]:
    lo, hi = t.min_length or 0, t.max_length
    if t.pattern is None:
        return st.text(min_size=lo, max_size=min(hi if hi is not None else 12, 12))
    pattern = re.compile(t.pattern)

    def fits(s: str) -> bool:
        # msgspec checks patterns with re.search
        return lo <= len(s) <= (hi if hi is not None else len(s)) and bool(pattern.search(s))

    return st.from_regex(pattern, fullmatch=True).filter(fits)


def _struct_strategy(t: mi.StructType) -> st.SearchStrategy[msgspec.Struct]:
    required: dict[str, st.SearchStrategy[Any]] = {}
    optional: dict[str, st.SearchStrategy[Any]] = {}
    for field in t.fields:
        if field.name == "v" and t.tag is not None:
            strategy: st.SearchStrategy[Any] = st.integers(1, SCHEMA_VERSION)
        else:
            strategy = strategy_for(field.type)
        (required if field.required else optional)[field.name] = strategy
    return st.fixed_dictionaries(required, optional=optional).map(lambda kw: t.cls(**kw))


def messages_of(cls: type[msgspec.Struct]) -> st.SearchStrategy[Any]:
    """Valid instances of one message type."""
    return strategy_for(mi.type_info(cls))


any_message = st.one_of([messages_of(cls) for cls in MESSAGE_TYPES])
message_types = st.sampled_from(MESSAGE_TYPES)


# --- helpers -------------------------------------------------------------------------------

Encoder = Callable[[Any], bytes]
FORMATS: list[tuple[str, Encoder, Callable[..., Any], Encoder]] = [
    ("msgpack", encode, decode, msgspec.msgpack.encode),
    ("json", encode_json, decode_json, msgspec.json.encode),
]
"""(name, codec encoder, codec decoder, raw encoder of builtins) per wire format."""


def expect_codec_error(
    dec: Callable[..., Any], wire: Any, expected: type[Any] | None = None
) -> CodecError:
    """``dec(wire[, expected])`` must raise CodecError (anything else propagates)."""
    args = (wire,) if expected is None else (wire, expected)
    with pytest.raises(CodecError) as info:
        dec(*args)
    assert info.value.reason, "a CodecError must carry a reason"
    return info.value


def builtins_of(msg: msgspec.Struct) -> dict[str, Any]:
    raw = msgspec.to_builtins(msg)
    assert isinstance(raw, dict)
    return raw


def field_paths(
    value: Any, t: mi.Type, path: FieldPath = ()
) -> Iterator[tuple[FieldPath, mi.Type]]:
    """Every struct field (top level and nested) present in ``value``, with its type."""
    match t:
        case mi.StructType() if isinstance(value, dict):
            for field in t.fields:
                if field.encode_name in value:
                    here = (*path, field.encode_name)
                    yield here, field.type
                    yield from field_paths(value[field.encode_name], field.type, here)
        case mi.VarTupleType() | mi.ListType() if isinstance(value, list):
            for i, item in enumerate(value):
                yield from field_paths(item, t.item_type, (*path, i))
        case mi.UnionType():
            for member in t.types:
                if isinstance(member, mi.StructType | mi.VarTupleType | mi.ListType):
                    yield from field_paths(value, member, path)


def replaced(value: Any, path: FieldPath, new: Any) -> Any:
    """A copy of nested builtins with the item at ``path`` replaced by ``new``."""
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        assert isinstance(head, str)
        return {**value, head: replaced(value[head], rest, new)}
    assert isinstance(value, list)
    assert isinstance(head, int)
    return [*value[:head], replaced(value[head], rest, new), *value[head + 1 :]]


def json_path(path: FieldPath) -> str:
    """msgspec's notation of a location: ``$.edac[0].dimms[1].name``."""
    return "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)


def _accepts(t: mi.Type, kind: str) -> bool:
    """Whether a msgspec type accepts a value of the builtin ``kind`` at all."""
    match t:
        case mi.UnionType():
            return any(_accepts(member, kind) for member in t.types)
        case mi.IntType():
            return kind == "int"
        case mi.FloatType():
            return kind in ("int", "float")
        case mi.StrType() | mi.LiteralType():
            return kind == "str"
        case mi.BoolType():
            return kind == "bool"
        case mi.NoneType():
            return kind == "none"
        case mi.VarTupleType() | mi.ListType():
            return kind == "list"
        case mi.StructType() | mi.DictType():
            return kind == "dict"
    raise NotImplementedError(f"unknown type {t!r}: extend tests/unit/test_codec.py")


WRONG_VALUES: list[tuple[str, Any]] = [
    ("list", [1, "x"]),
    ("str", "wrong type"),
    ("bool", True),
    ("float", 1.5),
    ("dict", {"wrong": [1]}),
    ("none", None),
]


def wrong_value_for(t: mi.Type) -> Any:
    """A value of a builtin kind that ``t`` does not accept."""
    for kind, value in WRONG_VALUES:
        if not _accepts(t, kind):
            return value
    raise AssertionError(f"{t!r} accepts every kind: no wrongly typed value exists")


# --- round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.__name__)
@EXAMPLES
@given(data=st.data())
def test_round_trip_every_message_type(cls: type[AnyMessage], data: st.DataObject) -> None:
    msg = data.draw(messages_of(cls))
    assert decode(encode(msg)) == msg
    assert decode(encode(msg), cls) == msg
    assert decode_json(encode_json(msg)) == msg
    assert decode_json(encode_json(msg), cls) == msg
    assert type(decode(encode(msg))) is cls


def test_every_message_type_has_a_distinct_tag() -> None:
    assert len(TAGS) == len(MESSAGE_TYPES)
    for tag, cls in TAGS.items():
        assert cls.__struct_config__.tag == tag
        assert cls.__struct_config__.tag_field == TAG_FIELD


# --- garbage in, CodecError out ----------------------------------------------------------


@settings(EXAMPLES, max_examples=100)
@given(data=st.binary(max_size=512))
def test_random_bytes_raise_codec_error(data: bytes) -> None:
    expect_codec_error(decode, data)
    expect_codec_error(decode_json, data)
    expect_codec_error(decode, data, TelemetryBatch)
    expect_codec_error(decode_json, data, TelemetryBatch)


@settings(EXAMPLES, max_examples=100)
@given(text=st.text(max_size=256))
def test_random_text_raises_codec_error(text: str) -> None:
    expect_codec_error(decode_json, text)


@EXAMPLES
@given(
    payload=st.recursive(
        st.none() | st.booleans() | st.integers(-9, 9) | st.text(),
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
    )
)
def test_valid_encodings_of_non_messages_raise_codec_error(payload: Any) -> None:
    for _name, _enc, dec, raw_encode in FORMATS:
        wire = raw_encode(payload)
        expect_codec_error(dec, wire)


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.__name__)
@settings(EXAMPLES, max_examples=8)
@given(data=st.data())
def test_every_prefix_of_a_message_raises_codec_error(
    cls: type[AnyMessage], data: st.DataObject
) -> None:
    msg = data.draw(messages_of(cls))
    for _name, enc, dec, _raw in FORMATS:
        wire = enc(msg)
        # every short prefix, the longest one, and a sample of the rest
        sampled = data.draw(st.lists(st.integers(0, len(wire) - 1), max_size=48), label="cuts")
        for cut in sorted({*range(min(len(wire), 64)), len(wire) - 1, *sampled}):
            expect_codec_error(dec, wire[:cut])
            expect_codec_error(dec, wire[:cut], cls)


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.__name__)
@EXAMPLES
@given(data=st.data())
def test_wrongly_typed_field_raises_codec_error(cls: type[AnyMessage], data: st.DataObject) -> None:
    msg = data.draw(messages_of(cls))
    raw = builtins_of(msg)
    paths = list(field_paths(raw, mi.type_info(cls)))
    path, field_type = data.draw(st.sampled_from(paths), label="field")
    bad = replaced(raw, path, wrong_value_for(field_type))
    for _name, _enc, dec, raw_encode in FORMATS:
        wire = raw_encode(bad)
        err = expect_codec_error(dec, wire)
        expect_codec_error(dec, wire, cls)
        assert err.message_type == cls.__struct_config__.tag
        assert f"`{json_path(path)}`" in err.reason, "the reason points at the field"


def test_deeply_nested_unknown_field_raises_codec_error() -> None:
    """A poison message (an unknown field nested deeper than the recursion limit) must
    not escape as RecursionError and kill a consumer."""
    depth = 5000
    batch = TelemetryBatch(node=NodeIdentity(region="r", cluster="c", node="n"), seq=1, ts=1.0)
    raw = builtins_of(batch)
    json_wire = encode_json(batch)[:-1] + b',"future":' + b"[" * depth + b"]" * depth + b"}"
    expect_codec_error(decode_json, json_wire)
    expect_codec_error(decode_json, json_wire, TelemetryBatch)
    body = b"".join(msgspec.msgpack.encode(k) + msgspec.msgpack.encode(v) for k, v in raw.items())
    header = b"\xde" + (len(raw) + 1).to_bytes(2, "big")  # map16
    mp_wire = header + body + msgspec.msgpack.encode("future") + b"\x91" * depth + b"\xc0"
    expect_codec_error(decode, mp_wire)
    expect_codec_error(decode, mp_wire, TelemetryBatch)
    deep_tag = b'{"type":' + b"[" * depth + b"]" * depth + b"}"
    expect_codec_error(decode_json, deep_tag)


def test_non_bytes_input_raises_codec_error() -> None:
    expect_codec_error(decode, 42)
    expect_codec_error(decode, "not bytes")
    expect_codec_error(decode_json, None)


# --- named failures: unknown type, newer version, wrong type -------------------------------


@EXAMPLES
@given(
    msg=any_message,
    tag=st.text(min_size=1, max_size=20).filter(lambda t: t not in TAGS)
    | st.integers(INT_MIN, INT_MAX),
)
def test_unknown_tag_is_named(msg: AnyMessage, tag: str | int) -> None:
    bad = {**builtins_of(msg), TAG_FIELD: tag}
    for _name, _enc, dec, raw_encode in FORMATS:
        wire = raw_encode(bad)
        err = expect_codec_error(dec, wire)
        assert "unknown message type" in err.reason
        assert repr(tag) in err.reason


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.__name__)
@settings(EXAMPLES, max_examples=10)
@given(data=st.data())
def test_newer_schema_version_is_named(cls: type[AnyMessage], data: st.DataObject) -> None:
    msg = data.draw(messages_of(cls))
    drawn = data.draw(st.integers(SCHEMA_VERSION + 1, 2**31), label="v")
    tag = cls.__struct_config__.tag
    for newer in (SCHEMA_VERSION + 1, drawn):
        bad = {**builtins_of(msg), "v": newer}
        for _name, _enc, dec, raw_encode in FORMATS:
            wire = raw_encode(bad)
            for err in (
                expect_codec_error(dec, wire),
                expect_codec_error(dec, wire, cls),
            ):
                assert "newer" in err.reason
                assert err.version == newer
                assert err.message_type == tag


@EXAMPLES
@given(data=st.data())
def test_expected_type_mismatch_is_explained(data: st.DataObject) -> None:
    got_cls = data.draw(message_types, label="sent")
    want_cls = data.draw(message_types.filter(lambda c: c is not got_cls), label="expected")
    msg = data.draw(messages_of(got_cls))
    got, want = got_cls.__struct_config__.tag, want_cls.__struct_config__.tag
    for _name, enc, dec, _raw in FORMATS:
        wire = enc(msg)
        err = expect_codec_error(dec, wire, want_cls)
        assert repr(want) in err.reason
        assert repr(got) in err.reason
        assert err.message_type == got


def test_missing_tag_is_named() -> None:
    batch = TelemetryBatch(node=NodeIdentity(region="r", cluster="c", node="n"), seq=1, ts=1.0)
    raw = builtins_of(batch)
    del raw[TAG_FIELD]
    for _name, _enc, dec, raw_encode in FORMATS:
        wire = raw_encode(raw)
        err = expect_codec_error(dec, wire)
        assert repr(TAG_FIELD) in err.reason


# --- unknown fields: forbidden in QosProfile, ignored in telemetry -------------------------


@settings(EXAMPLES, max_examples=15)
@given(profile=messages_of(QosProfile), extra=st.text(min_size=1, max_size=10))
def test_qos_profile_rejects_unknown_fields(profile: QosProfile, extra: str) -> None:
    raw = builtins_of(profile)
    if extra in raw:
        extra += "_unknown"
    bad = {**raw, extra: 1}
    nested = {**raw, "interfaces": {**raw["interfaces"], extra: 1}}
    for _name, _enc, dec, raw_encode in FORMATS:
        for payload in (bad, nested):
            for expected in (None, QosProfile):
                wire = raw_encode(payload)
                err = expect_codec_error(dec, wire, expected)
                assert f"unknown field `{extra}`" in err.reason


@settings(EXAMPLES, max_examples=15)
@given(
    batch=messages_of(TelemetryBatch),
    extra=st.text(min_size=1, max_size=10),
    value=st.recursive(
        st.none() | st.integers(-9, 9) | st.text(max_size=5),
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
    ),
)
def test_telemetry_batch_ignores_unknown_fields(
    batch: TelemetryBatch, extra: str, value: Any
) -> None:
    """Forward compatibility: a newer agent's extra fields (top level and nested) are
    ignored by this decoder, and the known fields survive."""
    raw = builtins_of(batch)
    if extra in raw or extra in raw["node"]:
        extra += "_new"
    newer = {**raw, extra: value, "node": {**raw["node"], extra: value}}
    for _name, _enc, dec, raw_encode in FORMATS:
        wire = raw_encode(newer)
        assert dec(wire) == batch
        assert dec(wire, TelemetryBatch) == batch


@settings(EXAMPLES, max_examples=50)
@given(node=strategy_for(mi.type_info(NodeIdentity)), qos=messages_of(QosProfile))
def test_strategies_respect_constraints(node: NodeIdentity, qos: QosProfile) -> None:
    """The generator itself: Token patterns, bounds and finite floats hold, so a round
    trip failure above is the codec's, not the generator's."""
    for value in (node.region, node.cluster, node.node):
        assert 1 <= len(value) <= 128
        assert not re.search(r"[.*>\s]", value)
    assert qos.v == SCHEMA_VERSION
    assert qos.version >= 0
    assert all(0 <= p <= 7 for p in qos.pfc_priorities)
    assert all(0 <= k <= 63 and 0 <= v <= 7 for k, v in qos.dscp_map.items())
    for tc in qos.traffic_class:
        assert 0 <= tc.bandwidth_percent <= 100
        assert math.isfinite(tc.bandwidth_percent)


@settings(EXAMPLES, max_examples=200)
@given(
    token=st.text(st.sampled_from("ab-_9.*> \t\n\r\x0b\x0c\x1c\x85\xa0\u2003é"), max_size=6)
    | st.text(max_size=130)
)
def test_token_fields_accept_exactly_what_subjects_accept(token: str) -> None:
    """A Token on the wire (NodeIdentity.region, NodeEvent.kind...) is valid exactly when
    proto.subjects would take it as a subject token, so a decoded message can always be
    routed.  (A trailing newline once slipped through ``$`` in the Token pattern.)"""
    try:
        check_token(token)
        routable = len(token) <= 128
    except SubjectError:
        routable = False
    raw = {
        "type": "node_event",
        "node": {"region": token, "cluster": "c", "node": "n"},
        "event_id": "e1",
        "ts": 1.0,
        "kind": token,
    }
    for _name, _enc, dec, raw_encode in FORMATS:
        wire = raw_encode(raw)
        if routable:
            assert dec(wire).node.region == token
        else:
            err = expect_codec_error(dec, wire)
            assert "$.node.region" in err.reason or "$.kind" in err.reason
