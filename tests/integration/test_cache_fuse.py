"""The dataset cache on a real FUSE mount, run as ``metalguard cache mount`` processes.

Every read through the mount is compared byte for byte with the source: a randomized
workload with evictions, concurrent readers of the same files, a restart over a warm
cache (and a damaged one), a changed source file; the size bound on disk; every bad
input (exit 2 and its message, or a counted pass-through at run time); SIGTERM and
SIGKILL (a dead mount the next mount clears).  Skipped, with the reason, where a FUSE
mount cannot be made (not root, no /dev/fuse, no fusermount3).
"""

from __future__ import annotations

import errno
import hashlib
import os
import random
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from metalguard.agent.cache.stats import read_stats
from tests.support.harness.cache_env import (
    CacheMount,
    data_bytes_on_disk,
    fill_disk,
    force_unmount,
    fuse_skip_reason,
    is_dead_mount,
    make_dataset,
    mount_args,
    released,
    run_cache,
    tmpfs,
    tmpfs_skip_reason,
    wait_until,
)

_SKIP = fuse_skip_reason()
pytestmark = [
    pytest.mark.skipif(_SKIP is not None, reason=_SKIP or ""),
    pytest.mark.xdist_group("fuse"),
]

KIB = 1024
MIB = 1024 * KIB


@pytest.fixture
def dirs(tmp_path: Path) -> Iterator[dict[str, Path]]:
    """source/, mnt/ and cache/ under tmp_path; the mountpoint is released after."""
    paths = {name: tmp_path / name for name in ("src", "mnt", "cache")}
    paths["src"].mkdir()
    paths["mnt"].mkdir()
    try:
        yield paths
    finally:
        force_unmount(paths["mnt"])


@pytest.fixture
def mounts() -> Iterator[list[CacheMount]]:
    """Every CacheMount a test starts is killed and unmounted at its end."""
    started: list[CacheMount] = []
    try:
        yield started
    finally:
        for m in started:
            m.close()


def start(mounts: list[CacheMount], args: list[str], mountpoint: Path | None = None) -> CacheMount:
    m = CacheMount(args, mountpoint)
    mounts.append(m)
    return m.wait_ready()


def read_all(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def drop_page_cache(path: Path) -> None:
    """Make the next reads of ``path`` reach the cache process, not the kernel's pages."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# -- correctness -----------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["lru", "pin", "auto"])
def test_randomized_workload_reads_the_source_bytes(
    dirs: dict[str, Path], mounts: list[CacheMount], policy: str
) -> None:
    files = make_dataset(dirs["src"], 48, 1, 96 * KIB, seed=18, subdirs=3)
    total = sum(len(d) for d in files.values())
    max_bytes = total // 4
    m = start(mounts, mount_args(dirs["src"], dirs["mnt"], dirs["cache"], max_bytes, policy=policy))
    rng = random.Random(1818)
    names = sorted(files)
    assert (
        sorted(f"{d}/{n}" for d in os.listdir(dirs["mnt"]) for n in os.listdir(dirs["mnt"] / d))
        == names
    )
    for step in range(600):
        rel = rng.choice(names)
        want = files[rel]
        path = dirs["mnt"] / rel
        if step % 7 == 0:
            drop_page_cache(path)
        if rng.random() < 0.4:
            assert read_all(path) == want, rel
        else:
            with open(path, "rb", buffering=0) as f:
                for _ in range(rng.randint(1, 4)):
                    offset = rng.randint(0, len(want))
                    size = rng.randint(0, 70 * KIB)
                    assert os.pread(f.fileno(), size, offset) == want[offset : offset + size], (
                        rel,
                        offset,
                        size,
                    )
        assert data_bytes_on_disk(dirs["cache"]) <= max_bytes
    s = m.stats()
    assert s.used_bytes <= max_bytes
    assert s.evictions > 0 or policy == "pin", s
    assert s.hits > 0, s
    assert s.policy in ("lru", "pin"), s
    assert m.stop() == 0, m.output()


def test_concurrent_readers_of_the_same_files(
    dirs: dict[str, Path], mounts: list[CacheMount]
) -> None:
    files = make_dataset(dirs["src"], 8, 1 * MIB, 3 * MIB, seed=7)
    digests = {rel: hashlib.sha256(d).hexdigest() for rel, d in files.items()}
    total = sum(len(d) for d in files.values())
    m = start(mounts, mount_args(dirs["src"], dirs["mnt"], dirs["cache"], total // 2, policy="lru"))
    errors: list[str] = []
    barrier = threading.Barrier(8)

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        order = sorted(files)
        barrier.wait()
        for _ in range(3):
            rng.shuffle(order)
            for rel in order:
                got = hashlib.sha256(read_all(dirs["mnt"] / rel)).hexdigest()
                if got != digests[rel]:
                    errors.append(f"reader {seed}: {rel}")
            drop_page_cache(dirs["mnt"] / order[0])

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert m.stats().used_bytes <= total // 2
    assert m.stop() == 0, m.output()


def test_one_fetch_for_concurrent_readers_of_a_missing_file(
    dirs: dict[str, Path], mounts: list[CacheMount]
) -> None:
    files = make_dataset(dirs["src"], 1, 8 * MIB, 8 * MIB, seed=3)
    ((rel, want),) = files.items()
    m = start(mounts, mount_args(dirs["src"], dirs["mnt"], dirs["cache"], 64 * MIB))
    barrier = threading.Barrier(6)
    got: list[bytes] = []

    def reader() -> None:
        barrier.wait()
        got.append(read_all(dirs["mnt"] / rel))

    threads = [threading.Thread(target=reader) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == [want] * 6
    s = m.stats()
    assert s.bytes_from_source == len(want), s
    assert s.cached_files == 1
    assert m.stop() == 0


def test_restart_keeps_the_warm_cache_and_never_serves_a_partial_copy(
    dirs: dict[str, Path], mounts: list[CacheMount]
) -> None:
    files = make_dataset(dirs["src"], 12, 10 * KIB, 200 * KIB, seed=12)
    args = mount_args(dirs["src"], dirs["mnt"], dirs["cache"], 64 * MIB)
    first = start(mounts, args)
    for rel, want in files.items():
        assert read_all(dirs["mnt"] / rel) == want
    assert first.stats().cached_files == len(files)
    assert first.stop() == 0, first.output()
    assert released(dirs["mnt"])
    written = read_stats(dirs["cache"] / "stats.json")
    assert written.misses == len(files)
    assert written.cached_files == len(files)

    second = start(mounts, args)
    for rel, want in files.items():
        assert read_all(dirs["mnt"] / rel) == want
    s = second.stats()
    assert (s.hits, s.misses, s.bytes_from_source) == (len(files), 0, 0), s
    assert second.stop() == 0

    # A crash mid-write: a copy cut short, a fill left in tmp/. Neither is ever served.
    copies = sorted(p for p in (dirs["cache"] / "objects").rglob("*") if p.is_file())
    victim = next(p for p in copies if not p.name.endswith(".meta"))
    victim.write_bytes(victim.read_bytes()[:100])
    (dirs["cache"] / "tmp" / "partial-fill").write_bytes(b"\0" * 5000)
    third = start(mounts, args)
    for rel, want in files.items():
        assert read_all(dirs["mnt"] / rel) == want
    s = third.stats()
    assert (s.misses, s.hits) == (1, len(files) - 1), s
    assert not (dirs["cache"] / "tmp" / "partial-fill").exists()
    assert third.stop() == 0


def test_a_changed_source_file_is_read_anew(
    dirs: dict[str, Path], mounts: list[CacheMount]
) -> None:
    src = dirs["src"] / "data.bin"
    src.write_bytes(b"a" * 50_000)
    os.utime(src, (1_700_000_000, 1_700_000_000))
    m = start(mounts, mount_args(dirs["src"], dirs["mnt"], dirs["cache"], MIB, metadata_ttl=0))
    path = dirs["mnt"] / "data.bin"
    assert read_all(path) == b"a" * 50_000
    assert read_all(path) == b"a" * 50_000  # a hit (the kernel's pages or the copy)

    src.write_bytes(b"b" * 70_000)  # size and mtime differ
    os.utime(src, (1_700_000_100, 1_700_000_100))
    assert read_all(path) == b"b" * 70_000
    assert os.stat(path).st_size == 70_000

    src.write_bytes(b"c" * 70_000)  # the same size, another mtime
    os.utime(src, (1_700_000_200, 1_700_000_200))
    assert read_all(path) == b"c" * 70_000
    with open(path, "rb") as f:
        assert os.pread(f.fileno(), 10, 69_990) == b"c" * 10

    src.unlink()
    with pytest.raises(FileNotFoundError):
        read_all(path)
    s = m.stats()
    assert s.used_bytes <= MIB, s
    assert s.misses >= 3, s
    assert m.stop() == 0


def test_the_cache_stays_within_max_bytes_on_disk(
    dirs: dict[str, Path], mounts: list[CacheMount]
) -> None:
    files = make_dataset(dirs["src"], 40, 20 * KIB, 120 * KIB, seed=40)
    max_bytes = 400 * KIB
    m = start(mounts, mount_args(dirs["src"], dirs["mnt"], dirs["cache"], max_bytes, policy="lru"))
    for epoch in range(2):
        for rel in sorted(files):
            assert read_all(dirs["mnt"] / rel) == files[rel]
            assert data_bytes_on_disk(dirs["cache"]) <= max_bytes, (epoch, rel)
            assert m.stats().used_bytes <= max_bytes
    s = m.stats()
    assert s.evictions > 0, s
    assert s.cached_files > 0, s
    assert m.stop() == 0


def test_every_user_can_read_the_mount(dirs: dict[str, Path], mounts: list[CacheMount]) -> None:
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv (util-linux) missing: cannot read as another user")
    files = make_dataset(dirs["src"], 2, 1000, 2000, seed=11)
    # pytest's tmp_path is 0700: the mountpoint goes where another user can reach it.
    mnt = Path(tempfile.mkdtemp(prefix="mgcache-mnt-"))
    mnt.chmod(0o755)
    try:
        start(mounts, mount_args(dirs["src"], mnt, dirs["cache"], MIB))
        rel = sorted(files)[0]
        as_nobody = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
        result = subprocess.run(
            [*as_nobody, "cat", str(mnt / rel)], capture_output=True, timeout=30, check=False
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout == files[rel]
        denied = subprocess.run(
            [*as_nobody, "touch", str(mnt / "new")], capture_output=True, timeout=30, check=False
        )
        assert denied.returncode != 0
        assert b"Read-only" in denied.stderr
        assert mounts[0].stop() == 0
    finally:
        force_unmount(mnt)
        mnt.rmdir()


# -- bad input: refused with exit 2 ------------------------------------------------------------


def test_a_missing_source_is_refused(dirs: dict[str, Path]) -> None:
    result = run_cache(mount_args(dirs["src"] / "nope", dirs["mnt"], dirs["cache"], MIB))
    assert result.returncode == 2, result
    assert "no such directory" in result.stderr
    assert "nope" in result.stderr
    assert released(dirs["mnt"])


def test_a_source_that_is_a_file_is_refused(dirs: dict[str, Path]) -> None:
    (dirs["src"] / "file").write_bytes(b"x")
    result = run_cache(mount_args(dirs["src"] / "file", dirs["mnt"], dirs["cache"], MIB))
    assert result.returncode == 2, result
    assert "not a directory" in result.stderr


def test_an_unreachable_source_url_is_refused(dirs: dict[str, Path]) -> None:
    result = run_cache(mount_args("http://127.0.0.1:9/data/", dirs["mnt"], dirs["cache"], MIB))
    assert result.returncode == 2, result
    assert "cannot be listed" in result.stderr, result.stderr


def test_an_unreadable_source_is_refused(dirs: dict[str, Path]) -> None:
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv (util-linux) missing: root cannot be kept out of a directory")
    locked = dirs["src"] / "locked"
    locked.mkdir()
    (locked / "a").write_bytes(b"a")
    locked.chmod(0)
    try:
        # Root without CAP_DAC_OVERRIDE/CAP_DAC_READ_SEARCH obeys the 000 mode.
        prefix = [setpriv, "--bounding-set=-dac_override,-dac_read_search", "--"]
        result = run_cache(mount_args(locked, dirs["mnt"], dirs["cache"], MIB), prefix=prefix)
    finally:
        locked.chmod(0o755)
    assert result.returncode == 2, result
    assert "permission denied" in result.stderr, result.stderr


def test_a_cache_dir_on_a_full_disk_is_refused(tmp_path: Path, dirs: dict[str, Path]) -> None:
    reason = tmpfs_skip_reason(tmp_path / "probe")
    if reason:
        pytest.skip(reason)
    make_dataset(dirs["src"], 2, 10, 100, seed=1)
    with tmpfs(tmp_path / "disk", "1m") as disk:
        fill_disk(disk)
        result = run_cache(mount_args(dirs["src"], dirs["mnt"], disk / "cache", MIB))
    assert result.returncode == 2, result
    assert "full" in result.stderr, result.stderr
    assert released(dirs["mnt"])


@pytest.mark.parametrize("kind", ["file", "missing", "in use"])
def test_a_bad_mountpoint_is_refused(
    tmp_path: Path, dirs: dict[str, Path], mounts: list[CacheMount], kind: str
) -> None:
    make_dataset(dirs["src"], 2, 10, 100, seed=2)
    target = dirs["mnt"]
    if kind == "file":
        target = tmp_path / "a-file"
        target.write_bytes(b"")
        expected = "not a directory"
    elif kind == "missing":
        target = tmp_path / "absent"
        expected = "no such directory"
    else:
        start(mounts, mount_args(dirs["src"], target, tmp_path / "other-cache", MIB))
        expected = "in use"
    result = run_cache(mount_args(dirs["src"], target, dirs["cache"], MIB))
    assert result.returncode == 2, result
    assert expected in result.stderr, result.stderr
    assert str(target) in result.stderr, result.stderr
    if kind == "in use":
        assert mounts[0].stats().dataset  # the first mount still serves
        assert mounts[0].stop() == 0


def test_a_cache_dir_held_by_another_cache_is_refused(
    tmp_path: Path, dirs: dict[str, Path], mounts: list[CacheMount]
) -> None:
    make_dataset(dirs["src"], 2, 10, 100, seed=2)
    first = start(mounts, mount_args(dirs["src"], dirs["mnt"], dirs["cache"], MIB))
    other = tmp_path / "mnt2"
    other.mkdir()
    result = run_cache(mount_args(dirs["src"], other, dirs["cache"], MIB))
    assert result.returncode == 2, result
    assert "in use by another cache process" in result.stderr
    assert f"pid {first.proc.pid}" in result.stderr
    assert released(other)


def test_bad_arguments_exit_2(dirs: dict[str, Path]) -> None:
    result = run_cache(["mount", "--source", str(dirs["src"]), "--max-bytes", "lots"])
    assert result.returncode == 2
    assert "not a byte count" in result.stderr
    result = run_cache(["mount", "--source", str(dirs["src"]), "--max-bytes", "1M"])
    assert result.returncode == 2
    assert "missing --mountpoint, --cache-dir" in result.stderr, result.stderr


# -- bad input at run time: pass-through, counted ------------------------------------------------


def test_a_file_larger_than_the_cache_is_read_through(
    dirs: dict[str, Path], mounts: list[CacheMount]
) -> None:
    big = os.urandom(300 * KIB)
    (dirs["src"] / "big.bin").write_bytes(big)
    m = start(mounts, mount_args(dirs["src"], dirs["mnt"], dirs["cache"], 100 * KIB))
    assert read_all(dirs["mnt"] / "big.bin") == big
    drop_page_cache(dirs["mnt"] / "big.bin")
    with open(dirs["mnt"] / "big.bin", "rb") as f:
        assert os.pread(f.fileno(), 1000, 200 * KIB) == big[200 * KIB : 200 * KIB + 1000]
    s = m.stats()
    assert s.passthrough_reads >= 1, s
    assert s.warnings >= 1, s
    assert "big.bin" in s.last_warning, s
    assert s.used_bytes == 0, s
    assert s.bytes_from_source >= len(big)
    assert m.stop() == 0
    assert "more than the whole cache" in "".join(m.errors), m.output()


def test_a_cache_disk_that_fills_up_degrades_to_pass_through(
    tmp_path: Path, dirs: dict[str, Path], mounts: list[CacheMount]
) -> None:
    reason = tmpfs_skip_reason(tmp_path / "probe")
    if reason:
        pytest.skip(reason)
    files = make_dataset(dirs["src"], 16, 200 * KIB, 300 * KIB, seed=16)
    with tmpfs(tmp_path / "disk", "2m") as disk:
        # The floor: 1 MiB of the 2 MiB disk is kept free, so the cache stops filling early.
        m = start(
            mounts,
            mount_args(
                dirs["src"], dirs["mnt"], disk / "cache", 64 * MIB, "--min-free-bytes", "1M"
            ),
        )
        names = sorted(files)
        for rel in names[:8]:
            assert read_all(dirs["mnt"] / rel) == files[rel]
        s = m.stats()
        assert s.passthrough_reads > 0, s
        assert s.warnings > 0, s
        assert 0 < s.cached_files < 8, s
        # The disk fills up behind the cache's back: fills fail with ENOSPC, reads go on.
        m.stop()
        m2 = start(mounts, mount_args(dirs["src"], dirs["mnt"], disk / "cache", 64 * MIB))
        fill_disk(disk)
        for rel in names:
            assert read_all(dirs["mnt"] / rel) == files[rel]
        s = m2.stats()
        assert s.passthrough_reads > 0, s
        assert m2.stop() == 0, m2.output()


# -- signals ---------------------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_unmounts_and_exits_0(
    dirs: dict[str, Path], mounts: list[CacheMount], sig: int
) -> None:
    files = make_dataset(dirs["src"], 3, 10, 1000, seed=5)
    m = start(mounts, mount_args(dirs["src"], dirs["mnt"], dirs["cache"], MIB))
    rel = sorted(files)[0]
    assert read_all(dirs["mnt"] / rel) == files[rel]
    assert m.stop(sig) == 0, m.output()
    assert released(dirs["mnt"])
    assert "unmounted" in "".join(m.lines)
    final = read_stats(dirs["cache"] / "stats.json")
    assert final.pid == m.proc.pid
    assert final.misses == 1


def test_sigkill_leaves_a_dead_mount_the_next_mount_clears(
    dirs: dict[str, Path], mounts: list[CacheMount]
) -> None:
    files = make_dataset(dirs["src"], 3, 10, 1000, seed=6)
    args = mount_args(dirs["src"], dirs["mnt"], dirs["cache"], MIB)
    m = start(mounts, args)
    assert m.stop(signal.SIGKILL) == -signal.SIGKILL
    assert is_dead_mount(dirs["mnt"])  # "Transport endpoint is not connected"
    with pytest.raises(OSError, match="not connected") as info:
        os.listdir(dirs["mnt"])
    assert info.value.errno == errno.ENOTCONN

    again = start(mounts, args)
    assert "cleared a dead FUSE mount" in "".join(again.errors), again.output()
    for rel, want in files.items():
        assert read_all(dirs["mnt"] / rel) == want
    assert again.stop() == 0
    assert released(dirs["mnt"])


def test_an_unmount_from_outside_ends_the_process(
    dirs: dict[str, Path], mounts: list[CacheMount]
) -> None:
    make_dataset(dirs["src"], 1, 10, 10, seed=9)
    m = start(mounts, mount_args(dirs["src"], dirs["mnt"], dirs["cache"], MIB))
    force_unmount(dirs["mnt"])
    assert m.wait_exit() == 0, m.output()
    assert released(dirs["mnt"])


# -- the stats file, `cache stats`, agent.toml --------------------------------------------------


def test_stats_file_stats_command_and_config(
    tmp_path: Path, dirs: dict[str, Path], mounts: list[CacheMount]
) -> None:
    files = make_dataset(dirs["src"], 4, 1000, 5000, seed=4)
    config = tmp_path / "agent.toml"
    config.write_text(
        "[cache]\nstats_interval_s = 0.2\n\n[[cache.datasets]]\n"
        f'name = "imagenet"\nsource = "{dirs["src"]}"\ncache_dir = "{dirs["cache"]}"\n'
        f'mountpoint = "{dirs["mnt"]}"\nmax_bytes = 1048576\nmin_free_bytes = 0\n'
        'policy = "lru"\n'
    )
    m = start(mounts, ["mount", "--config", str(config), "--dataset", "imagenet"], dirs["mnt"])
    for rel, want in files.items():
        assert read_all(dirs["mnt"] / rel) == want
    assert ".mgcache-stats" not in os.listdir(dirs["mnt"])
    s = m.stats()
    assert (s.dataset, s.policy, s.misses, s.max_bytes) == ("imagenet", "lru", 4, MIB), s
    assert s.mountpoint == str(dirs["mnt"])
    assert s.pid == m.proc.pid
    with pytest.raises(OSError, match="Read-only") as info:
        (dirs["mnt"] / ".mgcache-stats").write_bytes(b"x")
    assert info.value.errno == errno.EROFS

    def written() -> bool:
        try:
            return read_stats(dirs["cache"] / "stats.json").misses == 4
        except (FileNotFoundError, msgspec.DecodeError):
            return False

    wait_until(written, 10, "stats.json with the 4 misses")
    text = run_cache(["stats", "--config", str(config)])
    assert text.returncode == 0, text
    assert text.stdout.startswith("imagenet: running")
    assert "lru" in text.stdout
    as_json = run_cache(["stats", "--cache-dir", str(dirs["cache"]), "--format", "json"])
    assert as_json.returncode == 0
    assert msgspec.json.decode(as_json.stdout).get("misses") == 4
    unknown = run_cache(["stats", "--config", str(config), "--dataset", "nope"])
    assert unknown.returncode == 2
    assert "imagenet" in unknown.stderr
    assert m.stop() == 0
    missing = run_cache(["stats", "--cache-dir", str(tmp_path / "no-cache")])
    assert missing.returncode == 1
    assert "not running" in missing.stderr
