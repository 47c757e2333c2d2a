"""``metalguard creds init|add-node|add-subscriber|add-controller|federate``: per-process
NATS users (nkeys), the nats-server authorization block (docs/security.md), and the
accounts block of a supercluster (an account per region, docs/federation.md).

Exit status: 0 done; 2 a usage error (bad name, existing user, no credentials directory).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from metalguard.controller.creds.permissions import render_federation
from metalguard.controller.creds.store import CONF_FILE, Added, CredsError, add, init, load


def add_creds_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``metalguard creds ...``."""
    creds = sub.add_parser("creds", help="NATS credentials: nkey users and their permissions")
    creds_sub = creds.add_subparsers(dest="creds_command", metavar="ACTION", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--dir", required=True, type=Path, help="the credentials directory")

    init = creds_sub.add_parser(
        "init", parents=[common], help=f"create the directory, controller users and {CONF_FILE}"
    )
    init.add_argument("--prefix", default="mg", help="subject prefix (default: mg)")
    init.add_argument(
        "--controller",
        action="append",
        default=None,
        metavar="NAME",
        help="a controller user (repeatable; default: one named 'controller')",
    )
    init.add_argument(
        "--strict-qos",
        action="store_true",
        help="nodes may create only filter-checked consumers on the QoS bucket",
    )
    init.set_defaults(func=_init)

    node = creds_sub.add_parser("add-node", parents=[common], help="add a node's user")
    node.add_argument("--node", required=True, metavar="REGION.CLUSTER.NODE")
    node.set_defaults(func=lambda a: _add(a, "node", a.node))
    subscriber = creds_sub.add_parser(
        "add-subscriber", parents=[common], help="add a read-only consumer of the events"
    )
    subscriber.add_argument("--name", required=True)
    subscriber.set_defaults(func=lambda a: _add(a, "subscriber", a.name))
    controller = creds_sub.add_parser(
        "add-controller", parents=[common], help="add a controller's user (e.g. an HA pair's)"
    )
    controller.add_argument("--name", required=True)
    controller.set_defaults(func=lambda a: _add(a, "controller", a.name))
    federate = creds_sub.add_parser(
        "federate",
        help="the accounts block of a supercluster: one account per region's credentials",
    )
    federate.add_argument(
        "--region",
        action="append",
        required=True,
        metavar="REGION=DIR",
        help="a region and its credentials directory (repeat for every region)",
    )
    federate.add_argument("--out", required=True, type=Path, help="the file to write")
    federate.set_defaults(func=_federate)


def _init(args: argparse.Namespace) -> int:
    try:
        added = init(
            args.dir, args.prefix, tuple(args.controller or ["controller"]), args.strict_qos
        )
    except (CredsError, ValueError) as exc:
        print(f"metalguard: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.dir / CONF_FILE} (include it from the server's config)")
    for item in added:
        _report(item)
    return 0


def _add(args: argparse.Namespace, kind: str, name: str) -> int:
    try:
        item = add(args.dir, kind, name)  # type: ignore[arg-type]
    except (CredsError, ValueError) as exc:
        print(f"metalguard: {exc}", file=sys.stderr)
        return 2
    _report(item)
    print(f"updated {args.dir / CONF_FILE}: reload the server (nats-server --signal reload)")
    return 0


def _federate(args: argparse.Namespace) -> int:
    try:
        regions = {}
        for item in args.region:
            region, sep, directory = item.partition("=")
            if not sep or not region or not directory:
                raise ValueError(f"--region {item!r}: expected REGION=DIR")
            if region in regions:
                raise ValueError(f"--region {region} given twice")
            regions[region] = load(Path(directory))
        text = render_federation(regions)
    except (CredsError, ValueError) as exc:
        print(f"metalguard: {exc}", file=sys.stderr)
        return 2
    args.out.write_text(text)
    print(f"wrote {args.out}: include it from every server of every region")
    return 0


def _report(item: Added) -> None:
    print(f"{item.user.kind} {item.user.name}: {item.user.nkey}")
    print(f'  [nats] nkey_seed = "{item.seed_path}"')
    if item.inbox_prefix:
        print(f'  [nats] inbox_prefix = "{item.inbox_prefix}"')
