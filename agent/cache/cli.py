"""``metalguard cache mount`` and ``metalguard cache stats`` (docs/cache.md).

Cheap to import (argparse only): the work is imported when a subcommand runs.  Exit
statuses: 0 done; 2 a bad input (arguments, agent.toml, the source, the cache dir, the
mountpoint), with one line on stderr naming it; 1 a failure at run time (the FUSE
session could not start; ``stats``: no figures to show).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

DEFAULT_CONFIG = "/etc/metalguard/agent.toml"
_UNITS = {
    "": 1,
    "k": 1024,
    "m": 1024**2,
    "g": 1024**3,
    "t": 1024**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str) -> int:
    """A byte count: ``1048576``, ``512M``/``512MiB`` (powers of 1024), ``2GB`` (of 1000).

    ValueError naming the text for anything else, or a negative or fractional byte."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a byte count (e.g. 1048576, 512M, 50GiB, 2TB)")
    value = float(match.group(1)) * _UNITS[unit]
    if value != int(value):
        raise ValueError(f"{text!r} is not a whole number of bytes")
    return int(value)


def _bytes_arg(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _seconds_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: seconds must be >= 0")
    return value


def add_cache_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``metalguard cache mount|stats``."""
    cache = sub.add_parser("cache", help="the node-local dataset cache (docs/cache.md)")
    cache_sub = cache.add_subparsers(dest="cache_command", metavar="ACTION", required=True)

    mount = cache_sub.add_parser(
        "mount",
        help="mount a dataset's cache with FUSE (runs until SIGTERM)",
        description="Present the source's files read-only at --mountpoint, serving reads "
        "from the cache in --cache-dir and filling it from the source on a miss. Give "
        "--source, --mountpoint, --cache-dir and --max-bytes, or --config and --dataset "
        "(a [[cache.datasets]] entry of agent.toml; flags given as well override it).",
    )
    mount.add_argument("--config", type=Path, default=None, help="agent TOML ([cache])")
    mount.add_argument("--dataset", default=None, help="the [[cache.datasets]] name")
    mount.add_argument("--source", default=None, help="a path or an fsspec URL (s3://, ...)")
    mount.add_argument("--mountpoint", default=None, help="an existing empty directory")
    mount.add_argument("--cache-dir", default=None, help="the cache's directory (NVMe)")
    mount.add_argument(
        "--max-bytes", type=_bytes_arg, default=None, help="the cache's size bound (e.g. 500G)"
    )
    mount.add_argument(
        "--policy", choices=("auto", "lru", "pin"), default=None, help="default: auto"
    )
    mount.add_argument(
        "--min-free-bytes",
        type=_bytes_arg,
        default=None,
        help="free space kept on the cache's disk (default 1 GiB)",
    )
    mount.add_argument(
        "--metadata-ttl",
        type=_seconds_arg,
        default=None,
        help="seconds a listing of the source is trusted (default 30)",
    )
    mount.add_argument(
        "--stats-interval",
        type=_seconds_arg,
        default=None,
        help="seconds between stats.json writes (default: [cache] stats_interval_s, 2)",
    )
    mount.set_defaults(func=_mount)

    stats = cache_sub.add_parser(
        "stats",
        help="a cache's figures (its stats.json)",
        description="Print the figures a running cache last wrote: of --cache-dir, or of "
        "every [[cache.datasets]] entry of --config (one with --dataset).",
    )
    where = stats.add_mutually_exclusive_group()
    where.add_argument("--cache-dir", default=None, help="the cache's directory")
    where.add_argument(
        "--config", type=Path, default=None, help=f"agent TOML (default {DEFAULT_CONFIG})"
    )
    stats.add_argument("--dataset", default=None, help="only this [[cache.datasets]] name")
    stats.add_argument("--format", choices=("text", "json"), default="text")
    stats.set_defaults(func=_stats)


def _mount(args: argparse.Namespace) -> int:
    from metalguard.agent.cache.options import OptionsError, mount_options

    try:
        options = mount_options(args)
    except OptionsError as e:
        print(f"metalguard: cache mount: {e}", file=sys.stderr)
        return 2
    from metalguard.agent.cache.mount import main_mount

    return main_mount(options)


def _stats(args: argparse.Namespace) -> int:
    from metalguard.agent.cache.show import main_stats

    return main_stats(
        cache_dir=args.cache_dir,
        config=args.config,
        dataset=args.dataset,
        output_format=args.format,
    )
