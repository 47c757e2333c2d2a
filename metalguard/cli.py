"""The ``metalguard`` command: one entry point, a subcommand per role.

This module is the composition root.  It stays cheap to import: each subcommand's
implementation is imported only when that subcommand runs.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from metalguard import __version__

LOG_LEVELS = ("debug", "info", "warning", "error")


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (every level has --help)."""
    parser = argparse.ArgumentParser(
        prog="metalguard",
        description="Keeps bare-metal AI training clusters healthy.",
    )
    parser.add_argument("--version", action="version", version=f"metalguard {__version__}")
    parser.add_argument(
        "--log-level", choices=LOG_LEVELS, default="info", help="logging level (default: info)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    from metalguard.agent.cache.cli import add_cache_parser
    from metalguard.agent.cli import add_agent_parser
    from metalguard.controller.cli.creds import add_creds_parser
    from metalguard.controller.cli.jobs import add_jobs_parser
    from metalguard.controller.cli.ops import add_ops_parsers
    from metalguard.controller.cli.provision import add_provision_parser
    from metalguard.controller.cli.qos import add_qos_parser
    from metalguard.controller.cli.tenants import add_tenants_parser
    from metalguard.twin.cli import add_twin_parser

    add_agent_parser(sub)
    add_cache_parser(sub)
    _add_controller_parser(sub)
    add_ops_parsers(sub)
    add_creds_parser(sub)
    add_qos_parser(sub)
    add_jobs_parser(sub)
    add_tenants_parser(sub)
    add_provision_parser(sub)
    _add_demo_parser(sub)
    add_twin_parser(sub)
    _add_slurm_bridge_parser(sub)
    return parser


def _add_controller_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    ctl = sub.add_parser("controller", help="the region controller")
    ctl_sub = ctl.add_subparsers(dest="controller_command", metavar="ACTION", required=True)
    setup = ctl_sub.add_parser(
        "setup", help="create the streams and KV buckets of the design (idempotent)"
    )
    setup.add_argument(
        "--nats",
        default="nats://127.0.0.1:4222",
        help="NATS server URL, or a cluster's URLs comma-separated",
    )
    setup.add_argument("--prefix", default="mg", help="subject prefix (default: mg)")
    setup.add_argument("--replicas", type=int, default=1, help="stream replicas (R3 in production)")
    setup.add_argument(
        "--config",
        help="take the server, prefix, credentials and TLS from this controller TOML's [nats] "
        "(then --nats and --prefix are ignored)",
    )
    setup.set_defaults(func=_run_controller_setup)
    run = ctl_sub.add_parser("run", help="run the region controller (until SIGTERM or SIGINT)")
    run.add_argument(
        "--config", required=True, help="the controller's TOML file (docs/controller.md)"
    )
    run.set_defaults(func=_run_controller)


def _add_demo_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    demo = sub.add_parser(
        "demo",
        help="run the demo: embedded NATS, a controller and a simulated fleet playing faults",
    )
    demo.add_argument("--duration", type=float, default=None, help="stop by itself after S seconds")
    demo.add_argument(
        "--regions",
        type=int,
        default=None,
        help="regions, one controller each (default 2; with --scenario: the highest it names)",
    )
    demo.add_argument("--clusters", type=int, default=1, help="clusters per region (default 1)")
    demo.add_argument("--racks", type=int, default=4, help="racks of simulated nodes (default 4)")
    demo.add_argument(
        "--nodes-per-rack", type=int, default=8, help="simulated nodes per rack (default 8)"
    )
    demo.add_argument(
        "--interval", type=float, default=1.0, help="agents' collection interval (default 1 s)"
    )
    demo.add_argument(
        "--scenario",
        type=Path,
        default=None,
        help="fault scenario TOML (default: scenarios/default.toml when present)",
    )
    demo.add_argument(
        "--report", type=Path, default=None, help="write nodes, faults and events as JSON"
    )
    demo.add_argument(
        "--headless",
        action="store_true",
        help="no browser to wait for: run --duration (default 120 s) and exit",
    )
    demo.add_argument(
        "--http",
        default="127.0.0.1:8480",
        type=_listen_address,
        help="API listen address, host:port or [v6]:port (a free port if taken)",
    )
    demo.add_argument("--prefix", default="mg", help="subject prefix (default: mg)")
    demo.set_defaults(func=_run_demo)


def _listen_address(text: str) -> str:
    """``--http``: checked like ``[http] listen`` (argparse exits 2 with the problem)."""
    from metalguard.proto.addresses import AddressError, parse_listen

    try:
        parse_listen(text)
    except AddressError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _run_controller_setup(args: argparse.Namespace) -> int:
    import asyncio

    from metalguard.controller.setup import setup_streams

    if not args.config:
        return asyncio.run(setup_streams(args.nats, args.prefix, args.replicas))
    from metalguard.controller.config import ConfigError, load_config
    from metalguard.controller.service import connect_options

    try:
        cfg = load_config(Path(args.config))
        options = connect_options(cfg.nats)
    except (ConfigError, ValueError) as exc:
        print(f"metalguard: {exc}", file=sys.stderr)
        return 2
    options.pop("error_cb", None)
    return asyncio.run(setup_streams("", cfg.nats.prefix, args.replicas, options))


def _run_controller(args: argparse.Namespace) -> int:
    import asyncio

    from metalguard.controller.service import run_controller

    return asyncio.run(run_controller(Path(args.config)))


def _add_slurm_bridge_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bridge = sub.add_parser(
        "slurm-bridge",
        help="drive a Slurm cluster from the controller's decisions (docs/slurm.md)",
    )
    bridge.add_argument("--config", required=True, help="the bridge's TOML file (docs/slurm.md)")
    bridge.set_defaults(func=_run_slurm_bridge)


def _run_slurm_bridge(args: argparse.Namespace) -> int:
    import asyncio

    from metalguard.controller.slurm.service import run_bridge

    return asyncio.run(run_bridge(Path(args.config)))


def _run_demo(args: argparse.Namespace) -> int:
    import asyncio

    from metalguard.demo.run import DemoOptions, run_demo
    from metalguard.proto.documents import DocumentError

    if args.racks < 1 or args.nodes_per_rack < 1 or args.interval <= 0:
        print(
            "metalguard: --racks, --nodes-per-rack and --interval must be positive", file=sys.stderr
        )
        return 2
    if (args.regions is not None and args.regions < 1) or args.clusters < 1:
        print("metalguard: --regions and --clusters must be positive", file=sys.stderr)
        return 2
    options = DemoOptions(
        duration_s=args.duration,
        prefix=args.prefix,
        regions=args.regions,
        clusters=args.clusters,
        racks=args.racks,
        nodes_per_rack=args.nodes_per_rack,
        interval_s=args.interval,
        scenario=args.scenario,
        report=args.report,
        headless=args.headless,
        http=args.http,
    )
    try:
        return asyncio.run(run_demo(options))
    except DocumentError as exc:
        print(f"metalguard: {exc}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        code: int = args.func(args)
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
