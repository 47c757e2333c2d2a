"""``metalguard tenants list|show|set``: tenant quotas over the HTTP API
(docs/scheduler.md "Tenant quotas", docs/api.md).

Same options and exit statuses as the other operator commands (controller/cli/ops.py):
0 done; 2 a usage error or a 4xx answer (an invalid quota's field and problem printed);
1 the API unreachable or a 5xx answer.
"""

from __future__ import annotations

import argparse
import json
from typing import Any
from urllib.parse import quote

from metalguard.controller.cli.console import CliError, guarded, print_json, table
from metalguard.controller.cli.http import ApiClient, api_options


def add_tenants_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``metalguard tenants list|show|set``."""
    common = api_options("bearer token (env METALGUARD_TOKEN; set needs an admin token)")
    tenants = sub.add_parser("tenants", help="tenant quotas: guarantees, borrowing, reclaim")
    tenants_sub = tenants.add_subparsers(dest="tenants_command", metavar="ACTION", required=True)
    listing = tenants_sub.add_parser(
        "list", parents=[common], help="every tenant: guarantee, in use, borrowed, lent, waiting"
    )
    listing.set_defaults(func=guarded(_list))
    show = tenants_sub.add_parser("show", parents=[common], help="one tenant and its quota")
    show.add_argument("name", metavar="NAME")
    show.set_defaults(func=guarded(_show))
    put = tenants_sub.add_parser("set", parents=[common], help="set a tenant's quota")
    put.add_argument("name", metavar="NAME")
    put.add_argument("--gpus", type=int, required=True, help="GPUs guaranteed")
    put.add_argument(
        "--borrow-limit", type=int, default=None, help="GPUs it may use beyond its guarantee"
    )
    put.add_argument(
        "--lend-limit",
        type=int,
        default=None,
        help="GPUs of its unused guarantee others may borrow",
    )
    put.add_argument(
        "--gpu-type",
        action="append",
        default=[],
        metavar="TYPE=N",
        help="a per-GPU-type guarantee (repeat for each type; each part of --gpus)",
    )
    put.set_defaults(func=guarded(_set))


def _list(args: argparse.Namespace) -> int:
    body = _api(args).get("/v1/tenants")
    if args.format == "json":
        return print_json(body)
    rows = [_row(t) for t in body["tenants"]]
    print(table(["TENANT", "GUARANTEE", "IN USE", "BORROWED", "LENT", "WAITING", "QUEUED"], rows))
    print(f"\nfleet: {body['fleet_gpus']} GPUs")
    return 0


def _show(args: argparse.Namespace) -> int:
    body = _api(args).get(f"/v1/tenants/{quote(args.name, safe='')}")
    if args.format == "json":
        return print_json(body)
    print(summary(body))
    return 0


def _set(args: argparse.Namespace) -> int:
    doc: dict[str, Any] = {"gpus": args.gpus, "gpus_by_type": _by_type(args.gpu_type)}
    if args.borrow_limit is not None:
        doc["borrow_limit"] = args.borrow_limit
    if args.lend_limit is not None:
        doc["lend_limit"] = args.lend_limit
    path = f"/v1/tenants/{quote(args.name, safe='')}"
    body = _api(args).put(path, json.dumps(doc).encode(), "application/json")
    if args.format == "json":
        return print_json(body)
    print(summary(body))
    return 0


def _by_type(items: list[str]) -> dict[str, int]:
    """``["h100=64", ...]`` -> ``{"h100": 64}``; CliError (exit 2) for a malformed item."""
    out: dict[str, int] = {}
    for item in items:
        gpu_type, sep, count = item.partition("=")
        if not sep or not gpu_type or not count.strip().lstrip("-").isdigit():
            raise CliError(f"--gpu-type {item!r}: expected TYPE=N (e.g. nvidia-h100=64)", 2)
        out[gpu_type] = int(count)
    return out


def _row(t: dict[str, Any]) -> list[Any]:
    guarantee = t["guarantee"] if t.get("quota") else "- (idle only)"
    return [
        t["name"],
        guarantee,
        t["in_use"],
        t["borrowed"],
        t["lent"],
        t["waiting"],
        t["waiting_jobs"],
    ]


def summary(body: dict[str, Any]) -> str:
    """A tenant's answer as a few lines: its quota and what it holds."""
    usage, quota = body["usage"], body.get("quota")
    rows = [["tenant", usage["name"]]]
    if quota is None:
        rows.append(["quota", "none: its jobs run only on idle capacity"])
    else:
        rows += [
            ["guarantee", f"{quota['gpus']} GPUs"],
            ["by type", _types(quota.get("gpus_by_type") or {})],
            ["borrow limit", _limit(quota.get("borrow_limit"))],
            ["lend limit", _limit(quota.get("lend_limit"))],
        ]
    rows += [
        ["in use", str(usage["in_use"])],
        ["borrowed", str(usage["borrowed"])],
        ["lent", str(usage["lent"])],
        ["waiting", f"{usage['waiting']} GPUs ({usage['waiting_jobs']} jobs)"],
    ]
    return table([], rows)


def _types(by_type: dict[str, int]) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(by_type.items())) or "-"


def _limit(value: int | None) -> str:
    return "none" if value is None else f"{value} GPUs"


def _api(args: argparse.Namespace) -> ApiClient:
    return ApiClient.from_args(args, invalid="invalid quota")
