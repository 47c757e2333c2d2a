"""The ``cache`` collector (agent/collectors/cache.py): each configured dataset's
``<cache_dir>/stats.json`` into the batch's ``cache`` list, over real files in tmp_path."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest

from metalguard.agent.batch import build_batch
from metalguard.agent.collection import Collection
from metalguard.agent.collectors import load_builtin
from metalguard.agent.collectors.base import REGISTRY, Collected, CollectorSettings, run_guarded
from metalguard.agent.collectors.cache import (
    CacheCollector,
    parse_stats,
    stale_after_s,
    without_credentials,
)
from metalguard.agent.config import CacheDataset, CacheSection, parse_config
from metalguard.agent.render import render_text
from metalguard.agent.settings import collector_settings
from metalguard.proto.base import NodeIdentity
from metalguard.proto.codec import decode, encode
from metalguard.proto.telemetry import DatasetCache, TelemetryBatch
from tests.support.clock import T0

GIB = 1024**3


def _dataset(tmp_path: Path, name: str = "imagenet", **kw: object) -> CacheDataset:
    fields: dict[str, object] = {
        "name": name,
        "source": "s3://bucket/imagenet",
        "cache_dir": str(tmp_path / name),
        "max_bytes": 100 * GIB,
        "mountpoint": f"/mnt/{name}",
    } | kw
    return msgspec.convert(fields, CacheDataset)


def _stats(dataset: CacheDataset, **kw: object) -> DatasetCache:
    fields: dict[str, object] = {
        "dataset": dataset.name,
        "source": dataset.source,
        "mountpoint": dataset.mountpoint,
        "cache_dir": dataset.cache_dir,
        "pid": 4242,
        "ts": T0,
        "policy": "pin",
        "policy_reason": "auto: shuffled epochs",
        "pattern": "shuffled",
        "max_bytes": dataset.max_bytes,
        "used_bytes": 60 * GIB,
        "cached_files": 1200,
        "dataset_bytes": 110 * GIB,
        "hits": 900,
        "misses": 100,
        "bytes_from_cache": 90 * GIB,
        "bytes_from_source": 10 * GIB,
        "evictions": 3,
    } | kw
    return msgspec.convert(fields, DatasetCache)


def _write(dataset: CacheDataset, data: bytes) -> Path:
    """The file as the cache process writes it (stats.json.tmp, then os.replace)."""
    directory = Path(dataset.cache_dir)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / "stats.json.tmp"
    tmp.write_bytes(data)
    os.replace(tmp, directory / "stats.json")
    return directory / "stats.json"


def _collector(
    *datasets: CacheDataset, now: float = T0 + 1, interval: float = 2.0
) -> CacheCollector:
    section = CacheSection(stats_interval_s=interval, datasets=datasets)
    return CacheCollector(CollectorSettings(cache=section), clock=lambda: now)


async def test_registered_enabled_by_default_and_empty_without_datasets() -> None:
    load_builtin()
    registration = REGISTRY["cache"]
    assert (registration.default_interval_s, registration.enabled_by_default) == (5, True)
    collector = registration.factory(CollectorSettings())
    assert (collector.name, collector.field) == ("cache", "cache")
    result, run = await run_guarded(collector)
    assert result == Collected(field="cache")
    assert run.success


async def test_a_stats_file_is_read_as_written(tmp_path: Path) -> None:
    ds = _dataset(tmp_path)
    stats = _stats(ds)
    _write(ds, msgspec.json.encode(stats))
    result, run = await run_guarded(_collector(ds))
    assert result.items == (stats,)
    assert result.errors == ()
    assert run.success


async def test_a_missing_file_is_the_config_only_and_an_error_naming_the_file(
    tmp_path: Path,
) -> None:
    ds = _dataset(tmp_path, source="s3://key:secret@bucket/imagenet")
    result, run = await run_guarded(_collector(ds))
    (entry,) = result.items
    assert isinstance(entry, DatasetCache)
    assert entry == DatasetCache(
        dataset="imagenet",
        source="s3://bucket/imagenet",  # never the credentials
        mountpoint="/mnt/imagenet",
        cache_dir=ds.cache_dir,
        max_bytes=100 * GIB,
    )
    assert entry.ts == 0.0
    (error,) = result.errors
    assert error.collector == "cache"
    assert error.path == str(Path(ds.cache_dir) / "stats.json")
    assert "not running" in error.message
    assert run.success, "a cache that is down is not a failed collector (no node fault)"


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (b"{not json", "malformed stats file"),
        (b'{"source": "x"}', "malformed stats file: Object missing required field `dataset`"),
        (b'{"dataset": "imagenet", "hits": -1}', "malformed stats file: Expected `int` >= 0"),
        (b'["imagenet"]', "malformed stats file"),
        (b'{"dataset": "coco", "ts": 1.0}', "stats file of dataset 'coco', not 'imagenet'"),
        (b" " * (1024 * 1024 + 1), "larger than"),
    ],
)
async def test_a_bad_file_is_the_config_only_and_names_the_problem(
    tmp_path: Path, data: bytes, problem: str
) -> None:
    ds = _dataset(tmp_path)
    path = _write(ds, data)
    result, run = await run_guarded(_collector(ds))
    (entry,) = result.items
    assert isinstance(entry, DatasetCache)
    assert (entry.dataset, entry.ts, entry.used_bytes) == ("imagenet", 0.0, 0)
    (error,) = result.errors
    assert error.path == str(path)
    assert problem in error.message
    assert run.success


async def test_an_unreadable_file_is_an_error(tmp_path: Path) -> None:
    ds = _dataset(tmp_path)
    (Path(ds.cache_dir) / "stats.json").mkdir(parents=True)  # EISDIR, even as root
    result, _ = await run_guarded(_collector(ds))
    (error,) = result.errors
    assert error.message.startswith("unreadable: ")


async def test_old_figures_are_reported_with_an_error(tmp_path: Path) -> None:
    ds = _dataset(tmp_path)
    stats = _stats(ds, ts=T0)
    _write(ds, msgspec.json.encode(stats))
    limit = stale_after_s(2.0)
    assert limit == 15.0  # 5 intervals, at least 15 s
    fresh, _ = await run_guarded(_collector(ds, now=T0 + limit))
    assert fresh.errors == ()
    old, run = await run_guarded(_collector(ds, now=T0 + limit + 1))
    assert old.items == (stats,), "the figures as written: the controller judges warmth"
    (error,) = old.errors
    assert "stopped or hangs" in error.message
    assert run.success


async def test_every_dataset_in_config_order_one_bad_leaves_the_others(tmp_path: Path) -> None:
    a, b, c = (_dataset(tmp_path, n) for n in ("a-set", "b.set", "c_set"))
    _write(a, msgspec.json.encode(_stats(a)))
    _write(c, msgspec.json.encode(_stats(c, used_bytes=1)))
    result, _ = await run_guarded(_collector(c, a, b))
    assert [e.dataset for e in result.items if isinstance(e, DatasetCache)] == [
        "c_set",
        "a-set",
        "b.set",
    ]
    assert [e.path for e in result.errors] == [str(Path(b.cache_dir) / "stats.json")]


def test_parse_stats_and_credentials_are_pure(tmp_path: Path) -> None:
    ds = _dataset(tmp_path)
    stats = _stats(ds)
    assert parse_stats(ds, msgspec.json.encode(stats)) == (stats, None)
    assert without_credentials("https://u:p@host:8443/ds?x=1") == "https://host:8443/ds?x=1"
    assert without_credentials("s3://bucket/ds") == "s3://bucket/ds"
    assert without_credentials("/nfs/data@v2") == "/nfs/data@v2"


async def test_agent_toml_to_the_batch_text_and_the_wire(tmp_path: Path) -> None:
    """``[[cache.datasets]]`` in agent.toml -> the collector (through the collector
    settings) -> TelemetryBatch.cache, its text lines, msgpack round trip."""
    config = parse_config(
        f"""
[collect]
enabled = ["cache"]

[cache]
stats_interval_s = 1.0

[[cache.datasets]]
name = "imagenet"
source = "/nfs/imagenet"
cache_dir = "{tmp_path / "imagenet"}"
max_bytes = 1000
mountpoint = "/mnt/imagenet"

[[cache.datasets]]
name = "coco"
source = "http://store:8000/coco"
cache_dir = "{tmp_path / "coco"}"
max_bytes = 500
""",
        "agent.toml",
    )
    warm = _stats(config.cache.datasets[0], ts=T0, used_bytes=800, max_bytes=1000)
    _write(config.cache.datasets[0], msgspec.json.encode(warm))
    collection = Collection(
        ["cache"], collector_settings(config), base_interval_s=5.0, clock=lambda: T0
    )
    cycle = await collection.run_cycle(force=True)
    await collection.close()
    node = NodeIdentity(region="r1", cluster="c1", node="n1")
    batch = build_batch(node, 1, cycle, ts=T0 + 1)
    assert [c.dataset for c in batch.cache] == ["imagenet", "coco"]
    assert batch.cache[0].used_bytes == 800
    assert batch.cache[1].ts == 0.0
    assert [e.collector for e in batch.errors] == ["cache"]
    text = render_text(batch)
    assert "cache imagenet: 800/1000 B in 1200 files, hits 900 misses 100 (90%)" in text
    assert "cache coco: not running" in text
    again = decode(encode(batch))
    assert isinstance(again, TelemetryBatch)
    assert again.cache == batch.cache
