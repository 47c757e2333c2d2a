"""Storms: the findings of one kind on one device within a window become one report with
a count (pure; docs/kmsg.md "Storms").

The first finding of a (kind, device, XID) in a window is reported at once; the ones
after it in the same window are counted, and reported together when the window ends (at
the next finding of that key, or at :meth:`Coalescer.flush`). An XID 45 that names its
cause ("caused by previous Xid 79") is counted with that XID's key, so the cleanup after a
fault does not look like a fault of its own. One fleet logged 168,924 XID 45 lines in three
hours: here that is one report a window.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from metalguard.agent.kmsg.rules import Finding

WINDOW_S: Final = 60.0
CLEANUP_XID: Final = 45
_SUPPRESSED = re.compile(r"(?P<what>\S+): (?P<n>\d+) callbacks suppressed")

Key = tuple[str, str, int | None]


@dataclass(frozen=True, slots=True)
class Report:
    """What to announce: a finding, and how many records it stands for."""

    finding: Finding
    count: int = 1
    """Records of its key it stands for (1: the first of a window)."""
    repeats: bool = False
    """The window's later records (count of them), reported when it ended."""
    previous_boot: bool = False
    """Read back from pstore after a reboot (docs/kmsg.md "Panics")."""


@dataclass(slots=True)
class _Window:
    start: float
    last: Finding
    suppressed: int = 0


def storm_key(f: Finding) -> Key:
    """(kind, device, XID): an XID 45 with a named cause counts as that XID."""
    xid = f.xid
    if xid == CLEANUP_XID and f.caused_by is not None:
        xid = f.caused_by
    return (f.kind, f.device, xid)


class Coalescer:
    """Counts repeats of a key within ``window_s`` (seconds of the caller's clock)."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._windows: dict[Key, _Window] = {}

    def feed(self, finding: Finding, now: float) -> list[Report]:
        """The reports ``finding`` makes due now (none while its window is counting)."""
        key = storm_key(finding)
        window = self._windows.get(key)
        if window is not None and now - window.start < self.window_s:
            window.suppressed += 1
            window.last = finding
            return []
        reports = self._close(key) if window is not None else []
        self._windows[key] = _Window(now, finding)
        reports.append(Report(finding))
        return reports

    def flush(self, now: float) -> list[Report]:
        """The repeats of every window that has ended by ``now``."""
        ended = [k for k, w in self._windows.items() if now - w.start >= self.window_s]
        reports: list[Report] = []
        for key in ended:
            reports += self._close(key)
        return reports

    def _close(self, key: Key) -> list[Report]:
        window = self._windows.pop(key)
        if not window.suppressed:
            return []
        return [Report(window.last, window.suppressed, repeats=True)]


def suppressed_callbacks(text: str) -> int:
    """The records a "N callbacks suppressed" line says the kernel dropped (0: none)."""
    m = _SUPPRESSED.search(text)
    return int(m.group("n")) if m else 0
