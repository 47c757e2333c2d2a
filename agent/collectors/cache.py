"""The node-local dataset caches: each ``[[cache.datasets]]`` entry's figures, as its cache
process (``metalguard cache mount``) last wrote them to ``<cache_dir>/stats.json``.

The agent never talks to a cache process: it reads the file, a msgspec-encoded
:class:`~metalguard.proto.telemetry.DatasetCache` written atomically every
``[cache] stats_interval_s`` and on exit (docs/cache.md).  Every configured dataset gets
exactly one entry in the batch's ``cache`` list, in config order:

- the file read and decoded: the figures as written;
- the file missing (the cache is not running), unreadable, malformed, too big, or of
  another dataset: an entry with only what the config says (``dataset``, ``source``
  without credentials, ``mountpoint``, ``cache_dir``, ``max_bytes``; ``ts`` 0, so never
  warm), plus a CollectorError naming the file and the problem;
- the figures older than ``STALE_INTERVALS`` stats intervals (at least ``STALE_MIN_S``):
  the figures as written, plus a CollectorError (the process stopped or hangs).

A cache that is down is not a node fault: with a dataset configured the collector always
has readings, so its run counts as a success and the scorer's ``collector_failed`` rule
never fires for it; the errors show in ``agent collect`` and the batch's ``errors``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

import msgspec

from metalguard.agent.collectors.base import BatchField, Collected, CollectorSettings, register
from metalguard.proto.telemetry import CollectorError, DatasetCache

if TYPE_CHECKING:
    from metalguard.agent.config import CacheDataset

NAME = "cache"
STATS_FILE = "stats.json"
MAX_STATS_BYTES = 1024 * 1024
"""A stats file is a few hundred bytes; a bigger one is not read (an error entry)."""
STALE_INTERVALS = 5
STALE_MIN_S = 15.0
DEFAULT_STATS_INTERVAL_S = 2.0

_DECODER = msgspec.json.Decoder(DatasetCache)


def stats_path(dataset: CacheDataset) -> Path:
    """Where the cache process of ``dataset`` writes its figures."""
    return Path(dataset.cache_dir) / STATS_FILE


def without_credentials(source: str) -> str:
    """``source`` with any ``user:password@`` of a URL removed (paths are unchanged)."""
    if "://" not in source:
        return source
    parts = urlsplit(source)
    if "@" not in parts.netloc:
        return source
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def configured(dataset: CacheDataset) -> DatasetCache:
    """The entry of a dataset whose stats file could not be used: the config only."""
    return DatasetCache(
        dataset=dataset.name,
        source=without_credentials(dataset.source),
        mountpoint=dataset.mountpoint,
        cache_dir=dataset.cache_dir,
        max_bytes=dataset.max_bytes,
    )


def parse_stats(dataset: CacheDataset, raw: bytes) -> tuple[DatasetCache, str | None]:
    """A stats file's bytes as the dataset's entry, and the problem (None: none) — pure."""
    if len(raw) > MAX_STATS_BYTES:
        return configured(dataset), f"stats file larger than {MAX_STATS_BYTES} bytes: not read"
    try:
        stats = _DECODER.decode(raw)
    except msgspec.DecodeError as exc:
        return configured(dataset), f"malformed stats file: {exc}"
    if stats.dataset != dataset.name:
        problem = f"stats file of dataset {stats.dataset!r}, not {dataset.name!r}"
        return configured(dataset), f"{problem} (two datasets share a cache_dir?)"
    return stats, None


def stale_after_s(stats_interval_s: float) -> float:
    """How old a cache's figures may be before the collector reports them stale."""
    return max(STALE_INTERVALS * stats_interval_s, STALE_MIN_S)


def read_dataset(
    dataset: CacheDataset, now: float, stats_interval_s: float
) -> tuple[DatasetCache, CollectorError | None]:
    """One dataset's entry and its error, if any (blocking file I/O)."""
    path = stats_path(dataset)
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_STATS_BYTES + 1)
    except FileNotFoundError:
        return configured(dataset), CollectorError(
            collector=NAME,
            path=str(path),
            message=f"no stats file: the cache of dataset {dataset.name!r} is not running "
            f"(metalguard cache mount --config ... --dataset {dataset.name})",
        )
    except OSError as exc:
        return configured(dataset), CollectorError(
            collector=NAME, path=str(path), message=f"unreadable: {exc.strerror or exc}"
        )
    entry, problem = parse_stats(dataset, raw)
    if problem is None:
        age = now - entry.ts
        limit = stale_after_s(stats_interval_s)
        if age > limit:
            problem = (
                f"figures {age:.0f} s old (rewritten every {stats_interval_s:g} s): "
                "the cache process is stopped or hangs"
            )
    error = (
        None if problem is None else CollectorError(collector=NAME, path=str(path), message=problem)
    )
    return entry, error


def read_all(datasets: Sequence[CacheDataset], now: float, stats_interval_s: float) -> Collected:
    """Every configured dataset's entry, in config order, with the errors (blocking)."""
    items: list[DatasetCache] = []
    errors: list[CollectorError] = []
    for dataset in datasets:
        entry, error = read_dataset(dataset, now, stats_interval_s)
        items.append(entry)
        if error is not None:
            errors.append(error)
    return Collected(field="cache", items=tuple(items), errors=tuple(errors))


@register(NAME, default_interval_s=5)
class CacheCollector:
    """The ``[[cache.datasets]]`` caches' figures, from their stats files."""

    name = NAME
    field: BatchField = "cache"

    def __init__(
        self, settings: CollectorSettings, *, clock: Callable[[], float] = time.time
    ) -> None:
        section = settings.cache
        self._datasets: tuple[CacheDataset, ...] = section.datasets if section else ()
        self._interval_s = section.stats_interval_s if section else DEFAULT_STATS_INTERVAL_S
        self._clock = clock

    async def collect(self) -> Collected:
        """Read every configured dataset's stats file once (none configured: nothing)."""
        if not self._datasets:
            return Collected(field=self.field)
        return await asyncio.to_thread(read_all, self._datasets, self._clock(), self._interval_s)
