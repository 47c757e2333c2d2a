"""The dataset cache's front ends without a mount: the CLI's options, ``cache stats``'s
output, the FUSE operations over a fake store (keep_cache, the stats file, xattrs, error
mapping), the mountpoint checks, the fsspec path's mount lookup and its source fallback.
The real mount: tests/integration/test_cache_fuse.py and test_cache_fsspec.py."""

from __future__ import annotations

import argparse
import errno
import os
import stat
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from metalguard.agent.cache.cli import parse_bytes
from metalguard.agent.cache.mountpoint import (
    MountpointError,
    State,
    check_mountpoint,
    is_within,
)
from metalguard.agent.cache.options import OptionsError, mount_options
from metalguard.agent.cache.show import human, main_stats, render
from metalguard.agent.cache.source import Entry
from metalguard.agent.cache.stats import write_stats
from metalguard.cli import build_parser
from metalguard.proto.telemetry import DatasetCache

try:
    import mfusepy

    from metalguard.agent.cache.fusefs import (
        MAX_READ,
        STATS_NAME,
        XATTR_INFO,
        XATTR_PATH,
        CacheFS,
        MountInfo,
        fuse_options,
    )
except (ImportError, OSError, AttributeError) as _e:  # no libfuse3 here
    mfusepy = None
    _NO_FUSE = f"mfusepy cannot load libfuse3: {_e}"
else:
    _NO_FUSE = ""

needs_libfuse = pytest.mark.skipif(mfusepy is None, reason=_NO_FUSE or "libfuse3 present")


# -- byte counts, options ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1048576", 1048576),
        ("512M", 512 * 2**20),
        ("512MiB", 512 * 2**20),
        ("50GiB", 50 * 2**30),
        ("2TB", 2 * 10**12),
        ("1.5K", 1536),
        (" 7 ", 7),
    ],
)
def test_parse_bytes(text: str, value: int) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "lots", "-1", "1.5", "5 XB", "0x10"])
def test_parse_bytes_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="byte"):
        parse_bytes(text)


def _mount_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["cache", "mount", *argv])


def test_mount_options_from_flags() -> None:
    opts = mount_options(
        _mount_args(
            "--source", "s3://b/ds", "--mountpoint", "/mnt/ds/", "--cache-dir", "/nvme/c",
            "--max-bytes", "2G", "--policy", "lru", "--metadata-ttl", "0",
        )
    )  # fmt: skip
    assert (opts.dataset, opts.source, opts.max_bytes, opts.policy) == (
        "ds",
        "s3://b/ds",
        2**31,
        "lru",
    )
    assert (opts.metadata_ttl_s, opts.min_free_bytes, opts.stats_interval_s) == (0.0, 2**30, 2.0)


def _config(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "agent.toml"
    path.write_text("[cache]\nstats_interval_s = 5.0\n" + body)
    return path


DATASET = """
[[cache.datasets]]
name = "imagenet"
source = "/data/imagenet"
cache_dir = "/nvme/imagenet"
max_bytes = 1000
mountpoint = "/mnt/imagenet"
policy = "pin"
metadata_ttl_s = 3.0
"""


def test_mount_options_from_the_config_under_the_flags(tmp_path: Path) -> None:
    config = _config(tmp_path, DATASET)
    opts = mount_options(_mount_args("--config", str(config), "--dataset", "imagenet"))
    assert (opts.dataset, opts.source, opts.cache_dir, opts.mountpoint) == (
        "imagenet",
        "/data/imagenet",
        "/nvme/imagenet",
        "/mnt/imagenet",
    )
    assert (opts.max_bytes, opts.policy, opts.metadata_ttl_s, opts.stats_interval_s) == (
        1000,
        "pin",
        3.0,
        5.0,
    )
    over = mount_options(
        _mount_args("--config", str(config), "--dataset", "imagenet", "--max-bytes", "5K")
    )
    assert over.max_bytes == 5120
    assert over.source == "/data/imagenet"


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--source", "/d"], "missing --mountpoint, --cache-dir, --max-bytes"),
        (["--config", "CONFIG"], "needs --dataset"),
        (["--config", "CONFIG", "--dataset", "nope"], "configured: imagenet"),
        (["--config", "CONFIG", "--dataset", "nomount"], "missing --mountpoint"),
        (["--config", "BAD", "--dataset", "x"], "BAD"),
        (
            ["--source", "/d", "--mountpoint", "/m", "--cache-dir", "/c", "--max-bytes", "0"],
            "at least 1",
        ),
        (
            [
                "--source",
                "/d",
                "--mountpoint",
                "/m/with space",
                "--cache-dir",
                "/c",
                "--max-bytes",
                "1",
            ],
            "dataset name",
        ),
    ],
)
def test_mount_options_refusals(tmp_path: Path, argv: list[str], problem: str) -> None:
    config = _config(
        tmp_path,
        DATASET + '[[cache.datasets]]\nname = "nomount"\nsource = "/d"\ncache_dir = "/c"\n'
        "max_bytes = 1\n",
    )
    bad = tmp_path / "BAD"
    bad.write_text("[cache\n")
    argv = [str(config) if a == "CONFIG" else str(bad) if a == "BAD" else a for a in argv]
    with pytest.raises(OptionsError, match=problem):
        mount_options(_mount_args(*argv))


def test_bad_byte_counts_are_argparse_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _mount_args("--max-bytes", "many")
    assert exit_info.value.code == 2
    assert "not a byte count" in capsys.readouterr().err


# -- cache stats ---------------------------------------------------------------------------------


def _figures(**changes: Any) -> DatasetCache:
    base = DatasetCache(
        dataset="imagenet",
        source="s3://b/imagenet",
        mountpoint="/mnt/imagenet",
        cache_dir="/nvme/imagenet",
        pid=os.getpid(),
        ts=1000.0,
        policy="pin",
        policy_reason="auto: shuffled",
        pattern="shuffled",
        max_bytes=4 * 2**30,
        used_bytes=2**30,
        cached_files=10,
        dataset_bytes=8 * 2**30,
        hits=30,
        misses=10,
        bytes_from_cache=3 * 2**30,
        bytes_from_source=2**30,
        evictions=2,
        passthrough_reads=1,
        warnings=1,
        last_warning="big.bin: too large",
    )
    return msgspec.structs.replace(base, **changes)


def test_render_shows_every_figure() -> None:
    text = render(_figures(), now=1002.5)
    assert text.splitlines()[0] == f"imagenet: running, pid {os.getpid()}, written 2.5 s ago"
    for piece in (
        "pin (auto: shuffled)",
        "1.0 GiB of 4.0 GiB (25.0%) in 10 files, dataset 8.0 GiB seen",
        "30 (75.0% of 40 file reads), misses 10",
        "3.0 GiB from cache, 1.0 GiB from source",
        "2 evictions, 0 prefetched, 1 reads passed through",
        "1 (last: big.bin: too large)",
    ):
        assert piece in text, piece
    gone = render(_figures(pid=0, hits=0, misses=0, pattern=""), now=1000.0)
    assert "not running" in gone
    assert "not enough reads yet" in gone


def test_human() -> None:
    assert [human(n) for n in (0, 1023, 1536, 5 * 2**40)] == ["0 B", "1023 B", "1.5 KiB", "5.0 TiB"]


def test_main_stats_of_a_cache_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_stats(tmp_path / "stats.json", _figures())
    assert main_stats(str(tmp_path), None, None, "json") == 0
    assert msgspec.json.decode(capsys.readouterr().out, type=DatasetCache) == _figures()
    assert main_stats(str(tmp_path / "none"), None, None, "text") == 1
    assert "not running" in capsys.readouterr().err


def test_main_stats_of_the_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cache_dir = tmp_path / "c"
    cache_dir.mkdir()
    write_stats(cache_dir / "stats.json", _figures())
    config = _config(
        tmp_path,
        f'[[cache.datasets]]\nname = "imagenet"\nsource = "/d"\ncache_dir = "{cache_dir}"\n'
        "max_bytes = 1\n",
    )
    assert main_stats(None, config, None, "json") == 0
    assert len(msgspec.json.decode(capsys.readouterr().out)) == 1
    assert main_stats(None, config, "other", "text") == 2
    assert "no [[cache.datasets]] named 'other'" in capsys.readouterr().err


# -- the FUSE operations over a fake store ------------------------------------------------------


class FakeStore:
    """stat/listdir/read/fetch/stats over a dict: path -> (bytes, mtime)."""

    def __init__(self, tmp_path: Path) -> None:
        self.files: dict[str, tuple[bytes, float]] = {
            "a.bin": (b"abc", 1.0),
            "d/b.bin": (b"x", 2.0),
        }
        self.cache_dir = tmp_path
        self.fail: Exception | None = None
        self.copies: dict[str, Path] = {}
        """Files with a cached copy (open_copy answers a descriptor of it)."""
        self.noted: list[tuple[str, int, bool]] = []

    def stat(self, path: str) -> Entry:
        if path in ("", "d"):
            return Entry(path=path, name=path, is_dir=True, mtime=5.0)
        if path not in self.files:
            raise FileNotFoundError(path)
        data, mtime = self.files[path]
        return Entry(
            path=path, name=path.rsplit("/", 1)[-1], is_dir=False, size=len(data), mtime=mtime
        )

    def listdir(self, path: str = "") -> list[Entry]:
        if path == "":
            return [self.stat("a.bin"), self.stat("d")]
        if path == "d":
            return [self.stat("d/b.bin")]
        raise FileNotFoundError(path)

    def read(self, path: str, offset: int, size: int) -> bytes:
        if self.fail is not None:
            raise self.fail
        return self.files[path][0][offset : offset + size]

    def fetch(self, path: str) -> Path | None:
        return None if path == "d/b.bin" else self.cache_dir / "objects" / "ab" / "copy"

    def stats(self) -> DatasetCache:
        return _figures(max_bytes=8192, used_bytes=4096, cached_files=1)

    def open_copy(self, path: str) -> tuple[int, int] | None:
        copy = self.copies.get(path)
        return None if copy is None else (os.open(copy, os.O_RDONLY), copy.stat().st_size)

    def note_read(self, path: str, nbytes: int, access: bool) -> None:
        self.noted.append((path, nbytes, access))


def _fi(flags: int = os.O_RDONLY) -> SimpleNamespace:
    return SimpleNamespace(flags=flags, fh=0, keep_cache=0, direct_io=0)


def _fs(tmp_path: Path) -> tuple[Any, FakeStore]:
    store = FakeStore(tmp_path)
    info = MountInfo(dataset="ds", source="/src", cache_dir=str(tmp_path), metadata_ttl_s=1.0)
    return CacheFS(store, info), store


def _errno(call: Any, *args: Any) -> int:
    with pytest.raises(OSError) as info:  # noqa: PT011 - the errno is the check
        call(*args)
    return int(info.value.errno or 0)


@needs_libfuse
def test_fuse_metadata(tmp_path: Path) -> None:
    fs, _ = _fs(tmp_path)
    root = fs.getattr("/")
    assert root["st_mode"] & 0o777 == 0o555
    assert root["st_nlink"] == 2
    a = fs.getattr("/a.bin")
    assert (a["st_size"], a["st_mode"] & 0o777, a["st_mtime"]) == (3, 0o444, 1_000_000_000)
    assert [name for name, _, _ in fs.readdir("/", 0)] == [".", "..", "a.bin", "d"]
    assert [name for name, _, _ in fs.readdir("/d", 0)] == [".", "..", "b.bin"]
    types = {name: attrs["st_mode"] for name, attrs, _ in fs.readdir("/", 0)}
    assert (types["d"], types["a.bin"]) == (stat.S_IFDIR, stat.S_IFREG)  # d_type
    assert _errno(fs.getattr, "/nope") == errno.ENOENT
    assert _errno(fs.getattr, "/../etc") == errno.ENOENT
    assert _errno(fs.readdir, "/nope", 0) == errno.ENOENT
    statfs = fs.statfs("/")
    assert (statfs["f_blocks"], statfs["f_bfree"], statfs["f_files"]) == (2, 1, 1)


@needs_libfuse
def test_fuse_keep_cache_only_for_an_unchanged_version(tmp_path: Path) -> None:
    fs, store = _fs(tmp_path)
    opens = []
    for change in (None, None, (b"abcd", 1.0), None, (b"abcd", 9.0), None):
        if change is not None:
            store.files["a.bin"] = change
        fi = _fi()
        fs.open("/a.bin", fi)
        opens.append(fi.keep_cache)
    assert opens == [0, 1, 0, 1, 0, 1]
    assert fs.read("/a.bin", 2, 1, _fi()) == b"bc"
    assert _errno(fs.open, "/a.bin", _fi(os.O_WRONLY)) == errno.EROFS
    assert _errno(fs.open, "/a.bin", _fi(os.O_RDWR)) == errno.EROFS
    assert _errno(fs.open, "/d", _fi()) == errno.EISDIR


@needs_libfuse
def test_fuse_read_errors(tmp_path: Path) -> None:
    fs, store = _fs(tmp_path)
    store.fail = FileNotFoundError("gone")
    assert _errno(fs.read, "/a.bin", 10, 0, _fi()) == errno.ENOENT
    store.fail = ConnectionRefusedError(errno.ECONNREFUSED, "refused")
    assert _errno(fs.read, "/a.bin", 10, 0, _fi()) == errno.ECONNREFUSED
    store.fail = RuntimeError("a backend's own exception")
    assert _errno(fs.read, "/a.bin", 10, 0, _fi()) == errno.EIO


@needs_libfuse
def test_fuse_stats_file(tmp_path: Path) -> None:
    fs, _ = _fs(tmp_path)
    assert STATS_NAME not in [name for name, _, _ in fs.readdir("/", 0)]
    size = fs.getattr("/" + STATS_NAME)["st_size"]
    fi = _fi()
    fs.open("/" + STATS_NAME, fi)
    assert fi.fh != 0
    assert fi.direct_io == 1
    data = fs.read("/" + STATS_NAME, 1 << 20, 0, fi)
    assert len(data) == size
    assert msgspec.json.decode(data, type=DatasetCache).cached_files == 1
    assert fs.read("/" + STATS_NAME, 4, 2, fi) == data[2:6]
    fs.release("/" + STATS_NAME, fi)
    assert fs.read("/" + STATS_NAME, 10, 0, fi) == b""


@needs_libfuse
def test_fuse_xattrs(tmp_path: Path) -> None:
    fs, _ = _fs(tmp_path)
    info = msgspec.json.decode(fs.getxattr("/", XATTR_INFO), type=MountInfo)
    assert info.dataset == "ds"
    assert info.cache_dir == str(tmp_path)
    assert fs.getxattr("/a.bin", XATTR_PATH) == b"objects/ab/copy"
    assert _errno(fs.getxattr, "/d/b.bin", XATTR_PATH) == errno.ENODATA  # read through
    assert _errno(fs.getxattr, "/a.bin", "user.other") == errno.ENODATA
    assert _errno(fs.getxattr, "/d", XATTR_PATH) == errno.ENODATA
    assert _errno(fs.getxattr, "/nope", XATTR_PATH) == errno.ENOENT
    assert fs.listxattr("/a.bin") == []


@needs_libfuse
def test_fuse_options_bound_the_kernel_caching_by_the_ttl() -> None:
    assert fuse_options("ds", 30.0)["attr_timeout"] == 1.0
    opts = fuse_options("ds", 0.0)
    assert (opts["attr_timeout"], opts["entry_timeout"], opts["ro"]) == (0.0, 0.0, True)
    assert opts["fsname"] == "mgcache:ds"
    assert opts["allow_other"] is True
    assert opts["max_read"] == MAX_READ


@needs_libfuse
def test_init_asks_for_splice_and_the_mount_options_read_size(tmp_path: Path) -> None:
    # libfuse refuses a session whose INIT max_read differs from the mount option's, and
    # splices a reply only when it fits its pipe (1 MiB by default): 512 KiB fits
    fs, _ = _fs(tmp_path)
    conn = mfusepy.fuse_conn_info()
    conn.capable = (1 << 7) | (1 << 8) | 1
    fs.init_with_config(conn, None)
    assert conn.max_read == MAX_READ == fuse_options("ds", 1.0)["max_read"]
    assert conn.want == (1 << 7) | (1 << 8)  # splice write and move: nothing else asked
    assert MAX_READ + 4 * 4096 <= 1 << 20


# -- the mountpoint ------------------------------------------------------------------------------


def test_check_mountpoint(tmp_path: Path) -> None:
    assert check_mountpoint(str(tmp_path)) is State.FREE
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(MountpointError, match="not a directory"):
        check_mountpoint(str(tmp_path / "f"))
    with pytest.raises(MountpointError, match="no such directory"):
        check_mountpoint(str(tmp_path / "nope"))
    with pytest.raises(MountpointError, match="in use"):
        check_mountpoint("/")


def test_is_within(tmp_path: Path) -> None:
    assert is_within(str(tmp_path / "a" / "b"), str(tmp_path / "a"))
    assert is_within(str(tmp_path / "a"), str(tmp_path / "a/"))
    assert not is_within(str(tmp_path / "ab"), str(tmp_path / "a"))


# -- the fsspec path without a mount ---------------------------------------------------------------


def test_fsspec_without_a_mount_reads_the_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fsspec

    from metalguard.agent.cache.fsspec_fs import MGCacheFileSystem

    monkeypatch.delenv("MG_DATASET_DIR", raising=False)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "x.bin").write_bytes(b"xyz")
    (tmp_path / "mnt").mkdir()  # a plain directory: no cache mounted there
    with fsspec.open(
        f"mgcache::{tmp_path}/src/x.bin", "rb", mgcache={"mountpoint": str(tmp_path / "mnt")}
    ) as f:
        assert f.read() == b"xyz"
    fs = MGCacheFileSystem(target_protocol="file", skip_instance_cache=True)
    assert fs.mountpoint is None
    assert fs.cat_file(str(tmp_path / "src" / "x.bin")) == b"xyz"
    assert fs.info(str(tmp_path / "src" / "x.bin"))["size"] == 3
    bare = MGCacheFileSystem(skip_instance_cache=True)
    with pytest.raises(FileNotFoundError, match="no running cache mount"):
        bare.cat_file("x.bin")


def test_fsspec_finds_the_mount(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from metalguard.agent.cache.fsspec_fs import _find_mountpoint

    config = _config(tmp_path, DATASET)
    monkeypatch.setenv("MG_DATASET_DIR", "/mnt/from-env")
    assert _find_mountpoint("/explicit", "imagenet", str(config), None, "") == "/explicit"
    assert _find_mountpoint(None, "imagenet", str(config), None, "") == "/mnt/imagenet"
    assert _find_mountpoint(None, "other", str(config), None, "") is None
    assert (
        _find_mountpoint(None, None, str(config), "file", "/data/imagenet/a/b") == "/mnt/imagenet"
    )
    assert _find_mountpoint(None, None, str(config), "file", "/data/imagenet2/a") == "/mnt/from-env"
    assert _find_mountpoint(None, None, str(config), None, "") == "/mnt/from-env"


def test_the_mgcache_protocol_is_registered() -> None:
    import tomllib

    import fsspec

    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    specs = pyproject["project"]["entry-points"]["fsspec.specs"]
    assert specs == {"mgcache": "metalguard.agent.cache.fsspec_fs:MGCacheFileSystem"}
    from metalguard.agent.cache.fsspec_fs import MGCacheFileSystem

    assert fsspec.get_filesystem_class("mgcache") is MGCacheFileSystem


@needs_libfuse
def test_fuse_read_buf_answers_a_descriptor_for_a_cached_copy(tmp_path: Path) -> None:
    """A cached file's reads are answered as (descriptor, offset, size) buffers that
    libfuse reads itself; any other read as a memory buffer of the bytes."""
    import ctypes

    from metalguard.agent.cache import fusefs

    fs, store = _fs(tmp_path)
    copy = tmp_path / "copy"
    copy.write_bytes(b"abc")
    store.copies["a.bin"] = copy

    def answer(path: str, size: int, offset: int, fi: Any) -> Any:
        slot = ctypes.c_void_p()
        assert fs.read_buf(path, ctypes.pointer(slot), size, offset, fi) == 0
        assert slot.value is not None
        vec = fusefs._FuseBufvec.from_address(slot.value)
        buf = vec.buf[0]
        out = (vec.count, buf.size, buf.flags, buf.fd, buf.pos, buf.mem)
        data = ctypes.string_at(buf.mem, buf.size) if buf.mem else None
        if buf.mem:
            fusefs._free(buf.mem)
        fusefs._free(slot.value)
        return out, data

    fi = _fi()
    fs.open("/a.bin", fi)
    assert fi.fh != 0
    (count, size, flags, fd, pos, mem), _ = answer("/a.bin", 1 << 17, 0, fi)
    assert (count, size, pos, mem) == (1, 3, 0, None)
    assert flags & fusefs._BUF_IS_FD
    assert flags & fusefs._BUF_FD_SEEK
    assert os.pread(fd, 10, 0) == b"abc"  # the open copy's descriptor
    (_, size, _, _, pos, _), _ = answer("/a.bin", 2, 1, fi)
    assert (size, pos) == (2, 1)
    (_, size, _, _, _, _), _ = answer("/a.bin", 10, 5, fi)
    assert size == 0  # past the end
    assert store.noted == [("a.bin", 3, True)]  # the file read; later bytes at release
    fs.release("/a.bin", fi)
    assert store.noted[-1] == ("a.bin", 2, False)
    with pytest.raises(OSError, match="Bad file descriptor"):  # the descriptor is closed
        os.fstat(fd)

    other = _fi()
    fs.open("/d/b.bin", other)  # not cached: memory buffers of the store's bytes
    assert other.fh == 0
    (count, size, flags, fd, _, mem), data = answer("/d/b.bin", 10, 0, other)
    assert (count, size, flags, data) == (1, 1, 0, b"x")
    stats = _fi()
    fs.open("/" + STATS_NAME, stats)
    (_, size, flags, _, _, _), data = answer("/" + STATS_NAME, 1 << 20, 0, stats)
    assert flags == 0
    assert data is not None
    assert msgspec.json.decode(data, type=DatasetCache).cached_files == 1
