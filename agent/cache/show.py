"""``metalguard cache stats``: the figures a cache process last wrote, for a person or a
script.  Exit 0 when every asked-for cache has figures; 1 when one has none (not running,
or not written yet) or its file is unreadable; 2 for a bad agent.toml or dataset name."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import msgspec

from metalguard.agent.cache.stats import read_stats, stats_path
from metalguard.proto.telemetry import DatasetCache

DEFAULT_CONFIG = Path("/etc/metalguard/agent.toml")


def main_stats(
    cache_dir: str | None,
    config: Path | None,
    dataset: str | None,
    output_format: str,
) -> int:
    """Print the figures of one cache dir, or of the config's datasets."""
    from metalguard.agent.cache.options import OptionsError, find_dataset, load_cache_section

    targets: list[tuple[str, str]] = []
    if cache_dir is not None:
        targets.append((dataset or "", cache_dir))
    else:
        path = config or DEFAULT_CONFIG
        try:
            section = load_cache_section(path)
            entries = [find_dataset(section, dataset, path)] if dataset else section.datasets
        except OptionsError as e:
            print(f"metalguard: cache stats: {e}", file=sys.stderr)
            return 2
        if not entries:
            print(
                f"metalguard: cache stats: {path} configures no [[cache.datasets]]", file=sys.stderr
            )
            return 2
        targets.extend((d.name, d.cache_dir) for d in entries)

    found: list[DatasetCache] = []
    code = 0
    for name, directory in targets:
        path = stats_path(directory)
        try:
            found.append(read_stats(path))
        except FileNotFoundError:
            label = f"{name}: " if name else ""
            print(
                f"{label}no figures: {path} is missing (the cache is not running, or has "
                "not written it yet)",
                file=sys.stderr,
            )
            code = 1
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
            print(f"{path}: unreadable: {e}", file=sys.stderr)
            code = 1
    if output_format == "json":
        body = found[0] if cache_dir is not None and found else found
        if found or cache_dir is None:
            sys.stdout.write(msgspec.json.format(msgspec.json.encode(body).decode()) + "\n")
    else:
        now = time.time()
        print("\n\n".join(render(s, now) for s in found))
    return code


def render(s: DatasetCache, now: float) -> str:
    """One cache's figures as aligned lines."""
    alive = _alive(s.pid)
    state = "running" if alive else "not running (figures as of its last write)"
    age = f"{max(now - s.ts, 0.0):.1f} s ago" if s.ts > 0 else "never"
    accesses = s.hits + s.misses
    ratio = f" ({s.hits / accesses:.1%} of {accesses} file reads)" if accesses else ""
    share = f" ({s.used_bytes / s.max_bytes:.1%})" if s.max_bytes else ""
    dataset = f", dataset {human(s.dataset_bytes)} seen" if s.dataset_bytes else ""
    reason = f" ({s.policy_reason})" if s.policy_reason else ""
    rows = [
        ("source", s.source or "-"),
        ("mountpoint", s.mountpoint or "-"),
        ("cache dir", s.cache_dir or "-"),
        ("policy", f"{s.policy or '-'}{reason}"),
        ("pattern", s.pattern or "- (not enough reads yet)"),
        (
            "occupancy",
            f"{human(s.used_bytes)} of {human(s.max_bytes)}{share} in {s.cached_files} files"
            f"{dataset}",
        ),
        ("hits", f"{s.hits}{ratio}, misses {s.misses}"),
        (
            "bytes",
            f"{human(s.bytes_from_cache)} from cache, {human(s.bytes_from_source)} from source",
        ),
        (
            "churn",
            f"{s.evictions} evictions, {s.prefetched} prefetched, "
            f"{s.passthrough_reads} reads passed through",
        ),
        ("warnings", f"{s.warnings}" + (f" (last: {s.last_warning})" if s.last_warning else "")),
    ]
    width = max(len(k) for k, _ in rows)
    head = f"{s.dataset}: {state}, pid {s.pid}, written {age}"
    return "\n".join([head, *(f"  {k.ljust(width)}  {v}" for k, v in rows)])


def human(n: int) -> str:
    """Bytes in binary units: ``1536`` -> ``1.5 KiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
