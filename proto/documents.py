"""Decoding declared documents (TOML config files, QosProfile files) into Structs.

A document error names the source, the key and the problem::

    agent.toml: collect.interval_s: Expected `float` >= 0.1
    agent.toml: collect: unknown key 'intervall'
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")

_PATH_RE = re.compile(r" - at `\$\.?(.*)`$")
_UNKNOWN_RE = re.compile(r"Object contains unknown field `([^`]+)`")


class DocumentError(ValueError):
    """A document is unreadable or invalid; the message names source, key and problem."""


def describe_validation_error(message: str) -> str:
    """``Expected int - at `$.a.b``` -> ``a.b: Expected int`` (unknown keys named)."""
    match = _PATH_RE.search(message)
    problem = message[: match.start()] if match else message
    unknown = _UNKNOWN_RE.match(problem)
    if unknown:
        problem = f"unknown key {unknown.group(1)!r}"
    return f"{match.group(1)}: {problem}" if match and match.group(1) else problem


def parse_toml(text: str, source: str) -> dict[str, Any]:
    """TOML text as a dict; DocumentError naming ``source`` when it is not TOML."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise DocumentError(f"{source}: not valid TOML: {exc}") from None


def convert(raw: Any, type_: type[T], source: str) -> T:
    """Validate plain data into ``type_``; DocumentError naming source, key, problem."""
    try:
        return msgspec.convert(raw, type_)
    except msgspec.ValidationError as exc:
        raise DocumentError(f"{source}: {describe_validation_error(str(exc))}") from None


def decode_toml(text: str, type_: type[T], source: str = "<document>") -> T:
    """Parse and validate a TOML document."""
    return convert(parse_toml(text, source), type_, source)


def read_text(path: Path) -> str:
    """A document file's text; DocumentError naming the file when unreadable."""
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DocumentError(f"{path}: cannot read: {exc}") from None
