"""The ``metalguard agent`` subcommands.  Cheap to import: argparse only."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_agent_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``agent run``, ``collect``, ``kmsg`` and ``qos`` to the top-level parser."""
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

    kmsg = agent_sub.add_parser("kmsg", help="the kernel log monitor's rules (docs/kmsg.md)")
    kmsg_sub = kmsg.add_subparsers(dest="kmsg_command", metavar="ACTION", required=True)
    scan = kmsg_sub.add_parser(
        "scan", help="classify /dev/kmsg-format records from a file, one finding per line"
    )
    scan.add_argument("--file", required=True, help="records in /dev/kmsg's format; - for stdin")
    scan.add_argument("--rules", type=Path, default=None, help="your rules (TOML, or NPD JSON)")
    scan.add_argument(
        "--trust-user-records",
        action="store_true",
        help="classify records written from user space too (facility != 0)",
    )
    scan.add_argument("--format", choices=("json", "text"), default="json")
    scan.add_argument(
        "--input",
        choices=("kmsg", "text"),
        default="kmsg",
        help="kmsg: records in /dev/kmsg's format (default); text: one message a line, as "
        "dmesg (-r, -T, -x, --time-format iso), syslog or journalctl (-o short*, -o json) "
        "write them",
    )
    scan.set_defaults(func=_kmsg_scan)
    npd = kmsg_sub.add_parser(
        "import-npd", help="node-problem-detector's kernel-monitor.json as a rules file"
    )
    npd.add_argument("file", type=Path, help="kernel-monitor.json")
    npd.add_argument("--output", type=Path, default=None, help="write here (default: stdout)")
    npd.set_defaults(func=_kmsg_import_npd)

    qos = agent_sub.add_parser("qos", help="flow control on this node (docs/qos.md)")
    qos_sub = qos.add_subparsers(dest="qos_command", metavar="ACTION", required=True)
    qos_apply = qos_sub.add_parser("apply", help="apply a QoS profile file once, locally")
    qos_apply.add_argument("--profile", type=Path, required=True, help="profile (TOML or .json)")
    qos_apply.add_argument(
        "--interface", action="append", default=[], help="only this interface (repeatable)"
    )
    qos_apply.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    qos_apply.add_argument("--config", type=Path, default=None, help="agent TOML config ([qos])")
    qos_apply.add_argument("--netns", default=None, help="network namespace to act in")
    qos_apply.add_argument("--sysfs", default=None, help="sysfs root of the mlx5 knobs")
    qos_apply.set_defaults(func=_qos_apply)


def _run(args: argparse.Namespace) -> int:
    from metalguard.agent.service import main_run

    return main_run(args.config)


def _collect(args: argparse.Namespace) -> int:
    from metalguard.agent.oneshot import main_collect

    return main_collect(
        config_path=args.config,
        sysfs=args.sysfs,
        procfs=args.procfs,
        smart_json_dir=args.smart_json_dir,
        collectors=args.collectors,
        output_format=args.format,
    )


def _kmsg_scan(args: argparse.Namespace) -> int:
    from metalguard.agent.kmsg.scan import main_scan

    return main_scan(
        args.file,
        args.rules,
        trust_user=args.trust_user_records,
        output_format=args.format,
        input_format=args.input,
    )


def _kmsg_import_npd(args: argparse.Namespace) -> int:
    from metalguard.agent.kmsg.scan import main_import_npd

    return main_import_npd(args.file, args.output)


def _qos_apply(args: argparse.Namespace) -> int:
    from metalguard.agent.qos.oneshot import main_apply

    return main_apply(
        profile_path=args.profile,
        interfaces=args.interface,
        dry_run=args.dry_run,
        config_path=args.config,
        netns=args.netns,
        sysfs=args.sysfs,
    )
