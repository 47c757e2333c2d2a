"""Hypothesis strategies for the files users write (tests/unit/test_fuzz_files.py): junk,
binary garbage, non-UTF-8, deep nesting, huge values, and the shipped examples with one
key's value swapped for a wrong type, an unknown key added or a key taken away.

A mutation says where it struck (``Mutation.key``, dotted the way errors name keys:
``collect.interval_s``, ``fault[0].kind``), so a test can check the error names it.
"""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from tests.support import ROOT

HUGE_TEXT = "x" * 200_000
DEEP = 400
"""Nesting deeper than any document of ours, well within what a TOML parser recurses."""


def toml_value(value: Any) -> str:
    """``value`` as an inline TOML value (strings escaped, tables inline)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return toml_key(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no TOML for {type(value).__name__}")


def toml_key(key: str) -> str:
    """A TOML basic string (any string is a key): JSON's escapes, DEL escaped too."""
    return json.dumps(key, ensure_ascii=False).replace("\x7f", "\\u007f")


def toml_text(doc: dict[str, Any]) -> str:
    """A whole document: one ``key = value`` line per top-level key."""
    return "".join(f"{toml_key(k)} = {toml_value(v)}\n" for k, v in doc.items())


def example(path: str) -> dict[str, Any]:
    """A shipped example file (relative to the repository), parsed."""
    return tomllib.loads((ROOT / path).read_text(encoding="utf-8"))


@dataclass(frozen=True)
class Mutation:
    """A document and the key a mutation struck (``""``: the document as a whole)."""

    text: str | bytes
    key: str
    how: str


def _leaves(value: Any, prefix: str = "") -> list[tuple[tuple[Any, ...], str]]:
    """(path, dotted name) of every value of ``value``, tables and arrays included."""
    out: list[tuple[tuple[Any, ...], str]] = []
    if isinstance(value, dict):
        for k, v in value.items():
            name = f"{prefix}.{k}" if prefix else str(k)
            out.append(((k,), name))
            out += [((k, *p), n) for p, n in _leaves(v, name)]
    elif isinstance(value, list):
        for i, v in enumerate(value):
            name = f"{prefix}[{i}]"
            out.append(((i,), name))
            out += [((i, *p), n) for p, n in _leaves(v, name)]
    return out


def _tables(value: Any, prefix: str = "") -> list[tuple[tuple[Any, ...], str]]:
    """(path, dotted name) of every table of ``value``, the document itself first."""
    return [((), prefix)] + [
        (path, name) for path, name in _leaves(value) if isinstance(_get(value, path), dict)
    ]


def _get(value: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        value = value[step]
    return value


def _replaced(doc: Any, path: tuple[Any, ...], new: Any) -> Any:
    """A copy of ``doc`` with the value at ``path`` replaced by ``new``."""
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(doc, dict):
        return {**doc, head: _replaced(doc[head], rest, new)}
    copy = list(doc)
    copy[head] = _replaced(doc[head], rest, new)
    return copy


def _without(doc: Any, path: tuple[Any, ...]) -> Any:
    parent = _get(doc, path[:-1])
    if isinstance(parent, dict):
        trimmed: Any = {k: v for k, v in parent.items() if k != path[-1]}
    else:
        trimmed = [v for i, v in enumerate(parent) if i != path[-1]]
    return _replaced(doc, path[:-1], trimmed)


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = {"a": value}
    return value


wrong_values = st.one_of(
    st.booleans(),
    st.integers(),
    st.sampled_from([2**63, -(2**63) - 1, 10**300, 0, -1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(["", " ", "\x00", "..", "*", ">", "a.b", "é" * 300, HUGE_TEXT]),
    st.lists(st.integers(), max_size=3),
    st.lists(st.text(max_size=5), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
    st.just(_nested(DEEP)),
    st.just([[[[[]]]]]),
)
"""Values of every TOML type, edge numbers, odd and huge strings, deep tables."""

unknown_keys = st.one_of(
    st.sampled_from(["intervall", "enabeld", "x", "type", "v", "__class__"]),
    st.text(min_size=1, max_size=12),
)


@st.composite
def mutated(draw: st.DrawFn, doc: dict[str, Any]) -> Mutation:
    """``doc`` with one mutation: a wrong-typed value, an unknown key, a key removed."""
    how = draw(st.sampled_from(["wrong", "wrong", "unknown", "missing"]))
    if how == "unknown":
        path, name = draw(st.sampled_from(_tables(doc)))
        key = draw(unknown_keys.filter(lambda k: k not in _get(doc, path)))
        table = {**_get(doc, path), key: draw(wrong_values)}
        where = f"{name}.{key}" if name else key
        return Mutation(toml_text(_replaced(doc, path, table)), where, how)
    leaves = _leaves(doc)
    path, name = draw(st.sampled_from(leaves))
    if how == "missing":
        return Mutation(toml_text(_without(doc, path)), name, how)
    return Mutation(toml_text(_replaced(doc, path, draw(wrong_values))), name, how)


junk = st.one_of(
    st.text(max_size=200).map(lambda t: Mutation(t, "", "junk text")),
    st.binary(max_size=200).map(lambda b: Mutation(b, "", "binary")),
    st.sampled_from(
        [
            Mutation(b"", "", "empty"),
            Mutation(b"\xff\xfe\x00x = 1", "", "not UTF-8"),
            Mutation(b'region = "r\xe9"\n', "", "latin-1"),
            Mutation("x = " + "9" * 5000, "x", "a 5,000-digit number"),
            Mutation("x = " + "[" * 5000 + "]" * 5000, "", "arrays 5,000 deep"),
            Mutation("x = " + "{a=" * 3000 + "1" + "}" * 3000, "", "tables 3,000 deep"),
            Mutation("[" + "a." * 3000 + "b]\n", "", "a dotted key 3,000 long"),
            Mutation(f"x = {json.dumps(HUGE_TEXT)}\n", "x", "a 200 kB string"),
            Mutation("\x00", "", "a NUL"),
            Mutation("[a]\n[a]\n", "", "a table twice"),
        ]
    ),
)
"""Documents that are no document at all."""
