"""What ``cache mount`` runs with: its flags, or a ``[[cache.datasets]]`` entry under them."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from metalguard.agent.cache.mount import GIB, MountOptions
from metalguard.agent.config import CacheDataset, CacheSection, ConfigError, load_config
from metalguard.proto.base import DATASET_NAME_PATTERN

_NAME = re.compile(DATASET_NAME_PATTERN)


class OptionsError(Exception):
    """Missing or contradictory options, or a bad agent.toml (exit 2)."""


def load_cache_section(path: Path) -> CacheSection:
    """The ``[cache]`` section of the agent TOML at ``path`` (OptionsError when bad)."""
    try:
        return load_config(path).cache
    except (ConfigError, ValueError) as e:
        raise OptionsError(str(e)) from None


def find_dataset(section: CacheSection, name: str, path: Path) -> CacheDataset:
    """The entry called ``name`` (OptionsError naming the known ones when absent)."""
    for dataset in section.datasets:
        if dataset.name == name:
            return dataset
    known = ", ".join(d.name for d in section.datasets) or "none"
    raise OptionsError(f"{path}: no [[cache.datasets]] named {name!r} (configured: {known})")


def mount_options(args: argparse.Namespace) -> MountOptions:
    """Flags over the config's entry; OptionsError for what is still missing."""
    entry: CacheDataset | None = None
    stats_interval_s = 2.0
    if args.config is not None:
        if not args.dataset:
            raise OptionsError("--config needs --dataset NAME (which [[cache.datasets]] entry)")
        section = load_cache_section(args.config)
        entry = find_dataset(section, args.dataset, args.config)
        stats_interval_s = section.stats_interval_s

    e = entry
    source = args.source or (e.source if e else None)
    mountpoint = args.mountpoint or (e.mountpoint if e else None) or None
    cache_dir = args.cache_dir or (e.cache_dir if e else None)
    max_bytes: int | None = (
        args.max_bytes if args.max_bytes is not None else (e.max_bytes if e else None)
    )
    missing = [
        flag
        for flag, value in (
            ("--source", source),
            ("--mountpoint", mountpoint),
            ("--cache-dir", cache_dir),
            ("--max-bytes", max_bytes),
        )
        if value is None
    ]
    if missing or source is None or mountpoint is None or cache_dir is None or max_bytes is None:
        where = f" (the entry {args.dataset!r} of {args.config} has none)" if e else ""
        raise OptionsError(f"missing {', '.join(missing)}{where}")
    if max_bytes < 1:
        raise OptionsError(f"--max-bytes must be at least 1, not {max_bytes}")
    dataset = args.dataset or os.path.basename(os.path.normpath(mountpoint)) or "dataset"
    if not _NAME.match(dataset):
        raise OptionsError(
            f"dataset name {dataset!r}: letters, digits, '_', '.', '-' (give --dataset NAME)"
        )
    interval = args.stats_interval if args.stats_interval is not None else stats_interval_s
    if interval < 0.1:
        raise OptionsError(f"--stats-interval must be at least 0.1 s, not {interval}")
    min_free = (
        args.min_free_bytes if args.min_free_bytes is not None else (e.min_free_bytes if e else GIB)
    )
    ttl = args.metadata_ttl if args.metadata_ttl is not None else (e.metadata_ttl_s if e else 30.0)
    return MountOptions(
        dataset=dataset,
        source=source,
        mountpoint=mountpoint,
        cache_dir=cache_dir,
        max_bytes=max_bytes,
        policy=args.policy or (e.policy if e else "auto"),
        min_free_bytes=min_free,
        metadata_ttl_s=ttl,
        stats_interval_s=interval,
    )
