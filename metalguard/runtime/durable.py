"""Writing a file so that it is on the disk when the call returns (shared by the agent's
spool and the dataset cache's figures)."""

from __future__ import annotations

import os
from pathlib import Path


def write_durably(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write ``data`` to ``path`` (created or truncated with ``mode``) and fsync it; the
    caller renames it into place for an atomic replace."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
