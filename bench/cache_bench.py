"""Node-local dataset cache: hit ratio, source traffic and read latency against direct reads.

A dataset of many files (default 4,000 files of 100 KiB - 1 MiB, uniform sizes, ~2.3 GB;
``--files 20000`` is the issue's size, ~11 GB) is generated in a temporary directory and
served by an HTTP object server in a separate process on loopback
(bench/cache_source_server.py: ETag, Last-Modified, Range, HTML directory listings, a
fixed cost per request). A DataLoader-like reader (worker threads each taking the next
index of the epoch's order and reading that whole file) lists the dataset, then reads it
for 3 epochs, each a fresh shuffle, through:

- ``direct``: fsspec's HTTPFileSystem straight from the source (the baseline, measured in
  the same run);
- the cache (``CacheStore`` of metalguard.agent.cache, in this process) at 25/50/75 % of
  the dataset with the ``lru``, ``pin`` (training-aware) and ``auto`` policies, each
  starting cold;

plus a skewed (Zipf 0.8 popularity, a fixed hot set) and a sequential pattern at 50 %.
For each configuration and epoch it prints the hit ratio, the bytes and requests the
source served (counted by the server) and the mean read latency.  Each pattern's direct
baseline runs first and again last (``direct-end``); the latency ratios divide by the
mean of both, so load that drifts during the runs (a shared machine) skews them less.

Then, as root with /dev/fuse: ``metalguard cache mount`` in its own process is filled with
a subset of the files (``--hit-mb``), restarted on the same cache dir (the copies are
recovered; the kernel holds no pages of the new mount) and read with 4 readers: cache
hits through FUSE, then the same again (the kernel's page cache, keep_cache), against
plain reads of the same files from the local disk; and one reader through the
``mgcache::`` fsspec path against plain local reads; then the same FUSE runs over a second
mount of ``--shards`` files of ``--shard-mib`` MiB each (the shape of sharded training
data: bytes, not per-file callbacks, are the cost there). Last, the headline ratios
against the goals of issue 18.

Every read of a policy run and of a fill is checked byte for byte against the generated
content (the ``bad`` column).

Usage: python bench/cache_bench.py [--files N] [--latency-ms MS] [--workers N] [--quick]
       [--patterns shuffle,...] [--sizes 25,50,75] [--policies lru,pin,auto]
       [--no-mount | --mount-only] [--shards N] [--shard-mib MIB]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import fsspec

from metalguard.agent.cache.source import open_source
from metalguard.agent.cache.store import CacheStore

ROOT = Path(__file__).resolve().parents[1]
SERVER = Path(__file__).with_name("cache_source_server.py")
KiB = 1024
MiB = 1024 * KiB
GB = 1e9
HEADER = struct.Struct("<4sQI")  # magic, file index, file size: the first bytes of a file
MAGIC = b"MGDS"
SHARD = 500  # files per directory of the generated dataset
PATTERNS = ("shuffle", "skewed", "sequential")


# --- the dataset ----------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One file of the generated dataset."""

    index: int
    path: str  # relative to the dataset root: "train/007/003512.bin"
    size: int
    offset: int  # where its body starts in the content pool


@dataclass
class Dataset:
    """The generated files and the random pool their bodies are cut from."""

    root: Path
    samples: list[Sample]
    pool: bytes

    @property
    def nbytes(self) -> int:
        return sum(s.size for s in self.samples)

    def expected(self, sample: Sample) -> bytes:
        """The bytes ``sample`` holds."""
        body = sample.size - HEADER.size
        head = HEADER.pack(MAGIC, sample.index, sample.size)
        return head + self.pool[sample.offset : sample.offset + body]

    def check(self, sample: Sample, data: bytes) -> bool:
        """Whether ``data`` is exactly the file's content."""
        return data == self.expected(sample)  # bytes ==: a memcmp (a memoryview's is slow)


def make_dataset(root: Path, files: int, min_size: int, max_size: int, seed: int) -> Dataset:
    """Write ``files`` files of uniform random sizes in [min_size, max_size] under root."""
    rng = random.Random(seed)
    pool = rng.randbytes(2 * max_size)
    view = memoryview(pool)
    samples = []
    for i in range(files):
        size = rng.randint(min_size, max_size)
        offset = rng.randrange(max_size)
        sample = Sample(i, f"train/{i // SHARD:03d}/{i:06d}.bin", size, offset)
        path = root / sample.path
        if i % SHARD == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("wb") as f:
            f.write(HEADER.pack(MAGIC, i, size))
            f.write(view[offset : offset + size - HEADER.size])
        samples.append(sample)
    return Dataset(root, samples, pool)


def epoch_order(pattern: str, n: int, epoch: int, seed: int, zipf_s: float = 0.8) -> list[int]:
    """The file indices one epoch reads, in order.

    ``shuffle``: every file once, a fresh permutation each epoch; ``sequential``: every file
    once in path order; ``skewed``: n draws from a Zipf(``zipf_s``) popularity over a fixed
    random ranking of the files (the same hot set every epoch).
    """
    rng = random.Random(seed * 7919 + epoch)
    if pattern == "sequential":
        return list(range(n))
    if pattern == "shuffle":
        order = list(range(n))
        rng.shuffle(order)
        return order
    if pattern == "skewed":
        ranking = list(range(n))
        random.Random(seed).shuffle(ranking)
        cum = list(itertools.accumulate(1.0 / (r + 1) ** zipf_s for r in range(n)))
        return rng.choices(ranking, cum_weights=cum, k=n)
    raise ValueError(f"unknown pattern {pattern!r}")


# --- the source server ------------------------------------------------------------------


class SourceServer:
    """bench/cache_source_server.py in its own process, serving the dataset's parent."""

    def __init__(self, root: Path, latency_ms: float) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(SERVER), str(root), "--latency-ms", str(latency_ms)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 30.0)
        line = self.proc.stdout.readline() if ready else ""
        if " at http://" not in line:
            self.close()
            raise RuntimeError(f"the source server did not start: {line!r}")
        self.base = line.rsplit(" at ", 1)[1].strip()  # "http://127.0.0.1:PORT/"

    def counters(self) -> dict[str, int]:
        """The server's request and byte counters."""
        with urllib.request.urlopen(self.base + "__stats__", timeout=10) as r:
            return dict(json.loads(r.read()))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


# --- the reader -------------------------------------------------------------------------


@dataclass
class Epoch:
    """What one epoch of one configuration measured."""

    reads: int = 0
    nbytes: int = 0
    wall_s: float = 0.0
    latency_s: float = 0.0  # sum over reads
    bad: int = 0  # reads whose bytes differ from the file's
    errors: list[str] = field(default_factory=list)
    source_bytes: int = 0  # body bytes the server sent during the epoch
    source_requests: int = 0
    hits: int | None = None  # the cache's counters over the epoch (None: no cache)
    misses: int | None = None

    @property
    def mean_latency_s(self) -> float:
        return self.latency_s / self.reads if self.reads else float("nan")

    @property
    def hit_ratio(self) -> float:
        if self.hits is None or self.misses is None:
            return 0.0
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


def read_epoch(
    read: Callable[[Sample], bytes],
    dataset: Dataset,
    order: Sequence[int],
    workers: int,
) -> Epoch:
    """Read ``order``'s files with ``workers`` threads, like a DataLoader's workers."""
    indices: Iterator[int] = iter(order)
    lock = threading.Lock()

    def worker() -> Epoch:
        mine = Epoch()
        while True:
            with lock:
                i = next(indices, None)
            if i is None:
                return mine
            sample = dataset.samples[i]
            t0 = time.perf_counter()
            try:
                data = read(sample)
            except Exception as exc:
                mine.errors.append(f"{sample.path}: {exc!r}")
                continue
            mine.latency_s += time.perf_counter() - t0
            mine.reads += 1
            mine.nbytes += len(data)
            if not dataset.check(sample, data):
                mine.bad += 1

    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        parts = list(pool.map(lambda _: worker(), range(workers)))
    total = Epoch(wall_s=time.perf_counter() - t0)
    for part in parts:
        total.reads += part.reads
        total.nbytes += part.nbytes
        total.latency_s += part.latency_s
        total.bad += part.bad
        total.errors += part.errors
    return total


# --- the ways of reading ------------------------------------------------------------------


class Backend:
    """One way of reading the dataset's files."""

    name = "?"

    def read(self, sample: Sample) -> bytes:
        raise NotImplementedError

    def listdir(self, path: str) -> list[str]:
        """The names in directory ``path`` of the dataset (what a loader walks first)."""
        raise NotImplementedError

    def cache_counters(self) -> tuple[int, int] | None:
        """(hits, misses) of the cache so far; None when there is no cache."""
        return None

    def close(self) -> None:
        """Release what the backend holds."""


class Direct(Backend):
    """fsspec's HTTPFileSystem, straight from the source."""

    name = "direct"

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/") + "/"
        self.fs = fsspec.filesystem("http", skip_instance_cache=True)

    def read(self, sample: Sample) -> bytes:
        return bytes(self.fs.cat_file(self.url + sample.path))

    def listdir(self, path: str) -> list[str]:
        return [e.rstrip("/").rsplit("/", 1)[1] for e in self.fs.ls(self.url + path, detail=False)]


class Store(Backend):
    """metalguard's CacheStore over the http source, read in-process."""

    def __init__(
        self, url: str, cache_dir: Path, max_bytes: int, policy: str, metadata_ttl_s: float
    ) -> None:
        self.name = policy
        source = open_source(url, metadata_ttl_s=metadata_ttl_s)
        self.store = CacheStore(
            source, cache_dir, max_bytes, policy=policy, dataset="bench",
            metadata_ttl_s=metadata_ttl_s,
        ).open()  # fmt: skip

    def read(self, sample: Sample) -> bytes:
        return self.store.read(sample.path, 0, sample.size)

    def listdir(self, path: str) -> list[str]:
        return [e.name for e in self.store.listdir(path)]

    def cache_counters(self) -> tuple[int, int]:
        stats = self.store.stats()
        return stats.hits, stats.misses

    def close(self) -> None:
        self.store.close()


# --- the policy runs ---------------------------------------------------------------------

SIZES = (0.25, 0.50, 0.75)
POLICIES = ("lru", "pin", "auto")
Key = tuple[str, float, str]  # pattern, cache size as a share of the dataset (0: none), policy


@dataclass
class Run:
    """One configuration: listing the dataset, then its epochs."""

    listing_s: float
    listing_requests: int
    epochs: list[Epoch]
    note: str = ""


def run_config(
    backend: Backend,
    server: SourceServer,
    dataset: Dataset,
    orders: Sequence[Sequence[int]],
    workers: int,
) -> Run:
    """List the dataset (as a loader walks it first), then read every epoch's order through
    ``backend``; with the source's and the cache's counters over each epoch."""
    before = server.counters()
    t0 = time.perf_counter()
    dirs = sorted({s.path.rsplit("/", 1)[0] for s in dataset.samples})
    found = sum(len(backend.listdir(d)) for d in dirs)
    listing_s = time.perf_counter() - t0
    listing_requests = server.counters()["requests"] - before["requests"] - 1
    if found != len(dataset.samples):
        raise RuntimeError(f"{backend.name}: listed {found} files, not {len(dataset.samples)}")
    epochs = []
    for order in orders:
        before, counts0 = server.counters(), backend.cache_counters()
        epoch = read_epoch(backend.read, dataset, order, workers)
        after, counts1 = server.counters(), backend.cache_counters()
        epoch.source_bytes = after["body_bytes"] - before["body_bytes"]
        epoch.source_requests = after["requests"] - before["requests"] - 1  # less the probe
        if counts0 is not None and counts1 is not None:
            epoch.hits, epoch.misses = counts1[0] - counts0[0], counts1[1] - counts0[1]
        epochs.append(epoch)
    return Run(listing_s, listing_requests, epochs)


def plan(
    patterns: Sequence[str], sizes: Sequence[float], policies: Sequence[str] = POLICIES
) -> list[Key]:
    """The configurations, in the order they run: each pattern's baseline first and again
    last (``direct-end``: the ratios divide by the mean of both, so a machine whose load
    drifts during the runs skews them less), between them the shuffled epochs at every
    size, the other patterns at 50 %."""
    keys: list[Key] = []
    for pattern in patterns:
        keys.append((pattern, 0.0, "direct"))
        for share in sizes if pattern == "shuffle" else (0.5,):
            keys += [(pattern, share, p) for p in POLICIES if p in policies]
        keys.append((pattern, 0.0, "direct-end"))
    return keys


def measure_policies(
    server: SourceServer, dataset: Dataset, work: Path, args: argparse.Namespace
) -> dict[Key, Run]:
    """Run every configuration of :func:`plan`, each cache cold; print its rows."""
    url = server.base + "ds"
    n = len(dataset.samples)
    results: dict[Key, Run] = {}
    print_header()
    for key in plan(args.patterns, args.sizes, args.policies):
        pattern, share, policy = key
        orders = [epoch_order(pattern, n, e, args.seed) for e in range(args.epochs)]
        cache_dir = work / "cache"
        backend: Backend = (
            Direct(url)
            if policy.startswith("direct")
            else Store(url, cache_dir, int(share * dataset.nbytes), policy, args.metadata_ttl)
        )
        try:
            run = run_config(backend, server, dataset, orders, args.workers)
            if isinstance(backend, Store):
                st = backend.store.stats()
                run.note = (
                    f"policy {st.policy} ({st.policy_reason}); pattern {st.pattern}; "
                    f"evictions {st.evictions:,}, prefetched {st.prefetched:,}, "
                    f"pass-through {st.passthrough_reads:,}, warnings {st.warnings}"
                )
        finally:
            backend.close()
            shutil.rmtree(cache_dir, ignore_errors=True)
        results[key] = run
        print_run(pattern, f"{share:.0%}" if share else "-", policy, run)
    return results


# --- through the mount and the fsspec path -----------------------------------------------


def mount_unavailable() -> str:
    """Why the FUSE mount cannot be measured here ("" when it can)."""
    if os.geteuid() != 0:
        return "not root"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    if shutil.which("fusermount3") is None:
        return "no fusermount3 (apt-get install fuse3)"
    try:
        import metalguard.agent.cache.cli  # noqa: F401
    except ImportError as e:
        return f"metalguard cache mount not available ({e})"
    return ""


@contextmanager
def mounted(url: str, mountpoint: Path, cache_dir: Path, max_bytes: int) -> Iterator[Path]:
    """``metalguard cache mount`` in its own process; unmounted (SIGTERM) on exit."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "metalguard", "cache", "mount", "--source", url,
        "--mountpoint", str(mountpoint), "--cache-dir", str(cache_dir),
        "--max-bytes", str(max_bytes), "--policy", "lru",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not os.path.ismount(mountpoint):
            if proc.poll() is not None:
                err = proc.stderr.read() if proc.stderr else ""
                raise RuntimeError(f"metalguard cache mount exited {proc.returncode}: {err}")
            if time.monotonic() > deadline:
                raise RuntimeError("metalguard cache mount: not mounted after 60 s")
            time.sleep(0.05)  # a child's mount: nothing to wait on but the mount table
        yield mountpoint
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if os.path.ismount(mountpoint):
            subprocess.run(["fusermount3", "-uz", str(mountpoint)], check=False)


def read_files(
    open_read: Callable[[Sample], bytes],
    dataset: Dataset,
    samples: Sequence[Sample],
    readers: int,
    verify: bool = False,
) -> float:
    """Read ``samples`` whole with ``readers`` threads (disjoint shares); bytes per second.

    With ``verify``, every read is checked (outside the timing's concern: a fill pass)."""
    errors: list[str] = []

    def reader(share: Sequence[Sample]) -> int:
        nbytes = 0
        for sample in share:
            data = open_read(sample)
            nbytes += len(data)
            if verify and not dataset.check(sample, data):
                errors.append(sample.path)
        return nbytes

    t0 = time.perf_counter()
    with ThreadPoolExecutor(readers) as pool:
        total = sum(pool.map(reader, [samples[i::readers] for i in range(readers)]))
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} reads differ from the source, e.g. {errors[0]}")
    return total / wall


def walk(root: Path, dataset: Dataset) -> None:
    """List every directory under ``root`` (what a loader does first: os.scandir)."""
    found = sum(len(files) for _, _, files in os.walk(root))
    if found != len(dataset.samples):
        raise RuntimeError(f"{root}: {found} files listed, not {len(dataset.samples)}")


def plain_read(root: Path) -> Callable[[Sample], bytes]:
    """Read a sample's file under ``root`` with open/read."""

    def read(sample: Sample) -> bytes:
        with open(root / sample.path, "rb") as f:
            return f.read()

    return read


@dataclass
class MountFigures:
    """Throughputs (bytes/s) of the mount and fsspec runs."""

    files: int = 0
    nbytes: int = 0
    fill: float = 0.0
    fuse_hits: float = 0.0  # after a remount or drop_pages: every read reaches the cache
    fuse_page_cache: float = 0.0  # the same again: the kernel's page cache (keep_cache)
    local: float = 0.0  # the same files read from the local disk, same readers
    fsspec_hits: float = 0.0  # one reader, mgcache:: path
    fsspec_local: float = 0.0  # one reader, the same files from the local disk
    fsspec_note: str = ""


def hit_subset(dataset: Dataset, limit_bytes: int) -> list[Sample]:
    """The first files of a fixed shuffle, up to ``limit_bytes``."""
    chosen, total = [], 0
    for i in epoch_order("shuffle", len(dataset.samples), 99, 1):
        sample = dataset.samples[i]
        if total + sample.size > limit_bytes:
            break
        chosen.append(sample)
        total += sample.size
    return chosen


def measure_mount(
    server: SourceServer,
    dataset: Dataset,
    work: Path,
    hit_bytes: int,
    rounds: int,
    *,
    name: str = "ds",
    fsspec_too: bool = True,
) -> MountFigures:
    """Fill a mount of the source's ``name`` with a subset of the files, remount it (the
    copies recovered), and time cache hits through FUSE with 4 readers, and (``fsspec_too``)
    through the fsspec path with one, against plain reads of the same files from the local
    disk."""
    url = server.base + name
    subset = hit_subset(dataset, hit_bytes)
    fig = MountFigures(files=len(subset), nbytes=sum(s.size for s in subset))
    cache_dir, mp = work / f"{name}-mount-cache", work / f"{name}-mnt"
    max_bytes = dataset.nbytes + 64 * MiB
    local = plain_read(dataset.root)
    with mounted(url, mp, cache_dir, max_bytes):
        walk(mp, dataset)
        fig.fill = read_files(plain_read(mp), dataset, subset, 4, verify=True)
    with mounted(url, mp, cache_dir, max_bytes):  # a warm restart: no page cache of the mount
        walk(mp, dataset)
        fig.fuse_hits = read_files(plain_read(mp), dataset, subset, 4)
        fig.fuse_page_cache = read_files(plain_read(mp), dataset, subset, 4)
        for _ in range(rounds):  # interleaved: a noisy neighbour slows all three alike
            fig.local = max(fig.local, read_files(local, dataset, subset, 4))
            fig.fuse_page_cache = max(
                fig.fuse_page_cache, read_files(plain_read(mp), dataset, subset, 4)
            )
            drop_pages(mp, subset)  # the mount's pages only: every read reaches the cache
            fig.fuse_hits = max(fig.fuse_hits, read_files(plain_read(mp), dataset, subset, 4))
        fsspec_read, fig.fsspec_note = (
            fsspec_reader(url, mp) if fsspec_too else (None, "not measured")
        )
        if fsspec_read is not None:
            read_files(fsspec_read, dataset, subset, 1, verify=True)  # its own warm-up
            for _ in range(rounds):  # interleaved: a noisy neighbour slows both alike
                fig.fsspec_hits = max(fig.fsspec_hits, read_files(fsspec_read, dataset, subset, 1))
                fig.fsspec_local = max(fig.fsspec_local, read_files(local, dataset, subset, 1))
    return fig


def drop_pages(root: Path, samples: Sequence[Sample]) -> None:
    """Drop the kernel's cached pages of ``samples`` under ``root`` (the mount's files,
    not the cache's copies nor the source's): the next reads go to the cache process."""
    for sample in samples:
        fd = os.open(root / sample.path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def fsspec_reader(url: str, mountpoint: Path) -> tuple[Callable[[Sample], bytes] | None, str]:
    """A reader of the ``mgcache::`` fsspec path over the mount, or None and why not."""
    try:
        import metalguard.agent.cache.fsspec_fs  # noqa: F401  (registers "mgcache")
    except ImportError as e:
        return None, f"metalguard.agent.cache.fsspec_fs not available ({e})"
    fs = fsspec.filesystem("mgcache", mountpoint=str(mountpoint))

    def read(sample: Sample) -> bytes:
        with fs.open(sample.path, "rb") as f:
            return bytes(f.read())

    return read, ""


# --- output -----------------------------------------------------------------------------


def print_header() -> None:
    print(
        f"{'pattern':10} {'cache':>5} {'policy':10} {'epoch':>5} {'hit':>6} "
        f"{'source MB':>10} {'/read':>5} {'requests':>9} {'mean ms':>8} {'MB/s':>6} {'bad':>3}"
    )


def print_run(pattern: str, size: str, policy: str, run: Run) -> None:
    for number, e in enumerate(run.epochs, 1):
        hit = f"{e.hit_ratio:6.1%}" if e.hits is not None else f"{'-':>6}"
        share = e.source_bytes / e.nbytes if e.nbytes else 0.0
        print(
            f"{pattern:10} {size:>5} {policy:10} {number:5d} {hit} "
            f"{e.source_bytes / 1e6:10,.0f} {share:5.2f} {e.source_requests:9,d} "
            f"{e.mean_latency_s * 1e3:8.2f} {e.nbytes / e.wall_s / 1e6:6.0f} {e.bad:3d}"
        )
        for error in e.errors[:3]:
            print(f"    error: {error} ({len(e.errors)} errors)")
    print(
        f"    listing {run.listing_s:.1f} s, {run.listing_requests:,} source requests"
        + (f"; {run.note}" if run.note else "")
    )


def mean_latency(epochs: Sequence[Epoch]) -> float:
    reads = sum(e.reads for e in epochs)
    return sum(e.latency_s for e in epochs) / reads if reads else float("nan")


def hit_ratio(epochs: Sequence[Epoch]) -> float:
    hits = sum(e.hits or 0 for e in epochs)
    total = hits + sum(e.misses or 0 for e in epochs)
    return hits / total if total else 0.0


def _pin_lru(results: dict[Key, Run], share: float, later: slice) -> tuple[float, float, str]:
    pin = hit_ratio(results["shuffle", share, "pin"].epochs[later])
    lru = hit_ratio(results["shuffle", share, "lru"].epochs[later])
    return pin, lru, f"{pin / lru:.2f}x" if lru else "inf"


def direct_latency(results: dict[Key, Run], pattern: str) -> float:
    """The direct reads' mean latency over epochs 2..N, both baseline runs together."""
    later = slice(1, None)
    keys = ((pattern, 0.0, "direct"), (pattern, 0.0, "direct-end"))
    return mean_latency([e for k in keys if k in results for e in results[k].epochs[later]])


def _latency_ratio(results: dict[Key, Run], pattern: str, share: float, policy: str) -> float:
    later = slice(1, None)
    direct = direct_latency(results, pattern)
    return mean_latency(results[pattern, share, policy].epochs[later]) / direct


def print_summary(results: dict[Key, Run], epochs: int) -> None:
    """Hit ratios and latency ratios over the epochs after the first (the cache's fill)."""
    later = slice(1, epochs)
    span = f"epochs 2-{epochs}"
    print()
    for pattern, share, policy in results:
        if pattern == "shuffle" and share and policy == _first_policy(results, pattern, share):
            cells = [
                f"{p} {hit_ratio(results['shuffle', share, p].epochs[later]):.1%}"
                for p in POLICIES
                if ("shuffle", share, p) in results
            ]
            ratio = ""
            if ("shuffle", share, "pin") in results and ("shuffle", share, "lru") in results:
                ratio = f" (pin/lru {_pin_lru(results, share, later)[2]})"
            print(f"shuffle at {share:.0%}, {span}: hit ratio {', '.join(cells)}{ratio}")
    for pattern, share, policy in results:
        if share and policy == _first_policy(results, pattern, share):
            direct = direct_latency(results, pattern)
            cells = [
                f"{p} {_latency_ratio(results, pattern, share, p):.2f}"
                for p in POLICIES
                if (pattern, share, p) in results
            ]
            start, end = (
                mean_latency(results[pattern, 0.0, d].epochs[later]) * 1e3
                for d in ("direct", "direct-end")
            )
            print(
                f"{pattern} at {share:.0%}, {span}: mean latency cache/direct "
                f"(direct {direct * 1e3:.2f} ms: {start:.2f} first, {end:.2f} last): "
                + ", ".join(cells)
            )


def _first_policy(results: dict[Key, Run], pattern: str, share: float) -> str:
    return next(p for p in POLICIES if (pattern, share, p) in results)


def print_headlines(
    results: dict[Key, Run],
    epochs: int,
    mount: MountFigures | None,
    why_not: str,
    shards: MountFigures | None = None,
) -> None:
    """The four figures against the goals of issue 18."""
    later = slice(1, epochs)
    print()
    if ("shuffle", 0.5, "pin") in results and ("shuffle", 0.5, "lru") in results:
        _, _, ratio = _pin_lru(results, 0.5, later)
        print(f"hit ratio pin/lru epochs 2-{epochs} at 50%: {ratio} (goal >= 3x)")
    else:
        print(f"hit ratio pin/lru epochs 2-{epochs} at 50%: not run (--sizes, --policies)")
    shares = sorted(f for p, f, policy in results if p == "shuffle" and policy == "auto")
    if shares:
        at = {f: _latency_ratio(results, "shuffle", f, "auto") for f in shares}
        best = 0.75 if 0.75 in at else shares[-1]
        others = ", ".join(f"at {f:.0%}: {r:.2f}" for f, r in sorted(at.items()) if f != best)
        print(
            f"mean latency cache/direct: {at[best]:.2f} (goal <= 0.4; auto, shuffle at "
            f"{best:.0%}, epochs 2-{epochs}" + (f"; {others})" if others else ")")
        )
    else:
        print("mean latency cache/direct: not run (--patterns, --policies)")
    if mount is None:
        print(f"FUSE hits, 4 readers: skipped ({why_not})")
        print(f"fsspec hits / local disk: skipped ({why_not})")
        return
    print(
        f"FUSE hits, 4 readers: {mount.fuse_hits / GB:.2f} GB/s (goal >= 1; "
        f"{mount.files:,} files, {mount.nbytes / GB:.2f} GB, none in the kernel's page cache "
        f"(a remount, then best of the rounds after dropping the mount's pages); filled at "
        f"{mount.fill / GB:.2f} GB/s; again from the page cache {mount.fuse_page_cache / GB:.2f}"
        f" GB/s; local disk {mount.local / GB:.2f} GB/s)"
    )
    if shards is not None:
        print(
            f"FUSE hits, 4 readers, shards: {shards.fuse_hits / GB:.2f} GB/s (goal >= 1; "
            f"{shards.files:,} files of {shards.nbytes / shards.files / MiB:.0f} MiB, as "
            f"above; again from the page cache {shards.fuse_page_cache / GB:.2f} GB/s; local "
            f"disk {shards.local / GB:.2f} GB/s)"
        )
    if mount.fsspec_hits:
        print(
            f"fsspec hits / local disk: {mount.fsspec_hits / mount.fsspec_local:.2f} (goal >= 0.7;"
            f" 1 reader: {mount.fsspec_hits / GB:.2f} vs {mount.fsspec_local / GB:.2f} GB/s)"
        )
    else:
        print(f"fsspec hits / local disk: skipped ({mount.fsspec_note})")


# --- main -------------------------------------------------------------------------------


def _names(text: str) -> tuple[str, ...]:
    names = tuple(n for n in text.split(",") if n)
    if not names or set(names) - set(PATTERNS):
        raise argparse.ArgumentTypeError(f"patterns are {', '.join(PATTERNS)}")
    return names


def _policies(text: str) -> tuple[str, ...]:
    names = tuple(n for n in text.split(",") if n)
    if not names or set(names) - set(POLICIES):
        raise argparse.ArgumentTypeError(f"policies are {', '.join(POLICIES)}")
    return names


def _shares(text: str) -> tuple[float, ...]:
    try:
        shares = tuple(float(n) / 100 for n in text.split(",") if n)
    except ValueError:
        raise argparse.ArgumentTypeError("sizes are percentages: 25,50,75") from None
    if not shares or not all(0 < f < 1 for f in shares):
        raise argparse.ArgumentTypeError("sizes are percentages between 0 and 100")
    return shares


@contextmanager
def workdir(parent: str | None) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="mg-cache-bench-", dir=parent))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=4_000, help="the issue's size: 20000")
    parser.add_argument("--min-kib", type=int, default=100)
    parser.add_argument("--max-kib", type=int, default=1024)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=4, help="reader threads")
    parser.add_argument("--latency-ms", type=float, default=5.0, help="source cost per request")
    parser.add_argument("--metadata-ttl", type=float, default=30.0, help="the cache's, seconds")
    parser.add_argument("--hit-mb", type=int, default=2000, help="files read for the hit runs")
    parser.add_argument("--rounds", type=int, default=3, help="best of N for the hit runs")
    parser.add_argument(
        "--shards", type=int, default=12, help="large files for a second FUSE hit run (0: none)"
    )
    parser.add_argument("--shard-mib", type=int, default=100, help="the size of each shard")
    parser.add_argument(
        "--patterns", type=_names, default=PATTERNS, help="a subset of " + ",".join(PATTERNS)
    )
    parser.add_argument(
        "--sizes", type=_shares, default=SIZES, help="cache sizes in %% (shuffle): 25,50,75"
    )
    parser.add_argument(
        "--policies", type=_policies, default=POLICIES, help="a subset of " + ",".join(POLICIES)
    )
    parser.add_argument("--seed", type=int, default=18)
    parser.add_argument("--dir", default=None, help="where the temporary files go")
    parser.add_argument("--no-mount", action="store_true", help="skip the FUSE/fsspec runs")
    parser.add_argument(
        "--mount-only", action="store_true", help="only the FUSE/fsspec runs (no policy runs)"
    )
    parser.add_argument("--quick", action="store_true", help="a tiny dataset (smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.files, args.min_kib, args.max_kib, args.workers, args.rounds = 120, 4, 32, 4, 1
        args.shards, args.shard_mib = 2, 1
    if args.epochs < 2:
        parser.error("--epochs must be >= 2 (the figures are over epochs 2..N)")
    if args.mount_only and args.no_mount:
        parser.error("--mount-only and --no-mount exclude each other")

    with workdir(args.dir) as work:
        t0 = time.perf_counter()
        dataset = make_dataset(
            work / "src" / "ds", args.files, args.min_kib * KiB, args.max_kib * KiB, args.seed
        )
        print(
            f"dataset: {len(dataset.samples):,} files, {dataset.nbytes / GB:.2f} GB "
            f"({args.min_kib}-{args.max_kib} KiB), written in {time.perf_counter() - t0:.1f} s; "
            f"{args.epochs} epochs, {args.workers} reader threads, source cost "
            f"{args.latency_ms:g} ms/request, metadata TTL {args.metadata_ttl:g} s; machine: "
            f"{os.cpu_count()} vCPU, load average {os.getloadavg()[0]:.1f}"
        )
        server = SourceServer(work / "src", args.latency_ms)
        try:
            results = {} if args.mount_only else measure_policies(server, dataset, work, args)
            if results:
                print_summary(results, args.epochs)
            why_not = "--no-mount" if args.no_mount else mount_unavailable()
            mount = shards = None
            if not why_not:
                mount = measure_mount(server, dataset, work, args.hit_mb * 1_000_000, args.rounds)
                if args.shards:
                    size = args.shard_mib * MiB
                    big = make_dataset(work / "src" / "shards", args.shards, size, size, args.seed)
                    shards = measure_mount(
                        server, big, work, big.nbytes, args.rounds, name="shards", fsspec_too=False
                    )
        finally:
            server.close()
        print_headlines(results, args.epochs, mount, why_not, shards)
        print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
