"""Operator commands over the HTTP API (docs/api.md): ``metalguard nodes``, ``fleet``, ``node``,
``cordon``, ``uncordon``, ``maintenance`` and ``events``.

Every command takes ``--api URL`` (env ``METALGUARD_API``) and ``--token`` (env
``METALGUARD_TOKEN``).  Exit status: 0 done; 2 a usage error or a 4xx answer (its
message printed); 1 the API unreachable (the URL named) or a 5xx answer.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

from metalguard.controller.cli.console import cell, guarded, print_json, table
from metalguard.controller.cli.http import ApiClient, api_options
from metalguard.proto.base import node_handle

HISTORY_LIMIT = 1000
"""Events printed without --follow when --count is not given."""


def add_ops_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register the operator subcommands."""
    common = api_options()

    nodes = sub.add_parser("nodes", parents=[common], help="list nodes and their grades")
    nodes.add_argument("--grade", help="only these grades (comma-separated)")
    nodes.add_argument("--region")
    nodes.add_argument("--cluster")
    nodes.add_argument("--rack")
    nodes.set_defaults(func=guarded(_nodes))

    fleet = sub.add_parser(
        "fleet", parents=[common], help="every region: grades, GPU capacity, jobs (federation)"
    )
    fleet.set_defaults(func=guarded(_fleet))

    node = sub.add_parser("node", parents=[common], help="one node: score, reasons, history")
    node.add_argument("name", metavar="NAME", help="handle region.cluster.node, or a node name")
    node.set_defaults(func=guarded(_node))

    for action, text in (
        ("cordon", "no new work on a node (running jobs continue)"),
        ("uncordon", "return a node to service"),
        ("maintenance", "put a node in MAINTENANCE until uncordoned"),
    ):
        p = sub.add_parser(action, parents=[common], help=text)
        p.add_argument("name", metavar="NAME", help="handle region.cluster.node, or a node name")
        p.add_argument("--reason", required=True, help="why (recorded and announced)")
        p.add_argument("--who", default=os.environ.get("USER", "cli"), help="operator name")
        p.set_defaults(func=guarded(_act), action=action)

    events = sub.add_parser(
        "events", parents=[common], help="controller decisions: the recent past, or followed"
    )
    events.add_argument(
        "--follow", "-f", action="store_true", help="stream events as they happen (after --since)"
    )
    events.add_argument(
        "--since",
        default="",
        help="from when: all, a duration (90s, 10m, 2h, 1d), an RFC 3339 time or Unix "
        "seconds (default: 1h, or new events only with --follow)",
    )
    events.add_argument("--kind", default="", help="exact kind, or a prefix ending in '.'")
    events.add_argument("--node", default="", help="handle or node name")
    events.add_argument("--count", type=int, default=0, help="stop after N events")
    events.set_defaults(func=guarded(_events))


# --- commands -------------------------------------------------------------------------


def _nodes(args: argparse.Namespace) -> int:
    query = {k: getattr(args, k) for k in ("grade", "region", "cluster", "rack")}
    body = ApiClient.from_args(args).get("/v1/nodes", {k: v for k, v in query.items() if v})
    if args.format == "json":
        return print_json(body["nodes"])
    rows = [
        [
            n["handle"],
            n["grade"],
            f"{n['score']:.1f}",
            _flags(n),
            n["rack"] or "-",
            _first_reason(n["reasons"]),
        ]
        for n in body["nodes"]
    ]
    print(table(["NODE", "GRADE", "SCORE", "FLAGS", "RACK", "REASON"], rows))
    return 0


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g} ms"


def _fleet(args: argparse.Namespace) -> int:
    body = ApiClient.from_args(args).get("/v1/fleet")
    if args.format == "json":
        return print_json(body)
    rows = []
    for r in body["regions"]:
        grades = r.get("grades", {})
        gpus = sum(c["gpus"] for c in r.get("capacity", []))
        healthy = sum(c["healthy_gpus"] for c in r.get("capacity", []))
        rows.append(
            [
                r["region"] + (" (here)" if r["region"] == body["region"] else ""),
                str(r.get("nodes", 0)),
                " ".join(f"{g.lower()} {n}" for g, n in grades.items() if n) or "-",
                f"{healthy}/{gpus}",
                f"{r.get('queued_jobs', 0)}/{r.get('running_jobs', 0)}",
                _ms(r.get("latency_ms")),
                f"{r.get('age_s', 0):.0f}s" + (" STALE" if r.get("stale") else ""),
            ]
        )
    header = ["REGION", "NODES", "GRADES", "GPUS OK", "QUEUED/RUN", "LATENCY", "AGE"]
    print(table(header, rows))
    return 0


def _node(args: argparse.Namespace) -> int:
    body = ApiClient.from_args(args).get(f"/v1/nodes/{quote(args.name, safe='')}")
    if args.format == "json":
        return print_json(body)
    r = body["record"]
    print(
        table(
            [],
            [
                ["node", body["handle"]],
                ["grade", r["grade"]],
                ["score", f"{r['score']:.1f}"],
                ["flags", _flags(r)],
                ["rack", r["rack"] or "-"],
                ["operator", _operator(r)],
                ["last seen", _time(r["last_seen_ts"])],
            ],
        )
    )
    if r["reasons"]:
        print("\nreasons:")
        reasons = [
            [x["signal"], cell(x.get("value")), x.get("rule", ""), x.get("message", "")]
            for x in r["reasons"]
        ]
        print(table(["SIGNAL", "VALUE", "RULE", "MESSAGE"], reasons, indent=2))
    if r["history"]:
        print("\nhistory:")
        history = [
            [_time(h["ts"]), h["grade_from"], h["grade_to"], h["by"], h["message"]]
            for h in r["history"]
        ]
        print(table(["TIME", "FROM", "TO", "BY", "MESSAGE"], history, indent=2))
    return 0


def _act(args: argparse.Namespace) -> int:
    path = f"/v1/nodes/{quote(args.name, safe='')}/{args.action}"
    body = ApiClient.from_args(args).post(path, {"reason": args.reason, "who": args.who})
    if args.format == "json":
        return print_json(body)
    kinds = ", ".join(e["kind"] for e in body["events"])
    done = f"announced {kinds}" if kinds else "nothing changed"
    print(f"{body['handle']}: {args.action}: {done}; grade {body['record']['grade']}")
    return 0


def _events(args: argparse.Namespace) -> int:
    query = {k: v for k, v in (("kind", args.kind), ("node", args.node)) if v}
    if args.since:
        query["since"] = args.since
    api = ApiClient.from_args(args)
    if args.follow:
        stream: Iterable[tuple[str, str]] = api.events("/v1/events", query)
    else:
        limit = str(args.count or HISTORY_LIMIT)
        body = api.get("/v1/events/history", query | {"limit": limit})
        stream = ((e["kind"], json.dumps(e)) for e in body["events"])
    for seen, (kind, data) in enumerate(stream, start=1):
        if args.format == "json":
            print(data, flush=True)
        else:
            e = json.loads(data)
            n = e.get("node")
            where = node_handle(n["region"], n["cluster"], n["node"]) if n else e["region"]
            print(f"{_time(e['ts'])}  {kind:<18} {where:<24} {e['message']}", flush=True)
        if args.count and seen >= args.count:
            break
    return 0


# --- output ---------------------------------------------------------------------------


def _flags(r: dict[str, Any]) -> str:
    flags = [f for f in ("maintenance", "cordoned", "held") if r.get(f)]
    if "maintenance" in flags:
        flags.remove("cordoned")
    return ",".join(flags) or "-"


def _first_reason(reasons: list[dict[str, Any]]) -> str:
    if not reasons:
        return "-"
    first = reasons[0]
    text = first.get("message") or first["signal"]
    return f"{text} (+{len(reasons) - 1})" if len(reasons) > 1 else str(text)


def _operator(r: dict[str, Any]) -> str:
    if not r["operator_by"]:
        return "-"
    return f"{r['operator_by']} since {_time(r['operator_ts'])}: {r['operator_reason']}"


def _time(ts: float | None) -> str:
    if ts is None:
        return "-"
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S")
