"""What the operator commands share on the terminal: :class:`CliError` and its exit
status (:func:`guarded`), tables and JSON output."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO

MAX_CELL = 60
"""A table cell longer than this is cut, ending in an ellipsis."""


class CliError(Exception):
    """Printed as ``metalguard: <message>``; ``code`` is the exit status."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


Command = Callable[[argparse.Namespace], int]


def guarded(fn: Command) -> Command:
    """``fn`` with CliError printed and turned into its exit status."""

    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except CliError as exc:
            print(f"metalguard: {exc}", file=sys.stderr)
            return exc.code

    return run


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], indent: int = 0) -> str:
    """Rows as left-aligned columns (a header line first when given)."""
    lines = [list(headers), *[[cell(c) for c in row] for row in rows]] if headers else rows
    if not lines:
        return ""
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(lines[0]))]
    pad = " " * indent
    return "\n".join(
        pad + "  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


def cell(value: Any) -> str:
    """A table cell: ``-`` for nothing, at most MAX_CELL characters."""
    text = "-" if value is None or value == "" else str(value)
    return text if len(text) <= MAX_CELL else text[: MAX_CELL - 1] + "…"


def print_json(value: Any, out: TextIO | None = None) -> int:
    """Write ``value`` as indented, key-sorted JSON and a newline; exit status 0."""
    out = sys.stdout if out is None else out
    json.dump(value, out, indent=2, sort_keys=True)
    out.write("\n")
    return 0
