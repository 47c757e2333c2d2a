"""Decoding declared documents (TOML config files, QosProfile files) into Structs.

A document error names the source, the key and the problem::

    agent.toml: collect.interval_s: Expected `float` >= 0.1
    agent.toml: collect.intervall: unknown key
    controller.toml: region: missing (required)
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
_MISSING_RE = re.compile(r"Object missing required field `([^`]+)`")


class DocumentError(ValueError):
    """A document is unreadable or invalid; the message names source, key and problem."""


def describe_validation_error(message: str) -> str:
    """``Expected int - at `$.a.b``` -> ``a.b: Expected int``; unknown/missing keys named
    by their full dotted path."""
    match = _PATH_RE.search(message)
    key = match.group(1) if match else ""
    problem = message[: match.start()] if match else message
    where = f"{key}." if key else ""
    if unknown := _UNKNOWN_RE.match(problem):
        return f"{where}{unknown.group(1)}: unknown key"
    if missing := _MISSING_RE.match(problem):
        return f"{where}{missing.group(1)}: missing (required)"
    return f"{key}: {problem}" if key else problem


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
