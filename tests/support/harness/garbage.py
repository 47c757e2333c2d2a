"""Bad messages for a subject (tests/integration/test_fuzz_subjects.py): bytes drawn by
hypothesis (derandomized, so the same every run), truncations of a valid message, a valid
message of another type, the valid one with a field of the wrong type, and one as large
as the server takes."""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metalguard.proto.codec import encode

MSGPACK_INT_MIN = -(2**63)
MSGPACK_INT_MAX = 2**64 - 1
"""The integers msgpack can carry (a larger one is not a message: msgspec refuses to
encode it, so hypothesis must not draw it)."""


def drawn_bytes(n: int) -> list[bytes]:
    """``n`` byte strings from hypothesis (up to 300 bytes, msgpack-looking ones too)."""
    out: list[bytes] = []
    msgpackish = st.recursive(
        st.none()
        | st.booleans()
        | st.integers(min_value=MSGPACK_INT_MIN, max_value=MSGPACK_INT_MAX)
        | st.floats()
        | st.text(max_size=8),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner),
        max_leaves=8,
    ).map(msgspec.msgpack.encode)

    @settings(
        max_examples=n,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.binary(max_size=300) | msgpackish)
    def draw(data: bytes) -> None:
        out.append(data)

    draw()
    return out[:n]


def wrong_types(msg: msgspec.Struct) -> list[bytes]:
    """``msg`` encoded with each top-level field (the tag aside) replaced by a value of
    another type; one that still decodes (``"x"`` for a ``str | None``) is left out: it
    is a valid message."""
    raw: dict[str, Any] = msgspec.to_builtins(msg)
    out = []
    for key in raw:
        if key == "type":
            continue
        value = raw[key]
        wrong: Any = [1, 2] if isinstance(value, str) else "x" if value is not None else [[1]]
        data = msgspec.msgpack.encode({**raw, key: wrong})
        try:
            msgspec.msgpack.decode(data, type=type(msg))
        except msgspec.ValidationError:
            out.append(data)
    return out


def truncations(msg: msgspec.Struct) -> list[bytes]:
    """``msg``'s encoding cut short at a few lengths (never whole)."""
    data = encode(msg)
    return [data[:k] for k in sorted({1, 2, len(data) // 3, len(data) // 2, len(data) - 1}) if k]


def bad_messages(valid: msgspec.Struct, other: msgspec.Struct, n_drawn: int) -> list[bytes]:
    """Every kind of bad message for a subject whose messages are like ``valid``."""
    return [
        *drawn_bytes(n_drawn),
        *truncations(valid),
        encode(other),
        *wrong_types(valid),
        b"",
    ]


def oversized(max_payload: int, headroom: int = 0) -> bytes:
    """Garbage as large as the server takes (less ``headroom`` bytes)."""
    return b"\xc1" + b"\x00" * (max_payload - headroom - 1)
