"""The one error of the twin's inputs: which file, where in it, what is wrong."""

from __future__ import annotations


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
