"""``metalguard qos show`` and ``metalguard qos apply``: flow-control profiles over the
HTTP API (docs/qos.md, docs/api.md).

Same options and exit statuses as the other operator commands (controller/cli/ops.py):
0 done; 2 a usage error or a 4xx answer (an invalid profile's reasons printed one per
line); 1 the API unreachable or a 5xx answer.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any
from urllib.parse import quote

from metalguard.controller.cli.console import CliError, guarded, print_json, table
from metalguard.controller.cli.http import ApiClient, api_options

CONTENT_TYPES = {".json": "application/json"}
"""By file suffix; anything else is sent as TOML."""


def add_qos_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``metalguard qos show|apply``."""
    common = api_options("bearer token (env METALGUARD_TOKEN; apply needs an admin token)")
    common.add_argument("--node", default=None, help="a node's override instead of the cluster's")

    qos = sub.add_parser("qos", help="flow-control (PFC, queues, ECN) profiles")
    qos_sub = qos.add_subparsers(dest="qos_command", metavar="ACTION", required=True)
    show = qos_sub.add_parser(
        "show", parents=[common], help="the profile of a cluster (or what a node applies)"
    )
    show.add_argument("cluster", metavar="CLUSTER")
    show.add_argument("--history", action="store_true", help="also list the kept revisions")
    show.set_defaults(func=guarded(_show))
    apply = qos_sub.add_parser(
        "apply", parents=[common], help="store a new version of a profile (TOML or JSON file)"
    )
    apply.add_argument("cluster", metavar="CLUSTER")
    apply.add_argument("file", metavar="FILE", help="the profile (.toml or .json; - for stdin)")
    apply.set_defaults(func=guarded(_apply))


def _path(args: argparse.Namespace) -> str:
    path = f"/v1/qos/{quote(args.cluster, safe='')}"
    return path + (f"/nodes/{quote(args.node, safe='')}" if args.node else "")


def _show(args: argparse.Namespace) -> int:
    path = _path(args) + ("?history=1" if args.history else "")
    body = _api(args).get(path)
    if args.format == "json":
        return print_json(body)
    print(summary(body))
    if args.history:
        rows = [[h["revision"], h["version"]] for h in body.get("history", [])]
        print("\nhistory:")
        print(table(["REVISION", "VERSION"], rows, indent=2))
    return 0


def _apply(args: argparse.Namespace) -> int:
    try:
        data = sys.stdin.buffer.read() if args.file == "-" else Path(args.file).read_bytes()
    except OSError as exc:
        raise CliError(f"cannot read {args.file}: {exc.strerror or exc}", 2) from None
    content_type = CONTENT_TYPES.get(Path(args.file).suffix.lower(), "application/toml")
    body = _api(args).put(_path(args), data, content_type)
    if args.format == "json":
        return print_json(body)
    before = body.get("previous_version")
    was = "new" if before is None else f"was version {before}"
    print(f"{body['key']}: version {body['version']} stored ({was}), revision {body['revision']}")
    return 0


def summary(body: dict[str, Any]) -> str:
    """A stored profile as a few lines: where, which version, its traffic classes."""
    p = body["profile"]
    rows = [
        ["key", f"{body['key']} ({body['source']} profile)"],
        ["version", str(body["version"])],
        ["revision", str(body["revision"])],
        ["trust", p.get("trust", "dscp")],
        ["pfc priorities", ",".join(map(str, p.get("pfc_priorities", []))) or "-"],
        ["dscp map", _dscp_map(p.get("dscp_map", {}))],
    ]
    text = table([], rows)
    classes = [
        [
            tc["name"],
            ",".join(map(str, tc["priorities"])),
            f"{tc['bandwidth_percent']:g}%",
            "yes" if tc.get("strict") else "-",
            _ecn(tc.get("ecn")),
        ]
        for tc in p.get("traffic_class", [])
    ]
    if classes:
        text += "\n\ntraffic classes:\n"
        text += table(["NAME", "PRIORITIES", "SHARE", "STRICT", "ECN"], classes, indent=2)
    return text


def _dscp_map(mapping: dict[str, int]) -> str:
    pairs = sorted(((int(k), v) for k, v in mapping.items()))
    return " ".join(f"{d}->{p}" for d, p in pairs) or "-"


def _ecn(ecn: dict[str, Any] | None) -> str:
    if not ecn:
        return "-"
    return f"{ecn['min_kb']}-{ecn['max_kb']} KB p={ecn.get('probability', 1.0):g}"


def _api(args: argparse.Namespace) -> ApiClient:
    return ApiClient.from_args(args, invalid="invalid QoS profile")
