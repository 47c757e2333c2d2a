"""Encoding and decoding of wire messages: msgpack on the wire, JSON for humans.

Every failure to decode raises :class:`CodecError` with a reason; an unknown message
type and a newer major schema version are named as such.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Iterable
from typing import Any, Generic, TypeVar, overload

import msgspec

from metalguard.proto.base import SCHEMA_VERSION, TAG_FIELD
from metalguard.proto.messages import TAGS, AnyMessage

M = TypeVar("M", bound=msgspec.Struct)


class CodecError(ValueError):
    """A message could not be decoded (or encoded); ``reason`` says why."""

    def __init__(
        self,
        reason: str,
        *,
        message_type: str | None = None,
        version: int | None = None,
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.message_type = message_type
        self.version = version


class _Envelope(msgspec.Struct):
    """Just enough of any message to explain why it failed to decode."""

    type: Any = None
    v: Any = None


_mp_encoder = msgspec.msgpack.Encoder()
_json_encoder = msgspec.json.Encoder()
_mp_any = msgspec.msgpack.Decoder(AnyMessage)
_json_any = msgspec.json.Decoder(AnyMessage)
_mp_envelope = msgspec.msgpack.Decoder(_Envelope)
_json_envelope = msgspec.json.Decoder(_Envelope)
_mp_typed: dict[type[Any], msgspec.msgpack.Decoder[Any]] = {}
_json_typed: dict[type[Any], msgspec.json.Decoder[Any]] = {}


def encode(msg: msgspec.Struct) -> bytes:
    """Encode a message as msgpack for the wire."""
    return _mp_encoder.encode(msg)


def encode_json(msg: msgspec.Struct) -> bytes:
    """Encode a message as JSON (CLI output, HTTP API)."""
    return _json_encoder.encode(msg)


def to_builtins(msg: msgspec.Struct) -> Any:
    """A message as plain dicts and lists (for printing and HTTP responses)."""
    return msgspec.to_builtins(msg)


@overload
def decode(data: bytes | bytearray | memoryview) -> AnyMessage: ...
@overload
def decode(data: bytes | bytearray | memoryview, expected: type[M]) -> M: ...
def decode(data: bytes | bytearray | memoryview, expected: type[Any] | None = None) -> Any:
    """Decode msgpack bytes into a message (of ``expected`` type when given)."""
    if expected is None:
        decoder: Any = _mp_any
    else:
        decoder = _mp_typed.get(expected) or _mp_typed.setdefault(
            expected, msgspec.msgpack.Decoder(expected)
        )
    return _decode(data, decoder, _mp_envelope, "msgpack", expected)


@overload
def decode_json(data: bytes | str) -> AnyMessage: ...
@overload
def decode_json(data: bytes | str, expected: type[M]) -> M: ...
def decode_json(data: bytes | str, expected: type[Any] | None = None) -> Any:
    """Decode JSON into a message (of ``expected`` type when given)."""
    if expected is None:
        decoder: Any = _json_any
    else:
        decoder = _json_typed.get(expected) or _json_typed.setdefault(
            expected, msgspec.json.Decoder(expected)
        )
    return _decode(data, decoder, _json_envelope, "JSON", expected)


def _decode(
    data: Any,
    decoder: Any,
    envelope_decoder: Any,
    fmt: str,
    expected: type[Any] | None,
) -> Any:
    if not isinstance(data, bytes | bytearray | memoryview | str):
        raise CodecError(f"cannot decode a {type(data).__name__}: expected bytes")
    try:
        msg = decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise _explain(data, envelope_decoder, expected, str(exc)) from None
    except (msgspec.DecodeError, TypeError, RecursionError) as exc:
        raise CodecError(f"malformed {fmt}: {exc}") from None
    version = getattr(msg, "v", SCHEMA_VERSION)
    if version > SCHEMA_VERSION:
        raise _newer(type(msg).__struct_config__.tag, version)
    return msg


def _newer(tag: Any, version: int) -> CodecError:
    return CodecError(
        f"schema version {version} of {tag!r} is newer than the supported {SCHEMA_VERSION}",
        message_type=str(tag),
        version=version,
    )


def _explain(
    data: Any, envelope_decoder: Any, expected: type[Any] | None, detail: str
) -> CodecError:
    """Turn a validation failure into the most useful reason we can give."""
    try:
        env = envelope_decoder.decode(data)
    except (msgspec.DecodeError, TypeError, RecursionError):
        return CodecError(f"invalid message: {detail}")
    tag, version = env.type, env.v
    tag_name = tag if isinstance(tag, str) else None
    if isinstance(version, int) and not isinstance(version, bool) and version > SCHEMA_VERSION:
        return _newer(tag, version)
    if tag is None:
        return CodecError(f"message has no {TAG_FIELD!r} field: {detail}")
    if tag_name not in TAGS:
        return CodecError(f"unknown message type {tag!r}", message_type=tag_name, version=None)
    wanted = _members(expected)
    if wanted and TAGS[tag_name] not in wanted:
        want = " or ".join(repr(m.__struct_config__.tag) for m in wanted)
        return CodecError(f"expected a {want} message, got {tag_name!r}", message_type=tag_name)
    return CodecError(f"invalid {tag_name!r} message: {detail}", message_type=tag_name)


def _members(expected: Any) -> tuple[Any, ...]:
    """The message types ``expected`` allows: itself, or a union's members (none: any)."""
    if expected is None:
        return ()
    union = typing.get_origin(expected) in (typing.Union, types.UnionType)
    members = typing.get_args(expected) if union else ()
    return tuple(m for m in members if hasattr(m, "__struct_config__")) or (expected,)


class _Section:
    """One decoded section, shared by every sender whose section has these bytes."""

    __slots__ = ("raw", "users", "value")

    def __init__(self, raw: msgspec.Raw, value: Any) -> None:
        self.raw = raw
        self.value = value
        self.users = 0


class SectionReuse(Generic[M]):
    """Decodes messages of one type, sender after sender, reusing the decoded value of
    every *section* (a field holding records) whose bytes are those of the same section
    of the sender's previous message: a node's EDAC and PCIe counters are the same batch
    after batch, so they are neither decoded nor allocated again, and the scorer can tell
    them unchanged by identity (controller.scoring.ScoringMemo).

    Sections are also shared between senders: one decoded value (and one copy of its
    bytes) per distinct section, kept while some sender's previous message has it (a
    fleet of one hardware model sends a handful of distinct PCIe sections, not one per
    node), so what a sender costs is a reference per section.

    The result equals ``decode(data, expected)`` (tests/unit/test_codec_reuse.py); every
    failure, and anything unusual (a newer ``v``, another type), is handed to
    :func:`decode`, so the error is the same too. The wire format is untouched.
    """

    def __init__(
        self, expected: type[M], sections: Iterable[str], *, max_senders: int = 1_000_000
    ) -> None:
        info = {f.name: f for f in msgspec.structs.fields(expected)}
        chosen = tuple(sections)
        unknown = set(chosen) - set(info)
        if unknown:
            raise ValueError(f"{expected.__name__} has no fields {sorted(unknown)}")
        config = expected.__struct_config__
        fields: list[Any] = []
        for f in info.values():
            if f.name in chosen:
                fields.append((f.name, msgspec.Raw | msgspec.UnsetType, msgspec.UNSET))
            elif f.required:
                fields.append((f.name, f.type))
            elif f.default_factory is not msgspec.NODEFAULT:
                fields.append((f.name, f.type, msgspec.field(default_factory=f.default_factory)))
            else:
                fields.append((f.name, f.type, f.default))
        if any(f.encode_name != f.name for f in info.values()):
            raise ValueError(f"{expected.__name__} renames fields: not supported")
        lazy = msgspec.defstruct(
            f"_Sections{expected.__name__}",
            fields,
            kw_only=True,
            tag=config.tag,
            tag_field=config.tag_field,
            forbid_unknown_fields=config.forbid_unknown_fields,
        )
        self._expected = expected
        self._lazy = msgspec.msgpack.Decoder(lazy)
        self._names = tuple(info)
        self._sections = tuple(
            (i, info[name].name, msgspec.msgpack.Decoder(info[name].type))
            for i, name in enumerate(chosen)
        )
        self._max_senders = max_senders
        self._previous: dict[str, list[_Section | None]] = {}
        """Each sender's sections of its previous message, in ``sections`` order."""
        self._shared: list[dict[bytes, _Section]] = [{} for _ in chosen]
        """Per section, every distinct one some sender's previous message has, by bytes."""

    @property
    def distinct(self) -> int:
        """How many distinct sections are kept (all senders together)."""
        return sum(len(shared) for shared in self._shared)

    def decode(self, sender: str, data: bytes | bytearray | memoryview) -> M:
        """Decode ``data`` (from ``sender``) into ``expected``; CodecError if it cannot."""
        try:
            lazy = self._lazy.decode(data)
        except (msgspec.DecodeError, TypeError, RecursionError):
            return decode(data, self._expected)  # raises the canonical error
        previous = self._previous.get(sender)
        if previous is None:
            if len(self._previous) >= self._max_senders:
                self._forget_all()
            previous = self._previous[sender] = [None] * len(self._sections)
        values = dict(zip(self._names, msgspec.structs.astuple(lazy), strict=True))
        for i, name, decoder in self._sections:
            raw = values[name]
            if raw is msgspec.UNSET:
                del values[name]  # absent: the field's default
                continue
            kept = previous[i]
            if kept is not None and kept.raw == raw:
                values[name] = kept.value
                continue
            shared = self._shared[i]
            key = bytes(raw)
            section = shared.get(key)
            if section is None:
                try:
                    value = decoder.decode(raw)
                except (msgspec.DecodeError, TypeError, RecursionError):
                    self._leave(i, previous)
                    return decode(data, self._expected)  # raises the canonical error
                section = shared[key] = _Section(msgspec.Raw(key), value)
            self._leave(i, previous)
            section.users += 1
            previous[i] = section
            values[name] = section.value
        if getattr(lazy, "v", SCHEMA_VERSION) > SCHEMA_VERSION:
            return decode(data, self._expected)  # raises: newer than supported
        return self._expected(**values)

    def _leave(self, i: int, previous: list[_Section | None]) -> None:
        """The sender no longer has its section ``i``: dropped when no sender has it."""
        kept = previous[i]
        if kept is None:
            return
        previous[i] = None
        kept.users -= 1
        if kept.users <= 0:
            self._shared[i].pop(bytes(kept.raw), None)

    def forget(self, sender: str) -> None:
        """Drop what is kept of ``sender``'s previous message."""
        previous = self._previous.pop(sender, None)
        if previous is not None:
            for i in range(len(previous)):
                self._leave(i, previous)

    def _forget_all(self) -> None:
        self._previous.clear()
        for shared in self._shared:
            shared.clear()
