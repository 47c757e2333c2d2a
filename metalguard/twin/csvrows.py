"""Reading the twin's CSV inputs (node lists, pod lists): the header, the rows with
their row numbers, and numeric cells checked with the file and row in the error.

Row numbers count the header as row 1, so the first data row is row 2: the line an
editor or a spreadsheet shows (for files without quoted line breaks).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from metalguard.twin.errors import TwinInputError


@dataclass(frozen=True, slots=True)
class Table:
    """A CSV file read whole: its path (as given), its columns and its data rows."""

    path: str
    columns: dict[str, int]
    """Column name -> index in a row."""
    rows: tuple[tuple[int, tuple[str, ...]], ...]
    """(row number, cells), blank lines left out."""

    def has(self, column: str) -> bool:
        """The header names ``column``."""
        return column in self.columns


def read_table(path: str | Path, required: Sequence[str]) -> Table:
    """Read ``path``; the header must name every ``required`` column (else one error
    naming all the missing ones) and every data row must have the header's width."""
    name = str(path)
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            if header is None:
                raise TwinInputError(name, "", "empty file: no header row")
            columns = {c.strip(): i for i, c in enumerate(header)}
            missing = [c for c in required if c not in columns]
            if missing:
                raise TwinInputError(
                    name,
                    "row 1",
                    f"missing column{'s' if len(missing) > 1 else ''} {', '.join(missing)}"
                    f" (the header has: {', '.join(columns) or 'nothing'})",
                )
            rows: list[tuple[int, tuple[str, ...]]] = []
            width = len(header)
            for cells in reader:
                if not cells or (len(cells) == 1 and not cells[0].strip()):
                    continue
                if len(cells) != width:
                    raise TwinInputError(
                        name,
                        f"row {reader.line_num}",
                        f"{len(cells)} cells but the header has {width} columns",
                    )
                rows.append((reader.line_num, tuple(cells)))
    except OSError as e:
        raise TwinInputError(name, "", f"cannot read: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise TwinInputError(name, "", f"not UTF-8 text: {e.reason}") from e
    except csv.Error as e:
        raise TwinInputError(name, "", f"not valid CSV: {e}") from e
    return Table(name, columns, tuple(rows))


def cell(table: Table, cells: tuple[str, ...], column: str) -> str:
    """The stripped text of ``column`` in a row ("" when the file has no such column)."""
    i = table.columns.get(column)
    return "" if i is None else cells[i].strip()


def number(table: Table, row: int, column: str, text: str, *, integer: bool = False) -> float:
    """``text`` as a finite, non-negative number (a whole one when ``integer``)."""
    try:
        value = float(text)
    except ValueError:
        raise TwinInputError(
            table.path, f"row {row}", f"column {column}: {text!r} is not a number"
        ) from None
    if not math.isfinite(value):
        raise TwinInputError(table.path, f"row {row}", f"column {column}: {text!r} is not finite")
    if value < 0:
        raise TwinInputError(table.path, f"row {row}", f"column {column}: {text} is negative")
    if integer and not value.is_integer():
        raise TwinInputError(
            table.path, f"row {row}", f"column {column}: {text!r} is not a whole number"
        )
    return value
