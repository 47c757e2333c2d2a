"""The dataset cache's counters and its ``stats.json`` (docs/cache.md).

A cache process keeps one :class:`Counters` (mutated only under the store's lock, so
plain ints), turns it into the wire record :class:`~metalguard.proto.telemetry.DatasetCache`
with :meth:`CacheStore.stats`, and writes that record to ``<cache_dir>/stats.json`` with
:func:`write_stats`: ``stats.json.tmp``, fsync, ``os.replace`` — a reader (the agent's
collector, ``metalguard cache stats``) sees the old file or the new one, never a torn one.
:func:`read_stats` is the reader's side.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import msgspec

from metalguard.proto.telemetry import DatasetCache
from metalguard.runtime.durable import write_durably

STATS_FILE = "stats.json"


@dataclass(slots=True)
class Counters:
    """What a cache counts since its process started (see DatasetCache's fields)."""

    hits: int = 0
    misses: int = 0
    bytes_from_cache: int = 0
    bytes_from_source: int = 0
    evictions: int = 0
    prefetched: int = 0
    passthrough_reads: int = 0
    warnings: int = 0
    last_warning: str = ""


def stats_path(cache_dir: str | os.PathLike[str]) -> Path:
    """Where the cache in ``cache_dir`` writes its figures."""
    return Path(cache_dir) / STATS_FILE


def write_stats(path: str | os.PathLike[str], record: DatasetCache) -> None:
    """Write ``record`` to ``path`` atomically (tmp file, fsync, rename)."""
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    write_durably(tmp, msgspec.json.encode(record), 0o644)
    os.replace(tmp, target)


def read_stats(path: str | os.PathLike[str]) -> DatasetCache:
    """The record in a stats file (FileNotFoundError when absent, msgspec.DecodeError /
    msgspec.ValidationError when it is not one)."""
    return msgspec.json.decode(Path(path).read_bytes(), type=DatasetCache)
