"""The dataset cache's store over a real http:// source: a threaded HTTP server on
loopback serving a directory (index pages, HEAD with Content-Length, Last-Modified and an
ETag, Range requests), read through fsspec's HTTPFileSystem; every byte is compared."""

from __future__ import annotations

import email.utils
import hashlib
import http.server
import os
import random
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from metalguard.agent.cache import source as source_module
from metalguard.agent.cache.source import SourceError, open_source
from metalguard.agent.cache.store import CacheStore
from tests.support.clock import ManualClock

DEADLINE_S = 30.0


class Handler(http.server.SimpleHTTPRequestHandler):
    """Files with an ETag (of size and mtime) and single-range GETs; counts requests
    (by method, and file GETs by path under ``"GET " + path``)."""

    counts: dict[str, int]

    def log_message(self, format: str, *args: object) -> None:
        pass

    def send_head(self):
        path = self.translate_path(self.path)
        self.counts[self.command] = self.counts.get(self.command, 0) + 1
        if os.path.isdir(path):
            return super().send_head()
        try:
            f = open(path, "rb")  # noqa: SIM115 - copyfile closes it (the base class's contract)
        except OSError:
            self.send_error(404)
            return None
        st = os.fstat(f.fileno())
        if self.command == "GET":
            key = "GET " + self.path
            self.counts[key] = self.counts.get(key, 0) + 1
        etag = '"' + hashlib.md5(f"{st.st_size}-{st.st_mtime_ns}".encode()).hexdigest() + '"'
        start, end = 0, st.st_size
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if m:
            start = int(m.group(1))
            end = min(int(m.group(2)) + 1, st.st_size) if m.group(2) else st.st_size
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{st.st_size}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(max(end - start, 0)))
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Last-Modified", email.utils.formatdate(st.st_mtime, usegmt=True))
        self.send_header("ETag", etag)
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        f.seek(start)
        self._remaining = max(end - start, 0)
        return f

    def copyfile(self, source, outputfile):
        remaining = getattr(self, "_remaining", None)
        if remaining is None:
            return super().copyfile(source, outputfile)
        while remaining > 0:
            chunk = source.read(min(remaining, 1 << 16))
            if not chunk:
                break
            outputfile.write(chunk)
            remaining -= len(chunk)
        return None


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, Path, dict[str, int]]]:
    """(base URL of ``tmp_path/www/ds/``, that directory, request counts by method)."""
    root = tmp_path / "www"
    (root / "ds").mkdir(parents=True)
    counts: dict[str, int] = {}
    handler = type("H", (Handler,), {"counts": counts})
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), lambda *a: handler(*a, directory=str(root))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/ds/", root / "ds", counts
    finally:
        server.shutdown()
        server.server_close()
        thread.join(DEADLINE_S)


def make_files(root: Path, n: int, seed: int = 0) -> dict[str, bytes]:
    rng = random.Random(seed)
    files = {}
    (root / "train").mkdir()
    for i in range(n):
        rel = f"train/{i:03d}.bin"
        files[rel] = rng.randbytes(rng.randint(2000, 9000))
        (root / rel).write_bytes(files[rel])
    files["index file.json"] = b'{"spaces": "in the name"}'
    (root / "index file.json").write_bytes(files["index file.json"])
    return files


def test_an_http_source_lists_stats_and_reads_byte_for_byte(served, tmp_path):
    url, root, _counts = served
    files = make_files(root, 30)
    with CacheStore(url, tmp_path / "cache", 60_000, "lru", min_free_bytes=0) as store:
        assert [e.name for e in store.listdir("")] == ["index file.json", "train"]
        assert store.stat("train").is_dir
        entries = store.listdir("train")
        assert {e.path: e.size for e in entries} == {
            p: len(d) for p, d in files.items() if p.startswith("train/")
        }
        entry = store.stat("train/003.bin")
        assert entry.etag.startswith('"')
        assert entry.mtime == pytest.approx((root / "train/003.bin").stat().st_mtime, abs=1)
        rng = random.Random(1)
        for _ in range(3):
            for path in rng.sample(sorted(files), len(files)):
                data = files[path]
                assert store.read(path, 0, 1 << 20) == data
                off = rng.randrange(len(data))
                assert store.read(path, off, 777) == data[off : off + 777]
                assert store.used_bytes <= 60_000
        stats = store.stats()
        assert stats.evictions > 0
        assert stats.hits > 0
        with pytest.raises(FileNotFoundError):
            store.stat("train/nope.bin")
        with pytest.raises(FileNotFoundError):
            store.read("nope.bin", 0, 10)


def test_a_hit_makes_no_request_and_concurrent_misses_make_one(served, tmp_path):
    url, root, counts = served
    files = make_files(root, 4)
    with CacheStore(url, tmp_path / "cache", 1 << 20, min_free_bytes=0) as store:
        results: list[bytes] = []
        threads = [
            threading.Thread(target=lambda: results.append(store.read("train/001.bin", 0, 1 << 20)))
            for _ in range(8)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(DEADLINE_S)
        assert results == [files["train/001.bin"]] * 8
        assert counts["GET /ds/train/001.bin"] == 1
        before = dict(counts)
        for _ in range(20):
            assert store.read("train/001.bin", 0, 1 << 20) == files["train/001.bin"]
            assert store.read("train/001.bin", 100, 100) == files["train/001.bin"][100:200]
        assert counts == before


def test_a_changed_http_file_is_fetched_again(served, tmp_path):
    url, root, _counts = served
    files = make_files(root, 3)
    with CacheStore(
        url, tmp_path / "cache", 1 << 20, metadata_ttl_s=0.0, min_free_bytes=0
    ) as store:
        assert store.read("train/000.bin", 0, 1 << 20) == files["train/000.bin"]
        new = bytes(reversed(files["train/000.bin"]))  # same size: the ETag tells
        (root / "train/000.bin").write_bytes(new)
        st = (root / "train/000.bin").stat()
        os.utime(root / "train/000.bin", ns=(st.st_atime_ns, st.st_mtime_ns + 1000))
        assert store.read("train/000.bin", 0, 1 << 20) == new
        longer = new + b"tail"
        (root / "train/000.bin").write_bytes(longer)
        assert store.read("train/000.bin", 0, 1 << 20) == longer
        assert store.stats().cached_files == 1


def test_a_restart_over_http_keeps_the_warm_cache(served, tmp_path):
    url, root, counts = served
    files = make_files(root, 10)
    with CacheStore(url, tmp_path / "cache", 1 << 20, min_free_bytes=0) as store:
        for path, data in files.items():
            assert store.read(path, 0, 1 << 20) == data
    file_gets = {k: v for k, v in counts.items() if k.startswith("GET /")}
    assert len(file_gets) == len(files)
    with CacheStore(url, tmp_path / "cache", 1 << 20, min_free_bytes=0) as store:
        assert store.stats().cached_files == len(files)
        for path, data in files.items():
            assert store.read(path, 0, 1 << 20) == data
        assert store.stats().misses == 0
    # the files were checked (HEAD, listings), not fetched again
    assert {k: v for k, v in counts.items() if k.startswith("GET /")} == file_gets


def test_large_files_are_fetched_in_ranges_and_oversize_ones_read_through(
    served, tmp_path, monkeypatch
):
    url, root, _counts = served
    monkeypatch.setattr(source_module, "WHOLE_GET_BYTES", 10_000)
    monkeypatch.setattr(source_module, "CHUNK_BYTES", 4096)
    rng = random.Random(5)
    big = rng.randbytes(50_000)
    huge = rng.randbytes(300_000)
    (root / "big.bin").write_bytes(big)
    (root / "huge.bin").write_bytes(huge)
    with CacheStore(url, tmp_path / "cache", 200_000, min_free_bytes=0) as store:
        assert store.read("big.bin", 0, 1 << 20) == big
        assert store.stats().cached_files == 1
        assert store.read("huge.bin", 0, 100_000) == huge[:100_000]
        assert store.read("huge.bin", 250_000, 100_000) == huge[250_000:]
        stats = store.stats()
        assert stats.passthrough_reads == 1
        assert "more than the whole cache" in stats.last_warning


def test_a_missing_http_source_is_refused(served):
    url, _, _ = served
    with pytest.raises(SourceError, match="no such directory"):
        open_source(url + "missing/")


def _delta(counts: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in counts.items() if v != before.get(k, 0)}


def _bump(path: Path, data: bytes) -> None:
    """Rewrite ``path`` with ``data`` and move its mtime on (its ETag changes with it)."""
    st = path.stat()
    path.write_bytes(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))


def test_a_miss_after_the_ttl_is_one_get_whose_version_is_the_heads(served, tmp_path):
    url, root, counts = served
    files = make_files(root, 6)
    clock = ManualClock()
    with CacheStore(
        url, tmp_path / "cache", 1 << 20, metadata_ttl_s=30.0, min_free_bytes=0, clock=clock,
        revalidate_ahead=False,
    ) as store:  # fmt: skip
        store.listdir("train")
        clock.now += 31  # every entry is stale
        before = dict(counts)
        assert store.read("train/001.bin", 0, 1 << 20) == files["train/001.bin"]
        assert _delta(counts, before) == {"GET": 1, "GET /ds/train/001.bin": 1}
        seen = store.stat("train/001.bin")  # the GET's, remembered: no request
        assert _delta(counts, before) == {"GET": 1, "GET /ds/train/001.bin": 1}
        assert store.source.check(["train/001.bin"]) == {"train/001.bin": seen}  # a HEAD
        info = store.source.fs.info(store.source.full_path("train/001.bin"))  # fsspec's
        assert store.source._entry("train/001.bin", info).version == seen.version
        # a file changed since its entry was seen: the GET tells, the miss asks again
        _bump(root / "train/002.bin", files["train/002.bin"] + b"more")
        assert store.read("train/002.bin", 0, 1 << 20) == files["train/002.bin"] + b"more"
        assert store.stats().cached_files == 2


def test_a_read_through_after_the_ttl_is_one_get_of_the_current_version(served, tmp_path):
    url, root, counts = served
    files = make_files(root, 6)
    clock = ManualClock()
    with CacheStore(
        url,
        tmp_path / "cache",
        10,
        metadata_ttl_s=30.0,
        min_free_bytes=0,
        clock=clock,
        revalidate_ahead=False,
    ) as store:  # fmt: skip  (every file is larger than the cache: read through)
        store.listdir("train")
        clock.now += 31
        before = dict(counts)
        data = files["train/003.bin"]
        assert store.read("train/003.bin", 0, 1000) == data[:1000]
        assert store.read("train/003.bin", 1000, 1 << 20) == data[1000:]
        assert _delta(counts, before) == {"GET": 1, "GET /ds/train/003.bin": 1}
        longer = data + b"and a tail"
        _bump(root / "train/003.bin", longer)
        clock.now += 31
        assert store.read("train/003.bin", 0, 1 << 20) == longer
        assert store.stats().cached_files == 0


def test_the_background_check_over_http_sends_heads_and_drops_a_changed_copy(served, tmp_path):
    url, root, counts = served
    files = make_files(root, 3)
    clock = ManualClock()
    with CacheStore(
        url, tmp_path / "cache", 1 << 20, metadata_ttl_s=30.0, min_free_bytes=0, clock=clock,
        revalidate_ahead=False,
    ) as store:  # fmt: skip
        names = sorted(p for p in files if p.startswith("train/"))
        for path in names * 2:  # misses, then hits (which earn the background check)
            assert store.read(path, 0, 1 << 20) == files[path]
        new = bytes(reversed(files[names[0]]))  # the same size: the ETag tells
        _bump(root / names[0], new)
        clock.now += 25
        before = dict(counts)
        assert store.revalidate() == len(names)
        assert _delta(counts, before) == {"HEAD": len(names)}
        assert store.stats().cached_files == len(names) - 1
        clock.now += 10  # past the fills' TTL: the others are hits without a request
        before = dict(counts)
        for path in names[1:]:
            assert store.read(path, 0, 1 << 20) == files[path]
        assert _delta(counts, before) == {}
        assert store.read(names[0], 0, 1 << 20) == new


def test_a_sequential_reader_behind_its_prefetch_fetches_each_file_once(served, tmp_path):
    """Past the TTL, a read-through and the prefetch of the same file share one GET."""
    url, root, counts = served
    files = make_files(root, 120)
    names = sorted(p for p in files if p.startswith("train/"))
    clock = ManualClock()
    with CacheStore(
        url,
        tmp_path / "cache",
        10,
        "pin",
        metadata_ttl_s=30.0,
        min_free_bytes=0,
        clock=clock,
        revalidate_ahead=False,
        prefetch_depth=4,
    ) as store:  # fmt: skip  (nothing fits: every file is read through)
        store.listdir("train")
        clock.now += 31  # every entry stale: each read-through is a versioned GET
        for path in names:
            assert store.read(path, 0, 1 << 20) == files[path]
        assert store.pattern.kind == "sequential"
        assert store.stats().prefetched > 0
        gets = {k: v for k, v in counts.items() if k.startswith("GET /ds/train/")}
        assert max(gets.values()) == 1, {k: v for k, v in gets.items() if v > 1}
