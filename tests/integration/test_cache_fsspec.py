"""The ``mgcache::`` fsspec path over a running cache mount: hits are plain reads of the
cached copies (no FUSE hop), counted by the mount; misses are filled by the mount; with
no mount, reads go to the source.  Skipped, with the reason, where FUSE is unavailable."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest

from metalguard.agent.cache.fsspec_fs import MGCacheFileSystem
from tests.support.harness.cache_env import (
    CacheMount,
    force_unmount,
    fuse_skip_reason,
    make_dataset,
    mount_args,
    wait_until,
)

_SKIP = fuse_skip_reason()
pytestmark = [
    pytest.mark.skipif(_SKIP is not None, reason=_SKIP or ""),
    pytest.mark.xdist_group("fuse"),
]

MIB = 1024 * 1024


@pytest.fixture
def mounted(tmp_path: Path) -> Iterator[tuple[CacheMount, Path, dict[str, bytes]]]:
    src, mnt = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    mnt.mkdir()
    files = make_dataset(src, 12, 1000, 200_000, seed=21, subdirs=2)
    m = CacheMount(mount_args(src, mnt, tmp_path / "cache", 64 * MIB))
    try:
        m.wait_ready()
        yield m, src, files
    finally:
        m.close()
        force_unmount(mnt)


def test_chained_url_reads_cached_copies_and_the_mount_counts_them(
    mounted: tuple[CacheMount, Path, dict[str, bytes]],
) -> None:
    m, src, files = mounted
    options = {"mgcache": {"mountpoint": str(m.mountpoint)}}
    for rel, want in files.items():  # misses: the mount fills, the read is local
        with fsspec.open(f"mgcache::{src}/{rel}", "rb", **options) as f:
            assert f.read() == want
    fs = fsspec.filesystem("mgcache", mountpoint=str(m.mountpoint))
    assert isinstance(fs, MGCacheFileSystem)
    for rel, want in files.items():
        assert fs.cat_file(rel) == want  # a hit the mount answers (and counts)
        assert fs.cat_file(rel) == want  # a hit with no round trip, reported over the socket
        local = fs.cached_path(rel)
        assert local is not None
        assert not local.startswith(str(m.mountpoint))
        assert Path(local).read_bytes() == want
    # each hit counted once: by the mount, or (a report dropped by a full datagram queue on
    # a busy host: best effort by design) by the file system as unreported
    wait_until(
        lambda: m.stats().hits + fs.unreported_hits == 3 * len(files),
        10,
        f"every hit counted: {m.stats()}, unreported {fs.unreported_hits}",
    )
    assert m.stats().hits >= 2 * len(files)  # the hits the mount answered itself
    s = m.stats()
    assert (s.misses, s.bytes_from_source) == (len(files), sum(map(len, files.values()))), s
    assert sorted(fs.ls("", detail=False)) == ["d0", "d1"]
    assert fs.info("d0/f0000.bin")["size"] == len(files["d0/f0000.bin"])
    assert fs.info("d1")["type"] == "directory"
    with pytest.raises(FileNotFoundError):
        fs.cat_file("d0/nope.bin")
    with pytest.raises(PermissionError):
        fs.open("d0/f0000.bin", "wb")
    assert m.stop() == 0


def test_an_evicted_copy_is_asked_for_again(
    mounted: tuple[CacheMount, Path, dict[str, bytes]],
) -> None:
    m, _src, files = mounted
    fs = MGCacheFileSystem(mountpoint=str(m.mountpoint), skip_instance_cache=True)
    rel = "d0/f0000.bin"
    local = fs.cached_path(rel)
    assert local is not None
    os.unlink(local)  # what an eviction does to the copy the client knows
    assert fs.cat_file(rel) == files[rel]
    assert m.stop() == 0


def test_without_a_mount_reads_go_to_the_source(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(b"abc")
    (tmp_path / "mnt").mkdir()
    with fsspec.open(
        f"mgcache::{src}/a.bin", "rb", mgcache={"mountpoint": str(tmp_path / "mnt")}
    ) as f:
        assert f.read() == b"abc"
    strict = MGCacheFileSystem(
        target_protocol="file",
        mountpoint=str(tmp_path / "mnt"),
        fallback=False,
        skip_instance_cache=True,
    )
    with pytest.raises(FileNotFoundError, match="no running cache mount"):
        strict.cat_file(str(src / "a.bin"))
