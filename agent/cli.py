"""The ``metalguard agent`` subcommands.  Cheap to import: argparse only."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_agent_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``agent run`` and ``agent collect`` to the top-level parser."""
    agent = sub.add_parser("agent", help="the node agent")
    agent_sub = agent.add_subparsers(dest="agent_command", metavar="ACTION", required=True)

    run = agent_sub.add_parser("run", help="run the agent service (systemd Type=notify)")
    run.add_argument("--config", type=Path, required=True, help="agent TOML config file")
    run.set_defaults(func=_run)

    collect = agent_sub.add_parser("collect", help="collect one TelemetryBatch and print it")
    collect.add_argument(
        "--once", action="store_true", default=True, help="collect once and exit (the default)"
    )
    collect.add_argument("--config", type=Path, default=None, help="agent TOML config file")
    collect.add_argument("--sysfs", type=Path, default=None, help="sysfs root (default: /sys)")
    collect.add_argument("--procfs", type=Path, default=None, help="procfs root (default: /proc)")
    collect.add_argument(
        "--smart-json-dir",
        type=Path,
        default=None,
        help="read saved `smartctl --json` outputs from DIR instead of running smartctl",
    )
    collect.add_argument(
        "--collectors",
        default=None,
        help="comma-separated collectors to run (default: the config's, else all enabled)",
    )
    collect.add_argument("--format", choices=("json", "text"), default="json")
    collect.set_defaults(func=_collect)


def _run(args: argparse.Namespace) -> int:
    from agent.service import main_run

    return main_run(args.config)


def _collect(args: argparse.Namespace) -> int:
    from agent.oneshot import main_collect

    return main_collect(
        config_path=args.config,
        sysfs=args.sysfs,
        procfs=args.procfs,
        smart_json_dir=args.smart_json_dir,
        collectors=args.collectors,
        output_format=args.format,
    )
