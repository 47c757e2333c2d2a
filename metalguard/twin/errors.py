"""The one error of the twin's inputs: which file, where in it, what is wrong."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any


class TwinInputError(Exception):
    """A bad input file (or argument) of the twin; the CLI prints it and exits 2.

    ``path``: the file (or the argument, e.g. ``--nodes``); ``where``: the place in it
    (``row 17``, ``key causes.gpu.precursor_fraction``), "" for the whole file;
    ``problem``: what is wrong, in words.
    """

    def __init__(self, path: str, where: str, problem: str) -> None:
        super().__init__(path, where, problem)
        self.path = path
        self.where = where
        self.problem = problem

    def __str__(self) -> str:
        if self.where:
            return f"{self.path}: {self.where}: {self.problem}"
        return f"{self.path}: {self.problem}"


def read_toml(path: str | Path) -> dict[str, Any]:
    """A TOML input file's tables; an unreadable or invalid file is a
    :class:`TwinInputError` naming it."""
    name = str(path)
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except OSError as e:
        raise TwinInputError(name, "", f"cannot read: {e.strerror or e}") from e
    except tomllib.TOMLDecodeError as e:
        raise TwinInputError(name, "", f"not valid TOML: {e}") from e
