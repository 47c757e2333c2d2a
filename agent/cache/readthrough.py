"""Reads the cache does not keep: served from the source, one request per file, not per chunk.

A FUSE reader asks for a file in chunks (128 KiB and up); reading each chunk of a file the
cache does not take (the policy declined it, it is larger than the cache, the cache disk
is full) straight from the source would cost one round trip per chunk where a direct
reader pays one per file.  :class:`ReadThrough` fetches a *window* instead — the whole
file when it is at most ``whole_bytes``, else ``window_bytes`` from the offset asked for
(sequential readahead) — keeps the last windows in memory (``max_bytes`` in all, least
recently used dropped first) and serves the following chunks from them.  The store's
sequential prefetch warms the window of a file it will not keep (:meth:`ReadThrough.warm`),
so a reader walking past the cache's share of a dataset still finds its next file ready.

A window records the source version (size, mtime, ETag) it was read at and serves only a
read that names the same version, so a changed source file is never answered from an
old window.  Concurrent readers of a window being fetched wait for that one fetch.
Thread-safe; the lock is never held across a request to the source.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from metalguard.agent.cache.source import Entry, Source

WHOLE_BYTES = 16 * 1024 * 1024
"""Files up to this size are fetched whole on their first read-through."""
WINDOW_BYTES = 8 * 1024 * 1024
"""Larger files are fetched in windows this large."""
BUFFER_BYTES = 256 * 1024 * 1024
"""Memory for windows, in all."""


@dataclass(eq=False, slots=True)
class _Window:
    key: str
    version: tuple[int, float, str]
    start: int
    stop: int
    """The end of the bytes it holds (planned while in flight)."""
    data: bytes = b""
    ready: threading.Event = field(default_factory=threading.Event)
    ok: bool = False


class ReadThrough:
    """Window-buffered reads from a source (see the module doc)."""

    def __init__(
        self,
        source: Source,
        max_bytes: int = BUFFER_BYTES,
        whole_bytes: int = WHOLE_BYTES,
        window_bytes: int = WINDOW_BYTES,
    ) -> None:
        self.source = source
        self.max_bytes = max_bytes
        self.whole_bytes = whole_bytes
        self.window_bytes = window_bytes
        self._lock = threading.Lock()
        self._windows: OrderedDict[tuple[str, int], _Window] = OrderedDict()
        self._by_key: dict[str, set[int]] = {}
        self._bytes = 0

    def read(self, entry: Entry, offset: int, size: int) -> tuple[bytes, int]:
        """``size`` bytes (``< 0``: to the end) of ``entry``'s file from ``offset``, and how
        many bytes this call fetched from the source (0 when a window had them)."""
        end = entry.size if size < 0 else min(entry.size, offset + size)
        if offset >= end:
            return b"", 0
        if self.max_bytes <= 0 or end - offset > self.window_bytes:
            data = self.source.read(entry.path, offset, end - offset)
            return data, len(data)
        while True:
            with self._lock:
                window = self._find(entry, offset, end)
                mine = window is None
                if window is None:
                    if entry.size <= self.whole_bytes:
                        window = _Window(entry.path, entry.version, 0, entry.size)
                    else:
                        stop = min(entry.size, offset + self.window_bytes)
                        window = _Window(entry.path, entry.version, offset, stop)
                    self._add(window)
            if mine:
                return self._fetch(window, offset, end)
            window.ready.wait()
            if window.ok and end <= window.stop:
                return _cut(window, offset, end), 0
            # its fetch failed or came back short (the file changed): fetch our own

    def _fetch(self, window: _Window, offset: int, end: int) -> tuple[bytes, int]:
        data, ok = b"", False
        try:
            data = self.source.read(window.key, window.start, window.stop - window.start)
            ok = True
        finally:
            with self._lock:
                window.data, window.ok = data, ok
                window.stop = window.start + len(data)
                if self._windows.get((window.key, window.start)) is window:
                    if ok:
                        self._bytes += len(data)
                        self._trim()
                    else:
                        self._remove(window)
            window.ready.set()
        return _cut(window, offset, end), len(data)

    def warm(self, entry: Entry) -> int:
        """Fetch ``entry``'s first window ahead of a reader (sequential prefetch of a file
        the cache does not take); the bytes fetched (0: buffered already, or too large)."""
        if entry.size > self.whole_bytes or self.max_bytes <= 0 or entry.size <= 0:
            return 0
        return self.read(entry, 0, 1)[1]

    def adopt(self, entry: Entry, data: bytes) -> None:
        """Keep ``data``, all of ``entry``'s file fetched by the caller, as its window (the
        reads that follow are served from it)."""
        if self.max_bytes <= 0 or len(data) != entry.size or entry.size > self.whole_bytes:
            return
        window = _Window(entry.path, entry.version, 0, entry.size, data=data, ok=True)
        window.ready.set()
        with self._lock:
            self._add(window)
            self._bytes += len(data)
            self._trim()

    def forget(self, key: str) -> None:
        """Drop every window of ``key`` (its source changed, or the cache took it)."""
        with self._lock:
            for start in list(self._by_key.get(key, ())):
                self._remove(self._windows[(key, start)])

    @property
    def buffered_bytes(self) -> int:
        """Bytes held in windows now."""
        return self._bytes

    # -- under the lock -------------------------------------------------------------------

    def _find(self, entry: Entry, offset: int, end: int) -> _Window | None:
        for start in self._by_key.get(entry.path, ()):
            window = self._windows[(entry.path, start)]
            if window.version == entry.version and window.start <= offset and end <= window.stop:
                self._windows.move_to_end((entry.path, start))
                return window
        return None

    def _add(self, window: _Window) -> None:
        old = self._windows.get((window.key, window.start))
        if old is not None:
            self._remove(old)
        self._windows[(window.key, window.start)] = window
        self._by_key.setdefault(window.key, set()).add(window.start)

    def _remove(self, window: _Window) -> None:
        if self._windows.get((window.key, window.start)) is not window:
            return
        del self._windows[(window.key, window.start)]
        if window.ok:
            self._bytes -= len(window.data)
        starts = self._by_key.get(window.key)
        if starts is not None:
            starts.discard(window.start)
            if not starts:
                del self._by_key[window.key]

    def _trim(self) -> None:
        """Drop the least recently used complete windows until within max_bytes."""
        if self._bytes <= self.max_bytes:
            return
        for window in list(self._windows.values()):
            if self._bytes <= self.max_bytes:
                return
            if window.ok:
                self._remove(window)


def _cut(window: _Window, offset: int, end: int) -> bytes:
    lo = offset - window.start
    return window.data[lo : lo + (end - offset)]
