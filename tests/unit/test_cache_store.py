"""The dataset cache's store over real files: a local-directory source in tmp_path and
fsspec's memory://; every read is checked byte for byte against the source."""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import random
import threading
import time as time_module
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec
import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from metalguard.agent.cache import store as store_module
from metalguard.agent.cache.source import Entry, Source, SourceError, normalize, open_source
from metalguard.agent.cache.stats import read_stats
from metalguard.agent.cache.store import CacheStore
from metalguard.proto.telemetry import DatasetCache
from tests.support.clock import ManualClock
from tests.support.waiting import wait_until_blocking

DEADLINE_S = 10.0


def make_dataset(
    root: Path, n: int = 20, seed: int = 0, lo: int = 1000, hi: int = 4000
) -> dict[str, bytes]:
    """``n`` files of random bytes under ``root/train`` plus ``root/index.json``."""
    rng = random.Random(seed)
    files = {}
    (root / "train").mkdir(parents=True)
    for i in range(n):
        data = rng.randbytes(rng.randint(lo, hi))
        (root / "train" / f"{i:04d}.bin").write_bytes(data)
        files[f"train/{i:04d}.bin"] = data
    (root / "index.json").write_bytes(b'{"n": %d}' % n)
    files["index.json"] = (root / "index.json").read_bytes()
    return files


@pytest.fixture
def src(tmp_path):
    root = tmp_path / "src"
    files = make_dataset(root)
    return root, files


def new_store(
    source: Source | str, tmp_path: Path, max_bytes: int = 1 << 20, **kw: Any
) -> CacheStore:
    kw.setdefault("min_free_bytes", 0)
    kw.setdefault("durable", False)
    return CacheStore(source, tmp_path / "cache", max_bytes, **kw).open()


def wait_for(predicate: Callable[[], bool], what: str) -> None:
    wait_until_blocking(predicate, DEADLINE_S, what, poll_s=0.01)


def test_reads_equal_the_source_whole_and_in_ranges(src, tmp_path):
    root, files = src
    with new_store(str(root), tmp_path, policy="lru") as store:
        for path, data in files.items():
            assert store.read("/" + path, 0, len(data) + 100) == data
            assert store.read(path, 7, 100) == data[7:107]
            assert store.read(path, len(data) - 3, 100) == data[-3:]
            assert store.read(path, len(data) + 10, 100) == b""
            assert store.read(path, 5, -1) == data[5:]
        stats = store.stats()
        assert stats.misses == len(files)  # one access per offset-0 read
        assert stats.hits == 0
        assert stats.cached_files == len(files)
        assert stats.used_bytes == sum(map(len, files.values())) <= stats.max_bytes
        for path, data in files.items():
            assert store.read(path, 0, 1 << 20) == data
        assert store.stats().hits == len(files)


def test_listdir_and_stat_show_the_source(src, tmp_path):
    root, files = src
    with new_store(str(root), tmp_path) as store:
        top = store.listdir("/")
        assert [(e.name, e.is_dir) for e in top] == [("index.json", False), ("train", True)]
        train = store.listdir("train")
        assert [e.name for e in train] == sorted(p.split("/")[1] for p in files if "/" in p)
        entry = store.stat("train/0003.bin")
        assert (entry.path, entry.size, entry.is_dir) == (
            "train/0003.bin",
            len(files["train/0003.bin"]),
            False,
        )
        assert entry.mtime == pytest.approx((root / "train/0003.bin").stat().st_mtime)
        assert store.stat("").is_dir
        assert store.stat("train").is_dir
        with pytest.raises(FileNotFoundError):
            store.stat("train/missing.bin")
        with pytest.raises(FileNotFoundError):
            store.read("nope", 0, 10)
        with pytest.raises(IsADirectoryError):
            store.read("train", 0, 10)
        with pytest.raises(ValueError, match="leaves the source"):
            store.read("../etc/passwd", 0, 10)
        assert store.stats().dataset_bytes == sum(map(len, files.values()))


def test_memory_source(tmp_path):
    fs = fsspec.filesystem("memory")
    base = f"/mgcache-test-{os.getpid()}-{id(tmp_path)}"
    rng = random.Random(1)
    files = {f"shard-{i}.tar": rng.randbytes(5000 + i) for i in range(6)}
    for name, data in files.items():
        fs.pipe(f"{base}/ds/{name}", data)
    try:
        with new_store(f"memory://{base}/ds", tmp_path, max_bytes=16_000, policy="lru") as store:
            for _ in range(3):
                for name, data in files.items():
                    assert store.read(name, 0, 1 << 20) == data
                    assert store.read(name, 100, 50) == data[100:150]
                    assert store.used_bytes <= 16_000
            assert store.stats().evictions > 0
            assert [e.name for e in store.listdir("")] == sorted(files)
    finally:
        fs.rm(base, recursive=True)


def test_the_size_bound_holds_through_a_random_workload_with_evictions(src, tmp_path):
    root, files = src
    rng = random.Random(3)
    max_bytes = 12_000
    for policy in ("lru", "pin", "auto"):
        with new_store(str(root), tmp_path / policy, max_bytes=max_bytes, policy=policy) as store:
            for step in range(300):
                path = rng.choice(sorted(files))
                data = files[path]
                offset = rng.choice([0, 0, rng.randrange(len(data))])
                size = rng.randint(1, 3000)
                assert store.read(path, offset, size) == data[offset : offset + size]
                assert store.used_bytes <= max_bytes
                if step % 10 == 0:  # evicted copies are deleted in the background: in bound
                    assert data_bytes(tmp_path / policy / "cache") <= max_bytes
            used = store.used_bytes
        assert data_bytes(tmp_path / policy / "cache") == used <= max_bytes


def data_bytes(cache_dir: Path) -> int:
    """Bytes of the data files under ``cache_dir`` (copies, fills, copies being deleted)."""
    total = 0
    for sub in ("objects", "tmp"):
        for f in (cache_dir / sub).rglob("*"):
            with contextlib.suppress(FileNotFoundError):
                if f.is_file() and f.suffix not in (".meta", ".tmp"):
                    total += f.stat().st_size
    return total


def test_concurrent_readers_of_one_missing_file_share_one_fetch(src, tmp_path, monkeypatch):
    root, files = src
    source = open_source(str(root))
    readers = 8
    fetches = []
    stats_seen = threading.Semaphore(0)
    gate = threading.Event()
    real_fetch, real_stat = source.fetch_to, source.stat_for_fetch

    def counting_stat(path):  # a miss looks its file up with stat_for_fetch
        entry = real_stat(path)
        if path == "train/0001.bin":
            stats_seen.release()
        return entry

    def gated_fetch(path, dest, entry):
        fetches.append(path)
        assert gate.wait(DEADLINE_S), "the gate was never opened"
        return real_fetch(path, dest, entry)

    monkeypatch.setattr(source, "stat_for_fetch", counting_stat)
    monkeypatch.setattr(source, "fetch_to", gated_fetch)
    with new_store(source, tmp_path) as store:
        results: list[bytes] = []
        threads = [
            threading.Thread(
                target=lambda: results.append(store.read("train/0001.bin", 0, 1 << 20))
            )
            for _ in range(readers)
        ]
        for t in threads:
            t.start()
        for _ in range(readers):  # every reader is past its stat: the fill is still gated
            assert stats_seen.acquire(timeout=DEADLINE_S)
        assert store.cached_path("train/0001.bin", count=False) is None  # not complete yet
        gate.set()
        for t in threads:
            t.join(DEADLINE_S)
        assert results == [files["train/0001.bin"]] * readers
        assert fetches == ["train/0001.bin"]
        stats = store.stats()
        assert stats.misses + stats.hits == readers
        assert stats.misses >= 1


def test_concurrent_fills_never_reserve_more_than_max_bytes(src, tmp_path, monkeypatch):
    """Eight readers miss eight different files at once, their fetches held: only what
    fits is admitted (reserved before fetching), the rest is read through."""
    root, files = src
    source = open_source(str(root))
    names = [f"train/{i:04d}.bin" for i in range(8)]
    gate = threading.Event()
    entered: list[int] = []
    progress = threading.Semaphore(0)
    real_fetch = source.fetch_to

    def gated_fetch(path, dest, entry):
        entered.append(entry.size)
        progress.release()
        assert gate.wait(DEADLINE_S), "the gate was never opened"
        return real_fetch(path, dest, entry)

    monkeypatch.setattr(source, "fetch_to", gated_fetch)
    max_bytes = 10_000
    with new_store(source, tmp_path, max_bytes=max_bytes, policy="lru") as store:
        results: dict[str, bytes] = {}

        def reader(path: str) -> None:
            results[path] = store.read(path, 0, 1 << 20)
            progress.release()

        threads = [threading.Thread(target=reader, args=(p,)) for p in names]
        for t in threads:
            t.start()
        # each reader either entered a (held) fetch or finished reading through
        for _ in names:
            assert progress.acquire(timeout=DEADLINE_S)
        assert 1 <= len(entered) < len(names)
        assert sum(entered) <= max_bytes
        gate.set()
        for t in threads:
            t.join(DEADLINE_S)
        assert results == {p: files[p] for p in names}
        assert store.used_bytes == sum(entered) <= max_bytes
        assert store.stats().passthrough_reads == 0  # the policy's choice, not a warning


def test_concurrent_random_readers_with_evictions_always_read_the_right_bytes(
    src, tmp_path, monkeypatch
):
    """Many threads, a cache of a few files and an fd cache of 3: evictions and fd
    closes race with reads; no read may see another file's bytes (a recycled fd)."""
    root, files = src
    monkeypatch.setattr(store_module, "FD_CACHE", 3)
    errors: list[str] = []
    with new_store(str(root), tmp_path, max_bytes=9000, policy="lru") as store:

        def worker(seed: int) -> None:
            rng = random.Random(seed)
            for _ in range(150):
                path = rng.choice(sorted(files))
                data = files[path]
                offset = rng.choice([0, rng.randrange(len(data))])
                got = store.read(path, offset, 1500)
                if got != data[offset : offset + 1500]:
                    errors.append(f"{path}@{offset}")
                if store.used_bytes > 9000:
                    errors.append(f"used {store.used_bytes}")

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors[:5]
        assert store.stats().evictions > 0


@pytest.mark.parametrize("policy", ["lru", "pin", "auto"])
def test_a_randomized_workload_with_changes_and_restarts_reads_only_source_bytes(tmp_path, policy):
    """Reads at random offsets, source files rewritten (same size or not), removed and
    added, the clock moved past the TTL after each change, the store restarted now and
    then: every read equals the source's current bytes; the bound always holds."""
    rng = random.Random(f"workload-{policy}")
    root = tmp_path / "src"
    files = make_dataset(root, n=30, lo=200, hi=3000)
    clock = ManualClock()
    max_bytes = 15_000

    def open_store() -> CacheStore:
        return new_store(
            str(root), tmp_path, max_bytes, policy=policy, clock=clock, metadata_ttl_s=10.0
        )

    store = open_store()
    hits = 0
    try:
        for step in range(1000):
            op = rng.random()
            if op < 0.04:  # rewrite a file
                path = rng.choice(sorted(files))
                size = len(files[path]) if rng.random() < 0.5 else rng.randint(1, 4000)
                files[path] = rng.randbytes(size)
                (root / path).write_bytes(files[path])
                os.utime(root / path, (clock.now + step, clock.now + step))
                clock.now += 11
            elif op < 0.05:  # remove one, add one
                gone = rng.choice(sorted(files))
                (root / gone).unlink()
                del files[gone]
                new = f"train/new-{step}.bin"
                files[new] = rng.randbytes(rng.randint(1, 3000))
                (root / new).write_bytes(files[new])
                clock.now += 11
                with pytest.raises(FileNotFoundError):
                    store.read(gone, 0, 10)
            elif op < 0.06:  # restart over the warm cache
                hits += store.stats().hits
                store.close()
                store = open_store()
            else:
                path = rng.choice(sorted(files))
                data = files[path]
                offset = 0 if rng.random() < 0.6 else rng.randrange(len(data) + 1)
                size = rng.choice([1, 100, 4096, 1 << 20])
                assert store.read(path, offset, size) == data[offset : offset + size], step
            assert store.used_bytes <= max_bytes
        assert hits + store.stats().hits > 0
    finally:
        store.close()


def test_a_restart_keeps_the_warm_cache_and_hits_without_fetching(src, tmp_path, monkeypatch):
    root, files = src
    with new_store(str(root), tmp_path, durable=True) as store:
        for path, data in files.items():
            assert store.read(path, 0, 1 << 20) == data
        before = store.stats()
    assert read_stats(tmp_path / "cache" / "stats.json").cached_files == len(files)
    source = open_source(str(root))
    fetched = []
    real_fetch = source.fetch_to

    def counting_fetch(path, dest, entry):
        fetched.append(path)
        return real_fetch(path, dest, entry)

    monkeypatch.setattr(source, "fetch_to", counting_fetch)
    with new_store(source, tmp_path) as store:
        after = store.stats()
        assert (after.cached_files, after.used_bytes) == (before.cached_files, before.used_bytes)
        assert (after.hits, after.misses) == (0, 0)
        for path, data in files.items():
            assert store.read(path, 0, 1 << 20) == data
        assert fetched == []
        assert store.stats().hits == len(files)


def test_a_restart_drops_partial_fills_and_copies_without_a_valid_record(src, tmp_path):
    root, files = src
    with new_store(str(root), tmp_path) as store:
        for path in files:
            store.read(path, 0, 1)
    objects = tmp_path / "cache" / "objects"
    records = sorted(objects.rglob("*.meta"))
    datas = sorted(f for f in objects.rglob("*") if f.is_file() and f.suffix != ".meta")
    assert len(records) == len(datas) == len(files)
    # a crash mid-fill: a partial file in tmp/
    (tmp_path / "cache" / "tmp" / "deadbeef-0123").write_bytes(b"partial")
    # a crash between data and record: data without its record
    records[0].unlink()
    # a record whose data is short (a torn copy)
    torn = records[1].with_suffix("")
    torn.write_bytes(torn.read_bytes()[:10])
    # a record that is not one
    records[2].write_bytes(b"{not json")
    # a stray file
    (objects / "zz").mkdir(exist_ok=True)
    (objects / "zz" / "stray").write_bytes(b"x")
    with new_store(str(root), tmp_path) as store:
        assert store.stats().cached_files == len(files) - 3
        assert list((tmp_path / "cache" / "tmp").iterdir()) == []
        assert not (objects / "zz" / "stray").exists()
        left = sorted(f for f in objects.rglob("*") if f.is_file() and f.suffix != ".meta")
        assert len(left) == len(files) - 3
        for path, data in files.items():
            assert store.read(path, 0, 1 << 20) == data
        assert store.stats().misses == 3


def test_a_cache_dir_of_another_source_is_wiped(src, tmp_path):
    root, files = src
    other = tmp_path / "other"
    other_files = make_dataset(other, seed=9)
    with new_store(str(root), tmp_path) as store:
        store.read("train/0000.bin", 0, 10)
    with new_store(str(other), tmp_path) as store:
        assert store.stats().cached_files == 0
        assert store.read("train/0000.bin", 0, 1 << 20) == other_files["train/0000.bin"]
        assert other_files["train/0000.bin"] != files["train/0000.bin"]


def test_a_changed_source_file_is_dropped_and_fetched_again(src, tmp_path):
    root, files = src
    clock = ManualClock()
    path = root / "train" / "0002.bin"
    with new_store(str(root), tmp_path, metadata_ttl_s=30.0, clock=clock) as store:
        assert store.read("train/0002.bin", 0, 1 << 20) == files["train/0002.bin"]
        old_version = store.stat("train/0002.bin").version
        # same size, new content and mtime
        new = bytes(reversed(files["train/0002.bin"]))
        path.write_bytes(new)
        os.utime(path, (1_700_000_000, 1_700_000_000))
        # within the TTL the listing is trusted: the cached copy is served
        assert store.read("train/0002.bin", 0, 1 << 20) == files["train/0002.bin"]
        clock.now += 31
        assert store.read("train/0002.bin", 0, 1 << 20) == new
        assert store.stat("train/0002.bin").version != old_version
        # a new size
        bigger = new + b"more"
        path.write_bytes(bigger)
        clock.now += 31
        assert store.read("train/0002.bin", 0, 1 << 20) == bigger
        stats = store.stats()
        assert stats.cached_files == 1
        assert stats.used_bytes == len(bigger)
        # and gone
        path.unlink()
        clock.now += 31
        with pytest.raises(FileNotFoundError):
            store.read("train/0002.bin", 0, 10)
        assert store.stats().cached_files == 0


def test_a_source_that_stops_answering_fails_misses_not_hits(src, tmp_path, monkeypatch):
    root, files = src
    clock = ManualClock()
    source = open_source(str(root), clock=clock, metadata_ttl_s=10.0)
    with new_store(source, tmp_path, clock=clock, metadata_ttl_s=10.0) as store:
        assert store.read("index.json", 0, 100) == files["index.json"]

        def down(*args, **kw):
            raise ConnectionError("the storage network is down")

        monkeypatch.setattr(source.fs, "ls", down)
        monkeypatch.setattr(source.fs, "info", down)
        monkeypatch.setattr(source, "fetch_to", down)
        monkeypatch.setattr(source, "read", down)
        clock.now += 11  # the copy's version is due for a check
        assert store.read("index.json", 0, 100) == files["index.json"]
        stats = store.stats()
        assert stats.hits == 1
        assert stats.warnings == 1
        assert "serving the cached copy unchecked" in stats.last_warning
        with pytest.raises(ConnectionError):
            store.read("train/0000.bin", 0, 100)


def test_a_changed_etag_is_a_changed_file(tmp_path, monkeypatch):
    """An object store's ETag changes with the content even when size and mtime do not."""
    fs = fsspec.filesystem("memory")
    base = f"/mgcache-etag-{os.getpid()}-{id(tmp_path)}"
    fs.pipe(f"{base}/obj", b"A" * 100)
    source = open_source(f"memory://{base}", metadata_ttl_s=0.0)
    etags = itertools.count()
    current = {"etag": "v0"}
    real_info, real_ls = source.fs.info, source.fs.ls

    def with_etag(info: dict[str, Any]) -> dict[str, Any]:
        return {**info, "ETag": current["etag"], "created": 5.0}

    monkeypatch.setattr(source.fs, "info", lambda path, **kw: with_etag(real_info(path, **kw)))
    monkeypatch.setattr(
        source.fs, "ls", lambda path, detail=True, **kw: [with_etag(i) for i in real_ls(path)]
    )
    try:
        with new_store(source, tmp_path, metadata_ttl_s=0.0) as store:
            assert store.read("obj", 0, 200) == b"A" * 100
            assert store.stat("obj").etag == "v0"
            fs.pipe(f"{base}/obj", b"B" * 100)
            current["etag"] = f"v{next(etags) + 1}"
            assert store.read("obj", 0, 200) == b"B" * 100
            assert store.stats().misses == 2
    finally:
        fs.rm(base, recursive=True)


def test_a_file_larger_than_the_cache_is_read_through_with_a_warning(src, tmp_path):
    root, files = src
    big = random.Random(4).randbytes(50_000)
    (root / "big.bin").write_bytes(big)
    with new_store(str(root), tmp_path, max_bytes=20_000) as store:
        assert store.read("big.bin", 0, 1 << 20) == big
        assert store.read("big.bin", 40_000, 100) == big[40_000:40_100]
        stats = store.stats()
        assert stats.cached_files == 0
        assert stats.used_bytes == 0
        assert stats.passthrough_reads == 1  # once per access
        assert stats.warnings == 1
        assert "more than the whole cache" in stats.last_warning
        assert stats.bytes_from_source == len(big)  # one fetch of the whole file, buffered
        assert store.read("train/0000.bin", 0, 1 << 20) == files["train/0000.bin"]
        assert store.stats().cached_files == 1


def test_below_the_free_space_floor_reads_go_through(src, tmp_path):
    root, files = src
    with new_store(str(root), tmp_path, min_free_bytes=1 << 62) as store:
        for path, data in files.items():
            assert store.read(path, 0, 1 << 20) == data
        stats = store.stats()
        assert stats.cached_files == 0
        assert stats.passthrough_reads == len(files) == stats.warnings
        assert "the floor is" in stats.last_warning


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_a_full_or_failing_cache_disk_degrades_to_reading_through(src, tmp_path, code, monkeypatch):
    root, files = src
    clock = ManualClock()
    source = open_source(str(root), clock=clock)
    real_fetch = source.fetch_to
    failing = {"on": True}

    def fetch(path, dest, entry):
        if failing["on"]:
            dest.write(b"partial")
            raise OSError(code, os.strerror(code))
        return real_fetch(path, dest, entry)

    monkeypatch.setattr(source, "fetch_to", fetch)
    with new_store(source, tmp_path, clock=clock) as store:
        for path, data in files.items():
            assert store.read(path, 0, 1 << 20) == data
        stats = store.stats()
        assert stats.cached_files == 0
        assert stats.passthrough_reads == len(files)
        assert stats.warnings == len(files)
        assert list((tmp_path / "cache" / "tmp").iterdir()) == []
        failing["on"] = False
        assert store.read("index.json", 0, 100) == files["index.json"]
        assert store.stats().cached_files == 0  # still backing off
        clock.now += store_module.TROUBLE_BACKOFF_S + 1
        assert store.read("index.json", 0, 100) == files["index.json"]
        assert store.stats().cached_files == 1


def test_a_hit_costs_no_source_round_trip_within_the_ttl(src, tmp_path):
    root, _ = src
    clock = ManualClock()
    with new_store(str(root), tmp_path, clock=clock, metadata_ttl_s=30.0) as store:
        store.read("train/0005.bin", 0, 10)
        trips = store.source.round_trips
        for _ in range(50):
            store.read("train/0005.bin", 0, 10)
            store.read("train/0005.bin", 100, 10)
        assert store.source.round_trips == trips
        clock.now += 31
        store.read("train/0005.bin", 0, 10)
        assert store.source.round_trips == trips + 1  # one re-listing of train/


def test_cached_path_fetch_and_open_file(src, tmp_path):
    root, files = src
    with new_store(str(root), tmp_path) as store:
        assert store.cached_path("index.json") is None
        local = store.fetch("index.json")
        assert local is not None
        assert local.read_bytes() == files["index.json"]
        assert store.cached_path("index.json") == local
        with store.open_file("train/0000.bin") as f:
            assert f.read() == files["train/0000.bin"]
        stats = store.stats()
        assert (stats.misses, stats.hits) == (2, 1)
        assert stats.bytes_from_cache == len(files["index.json"]) + len(files["train/0000.bin"])
    with new_store(str(root), tmp_path / "tiny", max_bytes=10) as store:
        assert store.fetch("train/0000.bin") is None
        with store.open_file("train/0000.bin") as f:
            assert f.read() == files["train/0000.bin"]


def test_sequential_readers_get_the_next_files_prefetched(tmp_path):
    root = tmp_path / "seq"
    files = make_dataset(root, n=100, lo=100, hi=200)
    names = sorted(p for p in files if p.startswith("train/"))
    with new_store(str(root), tmp_path, policy="pin", prefetch_depth=3) as store:
        # the pattern is read every 64 accesses (policy.CLASSIFY_EVERY)
        for path in names[:64]:
            assert store.read(path, 0, 1 << 20) == files[path]
        assert store.pattern.kind == "sequential"
        assert store.stats().pattern == "sequential"
        wait_for(lambda: store.stats().prefetched >= 3, "three prefetched files")
        assert store.stats().misses == 64
        for path in names[64:67]:
            assert store.cached_path(path, count=False) is not None
            assert store.read(path, 0, 1 << 20) == files[path]
        stats = store.stats()
        assert stats.misses == 64
        assert stats.hits == 3


def test_a_sequential_reader_past_a_full_cache_gets_its_next_files_read_ahead(
    tmp_path, monkeypatch
):
    """pin keeps what came first; the files it does not take are prefetched into the
    read-through windows, so the walker's next file is in memory when it gets there."""
    root = tmp_path / "seq"
    files = make_dataset(root, n=100, lo=100, hi=200)
    names = sorted(p for p in files if p.startswith("train/"))
    source = open_source(str(root))
    with new_store(source, tmp_path, max_bytes=1000, policy="pin", prefetch_depth=3) as store:
        for path in names[:64]:
            assert store.read(path, 0, 1 << 20) == files[path]
        assert store.pattern.kind == "sequential"
        wait_for(lambda: store.stats().prefetched >= 3, "three files read ahead")
        reads: list[str] = []
        real = source.read

        def counting_read(path, offset=0, size=-1):
            reads.append(path)
            return real(path, offset, size)

        monkeypatch.setattr(source, "read", counting_read)
        assert store.read(names[64], 0, 1 << 20) == files[names[64]]
        assert names[64] not in reads
        assert store.stats().cached_files < 10


def test_auto_reports_its_choice_and_reason(src, tmp_path):
    root, files = src
    rng = random.Random(8)
    with new_store(str(root), tmp_path, max_bytes=30_000) as store:
        assert store.stats().policy == "pin"
        assert "no pattern yet" in store.stats().policy_reason
        keys = sorted(files)
        for _ in range(8):
            rng.shuffle(keys)
            for path in keys:
                store.read(path, 0, 1 << 20)
        stats = store.stats()
        assert stats.pattern == "shuffled"
        assert stats.policy == "pin"
        assert stats.policy_reason.startswith("auto: shuffled -> pin")


def test_write_stats_is_atomic_and_decodes(src, tmp_path):
    root, _ = src
    clock = ManualClock()
    with new_store(str(root), tmp_path, clock=clock, dataset="imagenet", mountpoint="/mnt/x") as s:
        s.read("index.json", 0, 100)
        path = s.write_stats()
        assert path == tmp_path / "cache" / "stats.json"
        assert not path.with_name("stats.json.tmp").exists()
        record = msgspec.json.decode(path.read_bytes(), type=DatasetCache)
        assert record == s.stats()
        assert (record.dataset, record.mountpoint, record.ts) == ("imagenet", "/mnt/x", clock.now)
        assert record.source == str(root)
        assert record.pid == os.getpid()


def test_the_stats_writer_thread_rewrites_the_file(src, tmp_path):
    root, _ = src
    with new_store(str(root), tmp_path, stats_interval_s=0.05) as store:
        store.read("index.json", 0, 100)
        stats_file = tmp_path / "cache" / "stats.json"
        wait_for(lambda: stats_file.exists() and read_stats(stats_file).misses == 1, "stats")
    assert read_stats(stats_file).misses == 1


def test_bad_sources_are_refused_at_open(tmp_path):
    with pytest.raises(SourceError, match="no such directory"):
        open_source(str(tmp_path / "missing"))
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(SourceError, match="not a directory"):
        open_source(str(tmp_path / "file"))
    with pytest.raises(SourceError, match="no such directory"):
        open_source(f"memory://mgcache-missing-{os.getpid()}")
    with pytest.raises(SourceError, match="nosuchproto"):
        open_source("nosuchproto://x/y")
    with pytest.raises(SourceError, match="empty"):
        open_source("")
    with pytest.raises(SourceError, match="no such directory"):
        CacheStore(str(tmp_path / "missing"), tmp_path / "c", 100)
    with pytest.raises(ValueError, match="unknown cache policy"):
        CacheStore(str(tmp_path), tmp_path / "c", 100, policy="mru")


@given(st.text(alphabet="ab./", max_size=12))
def test_normalize_agrees_with_splitting_on_slashes(path):
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        with pytest.raises(ValueError, match="leaves the source"):
            normalize(path)
    else:
        assert normalize(path) == "/".join(parts)


def test_normalize_and_entries():
    assert normalize("/a//b/./c/") == "a/b/c"
    assert normalize("/") == ""
    with pytest.raises(ValueError, match="leaves the source"):
        normalize("a/../b")
    with pytest.raises(ValueError, match="NUL"):
        normalize("a\x00b")
    assert Entry("a", "a", False, 3, 1.5, "e").version == (3, 1.5, "e")


# -- checks off the read path: the background check, misses without a metadata round trip


def test_copies_are_checked_in_the_background_before_their_ttl_runs_out(src, tmp_path):
    root, files = src
    clock = ManualClock()
    with new_store(
        str(root), tmp_path, clock=clock, metadata_ttl_s=30.0, revalidate_ahead=False
    ) as store:
        for _ in range(2):  # misses, then hits (each hit earns the check one request)
            for path, data in files.items():
                assert store.read(path, 0, 1 << 20) == data
        assert store.revalidate() == 0  # 30 s of trust left: nothing due
        clock.now += 25  # within the last quarter of the TTL
        trips = store.source.round_trips
        assert store.revalidate() == len(files)
        assert store.source.round_trips == trips + 2  # one listing per directory
        clock.now += 10  # past the fill's TTL: no read pays a check
        trips = store.source.round_trips
        for path, data in files.items():
            assert store.read(path, 0, 1 << 20) == data
        assert store.source.round_trips == trips
        assert store.stats().hits == 2 * len(files)


def test_the_background_check_drops_changed_and_vanished_copies(src, tmp_path):
    root, files = src
    clock = ManualClock()
    with new_store(
        str(root), tmp_path, clock=clock, metadata_ttl_s=30.0, revalidate_ahead=False
    ) as store:
        for path in ("train/0002.bin", "train/0003.bin") * 2:  # misses, then hits
            assert store.read(path, 0, 1 << 20) == files[path]
        changed = root / "train/0002.bin"
        new = bytes(reversed(files["train/0002.bin"]))  # the same size, another mtime
        changed.write_bytes(new)
        os.utime(changed, (1_700_000_000, 1_700_000_000))
        (root / "train/0003.bin").unlink()
        clock.now += 25
        assert store.revalidate() == 2
        assert store.stats().cached_files == 0
        assert store.read("train/0002.bin", 0, 1 << 20) == new
        with pytest.raises(FileNotFoundError):
            store.read("train/0003.bin", 0, 10)


def test_the_background_check_spends_what_hits_earn(src, tmp_path):
    """Each hit earns one source request; misses earn nothing; an idle cache asks the
    source nothing."""
    root, files = src
    clock = ManualClock()
    with new_store(
        str(root), tmp_path, clock=clock, metadata_ttl_s=30.0, revalidate_ahead=False
    ) as store:
        store.read("train/0001.bin", 0, 10)  # a miss
        store.read("train/0002.bin", 0, 10)
        clock.now += 25
        assert store.revalidate() == 0  # no hit yet: no budget
        store.read("train/0001.bin", 0, 10)  # a hit: one request
        assert store.revalidate() == 1  # its directory's listing (confirms 0002 too)
        trips = store.source.round_trips
        for _ in range(3):
            clock.now += 25
            assert store.revalidate() == 0
        assert store.source.round_trips == trips
        clock.now += 10  # expired: the read checks inline, as without the thread
        assert store.read("train/0001.bin", 0, 1 << 20) == files["train/0001.bin"]
        assert store.source.round_trips == trips + 1


def test_the_background_thread_keeps_hits_free_of_checks(src, tmp_path):
    """With the thread (the default), copies read all the time seldom fall due in a read:
    over three TTLs, without it every file would be checked inline three times."""
    root, files = src
    with new_store(str(root), tmp_path, metadata_ttl_s=1.0) as store:
        for path, data in files.items():
            assert store.read(path, 0, 1 << 20) == data
        inline = 0
        real_stat = store.source.stat

        def counting_stat(path: str) -> Entry:
            nonlocal inline
            inline += 1
            return real_stat(path)

        store.source.stat = counting_stat  # type: ignore[method-assign]
        deadline = time_module.monotonic() + 3.0
        while time_module.monotonic() < deadline:
            for path, data in files.items():
                assert store.read(path, 0, 1 << 20) == data
            time_module.sleep(0.02)
        assert store._revalidator is not None
        assert store._revalidator.checked >= 2 * len(files)
        assert inline < len(files), inline  # most checks were the thread's


def test_a_miss_after_the_ttl_costs_no_metadata_round_trip(src, tmp_path):
    root, files = src
    clock = ManualClock()
    with new_store(
        str(root), tmp_path, clock=clock, metadata_ttl_s=30.0, revalidate_ahead=False
    ) as store:
        store.listdir("train")
        clock.now += 31  # the listing is stale
        trips = store.source.round_trips
        assert store.read("train/0003.bin", 0, 1 << 20) == files["train/0003.bin"]
        assert store.source.round_trips == trips  # the copy's fstat checked the version
        # a file changed since the listing: the fetch notices, asks again, reads it anew
        path = root / "train/0004.bin"
        new = files["train/0004.bin"] + b"longer"
        path.write_bytes(new)
        os.utime(path, (1_700_000_000, 1_700_000_000))
        assert store.read("train/0004.bin", 0, 1 << 20) == new
        assert store.source.round_trips == trips + 1  # one re-listing
        assert store.stats().used_bytes == len(files["train/0003.bin"]) + len(new)
        # and one removed since: not found, not served
        (root / "train/0005.bin").unlink()
        with pytest.raises(FileNotFoundError):
            store.read("train/0005.bin", 0, 10)


def test_evicted_copies_are_deleted_off_the_readers_thread(src, tmp_path, monkeypatch):
    """A miss that evicts leaves the unlinking to the janitor; a fill waits for it only
    when the bytes still on disk would not leave room (the bound holds on disk)."""
    root, files = src
    unlinked: list[str] = []
    gate = threading.Event()
    real_unlink = os.unlink

    def slow_unlink(path: Any, *a: Any, **kw: Any) -> None:
        if threading.current_thread().name.startswith("mgcache-unlink"):
            assert gate.wait(DEADLINE_S)
            unlinked.append(str(path))
        real_unlink(path, *a, **kw)

    monkeypatch.setattr(os, "unlink", slow_unlink)  # the janitor's os: the module itself
    names = sorted(p for p in files if p.startswith("train/"))
    sizes = [len(files[p]) for p in names]
    max_bytes = sum(sizes[:3])
    with new_store(str(root), tmp_path, max_bytes=max_bytes, policy="lru") as store:
        for path in names[:3]:
            assert store.read(path, 0, 1 << 20) == files[path]
        done = threading.Event()

        def reader() -> None:
            assert store.read(names[3], 0, 1 << 20) == files[names[3]]
            done.set()

        thread = threading.Thread(target=reader)
        thread.start()
        # the fill of names[3] evicted names[0] but may not write until it is deleted
        wait_for(lambda: store.stats().evictions >= 1, "an eviction")
        assert data_bytes(tmp_path / "cache") <= max_bytes
        assert not done.wait(0.2)
        gate.set()
        thread.join(DEADLINE_S)
        assert done.is_set()
        assert unlinked  # the janitor deleted it
        assert data_bytes(tmp_path / "cache") <= max_bytes
