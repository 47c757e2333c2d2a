"""Read-through windows (agent/cache/readthrough.py) over a local-directory source: one
source request per file (or per window of a large file), byte-for-byte equal chunks, a
changed file never answered from an old window, memory bounded."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest

from metalguard.agent.cache.readthrough import ReadThrough
from metalguard.agent.cache.source import Source, open_source

DEADLINE_S = 10.0


@pytest.fixture
def counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Source, list[tuple[str, int, int]], Path]:
    """A source over tmp_path/src whose reads are recorded as (path, offset, size)."""
    root = tmp_path / "src"
    root.mkdir()
    source = open_source(str(root), metadata_ttl_s=0.0)
    reads: list[tuple[str, int, int]] = []
    real = source.read

    def read(path: str, offset: int = 0, size: int = -1) -> bytes:
        reads.append((path, offset, size))
        return real(path, offset, size)

    monkeypatch.setattr(source, "read", read)
    return source, reads, root


def chunks(rt: ReadThrough, source: Source, path: str, chunk: int) -> bytes:
    entry = source.stat(path)
    out = b""
    for off in range(0, entry.size, chunk):
        data, _ = rt.read(entry, off, chunk)
        out += data
    return out


def test_a_small_file_costs_one_request_for_all_its_chunks(counted):
    source, reads, root = counted
    data = random.Random(1).randbytes(100_000)
    (root / "f").write_bytes(data)
    rt = ReadThrough(source, max_bytes=1 << 20, whole_bytes=200_000, window_bytes=50_000)
    assert chunks(rt, source, "f", 4096) == data
    assert reads == [("f", 0, 100_000)]
    assert chunks(rt, source, "f", 7000) == data
    assert len(reads) == 1
    entry = source.stat("f")
    assert rt.read(entry, 100_000, 10) == (b"", 0)
    assert rt.read(entry, 99_990, -1) == (data[99_990:], 0)


def test_a_large_file_is_read_in_windows(counted):
    source, reads, root = counted
    data = random.Random(2).randbytes(230_000)
    (root / "big").write_bytes(data)
    rt = ReadThrough(source, max_bytes=1 << 20, whole_bytes=100_000, window_bytes=50_000)
    assert chunks(rt, source, "big", 10_000) == data
    assert [r[1:] for r in reads] == [
        (o, min(50_000, 230_000 - o)) for o in range(0, 230_000, 50_000)
    ]
    entry = source.stat("big")
    got, fetched = rt.read(entry, 3, 60_000)  # more than a window: straight through
    assert got == data[3:60_003]
    assert fetched == 60_000


def test_a_changed_file_is_never_answered_from_an_old_window(counted):
    source, reads, root = counted
    (root / "f").write_bytes(b"a" * 1000)
    rt = ReadThrough(source, max_bytes=1 << 20)
    assert rt.read(source.stat("f"), 0, 100)[0] == b"a" * 100
    (root / "f").write_bytes(b"b" * 1200)
    assert rt.read(source.stat("f"), 0, 100)[0] == b"b" * 100
    assert rt.read(source.stat("f"), 1100, 200)[0] == b"b" * 100
    assert len(reads) == 2


def test_memory_stays_within_max_bytes(counted):
    source, _reads, root = counted
    rng = random.Random(3)
    files = {f"f{i}": rng.randbytes(30_000) for i in range(20)}
    for name, data in files.items():
        (root / name).write_bytes(data)
    rt = ReadThrough(source, max_bytes=100_000)
    for _ in range(3):
        for name, data in files.items():
            assert chunks(rt, source, name, 8192) == data
            assert rt.buffered_bytes <= 100_000
    rt.forget("f19")
    assert rt.buffered_bytes <= 90_000


def test_concurrent_readers_share_one_window_fetch(counted, monkeypatch):
    source, _reads, root = counted
    data = random.Random(4).randbytes(64_000)
    (root / "f").write_bytes(data)
    gate = threading.Event()
    real = source.read

    def held(path, offset=0, size=-1):
        assert gate.wait(DEADLINE_S)
        return real(path, offset, size)

    monkeypatch.setattr(source, "read", held)
    entry = source.stat("f")
    rt = ReadThrough(source, max_bytes=1 << 20)
    results: dict[int, bytes] = {}
    fetched: list[int] = []

    def reader(off: int) -> None:
        got, n = rt.read(entry, off, 4096)
        results[off] = got
        fetched.append(n)

    threads = [threading.Thread(target=reader, args=(o,)) for o in range(0, 64_000, 4096)]
    for t in threads:
        t.start()
    gate.set()
    for t in threads:
        t.join(DEADLINE_S)
    assert results == {o: data[o : o + 4096] for o in range(0, 64_000, 4096)}
    assert sorted(fetched)[-1] == 64_000
    assert sum(fetched) == 64_000  # one fetch; every other reader waited for it


def test_a_failed_fetch_is_retried_by_the_next_read(counted, monkeypatch):
    source, _reads, root = counted
    (root / "f").write_bytes(b"x" * 500)
    real = source.read
    fail = {"on": True}

    def flaky(path, offset=0, size=-1):
        if fail["on"]:
            raise ConnectionError("source down")
        return real(path, offset, size)

    monkeypatch.setattr(source, "read", flaky)
    rt = ReadThrough(source)
    entry = source.stat("f")
    with pytest.raises(ConnectionError):
        rt.read(entry, 0, 100)
    assert rt.buffered_bytes == 0
    fail["on"] = False
    assert rt.read(entry, 0, 100) == (b"x" * 100, 500)


def test_an_adopted_file_serves_the_reads_that_follow(counted):
    """A file the store fetched whole itself (a versioned GET) becomes its window; only a
    read naming that version is answered from it, and the memory bound holds."""
    source, reads, root = counted
    data = random.Random(7).randbytes(30_000)
    (root / "f").write_bytes(data)
    rt = ReadThrough(source, max_bytes=50_000, whole_bytes=40_000, window_bytes=10_000)
    entry = source.stat("f")
    rt.adopt(entry, data)
    assert chunks(rt, source, "f", 4096) == data
    assert reads == []
    assert rt.buffered_bytes == 30_000
    rt.adopt(entry, data[:-1])  # not the whole file: not kept
    rt.adopt(source.stat("f"), data)
    assert rt.buffered_bytes == 30_000
    (root / "g").write_bytes(data)
    rt.adopt(source.stat("g"), data)  # past max_bytes: the older window goes
    assert rt.buffered_bytes == 30_000
    assert chunks(rt, source, "g", 4096) == data
    assert reads == []
