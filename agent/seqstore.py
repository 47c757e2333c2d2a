"""The batch sequence number, persisted so that it keeps rising across restarts.

Message ids are ``<node>:<seq>``; a seq that restarted at 1 would collide with ids the
server still remembers in its duplicate window and be dropped as a duplicate.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


class SeqStore:
    """The last used seq in a small file, written atomically."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self.last = self._load()

    def _load(self) -> int:
        try:
            text = self._path.read_text(encoding="ascii").strip()
        except FileNotFoundError:
            return 0
        except (OSError, UnicodeDecodeError) as exc:
            log.warning("cannot read %s (%s); starting seq at 0", self._path, exc)
            return 0
        try:
            value = int(text)
        except ValueError:
            log.warning("%s holds %r, not a number; starting seq at 0", self._path, text[:40])
            return 0
        return max(value, 0)

    def next(self) -> int:
        """Reserve and persist the next seq."""
        self.last += 1
        tmp = self._path.with_name(self._path.name + ".tmp")
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            with tmp.open("w", encoding="ascii") as f:
                f.write(f"{self.last}\n")
                f.flush()
                os.fsync(f.fileno())
            tmp.replace(self._path)
        except OSError as exc:
            log.warning("cannot persist seq to %s: %s", self._path, exc)
        return self.last
