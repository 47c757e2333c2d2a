"""Decoding declared documents (TOML config files, QosProfile files) into Structs.

A document error names the source, the key and the problem::

    agent.toml: collect.interval_s: Expected `float` >= 0.1
    agent.toml: collect.intervall: unknown key
    controller.toml: region: missing (required)
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")

_PATH_RE = re.compile(r" - at `\$\.?(.*)`$")
_UNKNOWN_RE = re.compile(r"Object contains unknown field `(.*)`\Z", re.DOTALL)
_MISSING_RE = re.compile(r"Object missing required field `(.*)`\Z", re.DOTALL)


class DocumentError(ValueError):
    """A document is unreadable or invalid; the message names source, key and problem."""


def describe_validation_error(message: str) -> str:
    """``Expected int - at `$.a.b``` -> ``a.b: Expected int``; unknown/missing keys named
    by their full dotted path."""
    match = _PATH_RE.search(message)
    key = match.group(1) if match else ""
    problem = message[: match.start()] if match else message
    where = f"{key}." if key else ""
    if unknown := _UNKNOWN_RE.match(problem):  # the whole name, backticks and all
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
    except ValueError as exc:  # an integer of more digits than Python converts
        raise DocumentError(f"{source}: not valid TOML: a number too long: {exc}") from None
    except RecursionError:
        raise DocumentError(f"{source}: not valid TOML: nested too deeply") from None


def convert(raw: Any, type_: type[T], source: str) -> T:
    """Validate plain data into ``type_``; DocumentError naming source, key, problem."""
    try:
        return msgspec.convert(raw, type_)
    except msgspec.ValidationError as exc:
        raise DocumentError(f"{source}: {describe_validation_error(str(exc))}") from None
    except RecursionError:
        raise DocumentError(f"{source}: nested too deeply") from None


def read_text(path: Path) -> str:
    """A document file's text; DocumentError naming the file when unreadable."""
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError, ValueError) as exc:  # ValueError: a NUL in the path
        raise DocumentError(f"{path}: cannot read: {exc}") from None


def load_document(
    document: Path | str,
    type_: type[T],
    *,
    source: str = "",
    error: type[DocumentError] = DocumentError,
    prepare: Callable[[dict[str, Any]], Any] | None = None,
) -> T:
    """A TOML document validated into ``type_``: the file at ``document`` (a Path) or the
    TOML text itself (a str).

    ``source`` names it in errors (default: the path, or ``<document>`` for text);
    ``prepare`` may rework the parsed table before it is validated (defaults laid under
    it, say). Raises ``error`` (a DocumentError) naming source, key and problem.
    """
    name = source or (str(document) if isinstance(document, Path) else "<document>")
    try:
        text = read_text(document) if isinstance(document, Path) else document
        raw = parse_toml(text, name)
        return convert(raw if prepare is None else prepare(raw), type_, name)
    except DocumentError as exc:
        if isinstance(exc, error):
            raise
        raise error(str(exc)) from None
