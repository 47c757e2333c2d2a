"""``metalguard jobs submit|list|show|cancel`` over the HTTP API (docs/jobs.md).

Same options and exit statuses as the other operator commands (controller/cli/ops.py):
0 done; 2 a usage error or a 4xx answer (an invalid job's reasons printed one per line);
1 the API unreachable or a 5xx answer.
"""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

from metalguard.controller.cli.console import CliError, guarded, print_json, table
from metalguard.controller.cli.http import ApiClient, api_options
from metalguard.controller.jobs.spec import JobFileError, JobRejectedError, parse_job
from metalguard.controller.jobs.spec import job_document as read_job_file

SPREADS = ("rack", "cluster", "zone", "region")
FLAG_FIELDS: dict[str, type] = {
    "name": str,
    "tenant": str,
    "nodes": int,
    "min_nodes": int,
    "max_nodes": int,
    "resize_interval_s": float,
    "gpus_per_node": int,
    "gpu_type": str,
    "cpu": int,
    "memory_gb": int,
    "bandwidth_tier": int,
    "max_spread": str,
    "priority": int,
    "command": str,
    "checkpoint_dir": str,
    "checkpoint_every": float,
    "hang_timeout": float,
    "max_restarts": int,
    "dataset": str,
    "timing_window_s": float,
    "total_steps": int,
    "restart_cost_s": float,
}
"""``jobs submit`` flags (``--gpus-per-node``) that set a job key of the same name."""


def add_jobs_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``metalguard jobs submit|list|show|cancel``."""
    common = api_options(
        "bearer token (env METALGUARD_TOKEN; submit and cancel need an admin token)"
    )

    jobs = sub.add_parser("jobs", help="training jobs: submit, list, show, cancel")
    jobs_sub = jobs.add_subparsers(dest="jobs_command", metavar="ACTION", required=True)
    submit = jobs_sub.add_parser(
        "submit",
        parents=[common],
        help="queue a job from a file (TOML or JSON) and/or flags (flags win)",
    )
    submit.add_argument("file", metavar="FILE", nargs="?", help="the job (.toml/.json; - stdin)")
    for key, kind in FLAG_FIELDS.items():
        extra: dict[str, Any] = {"choices": SPREADS} if key == "max_spread" else {}
        submit.add_argument(f"--{key.replace('_', '-')}", dest=key, type=kind, **extra)
    submit.add_argument("--arg", dest="args", action="append", help="one argument (repeat)")
    submit.add_argument("--env", action="append", help="KEY=VALUE (repeat)")
    submit.add_argument("--allowed-region", dest="allowed_regions", action="append")
    submit.add_argument("--preemptible", action="store_true", default=None)
    submit.add_argument("--sensitive", action="store_true", default=None)
    submit.set_defaults(func=guarded(_submit))
    listing = jobs_sub.add_parser("list", parents=[common], help="every job, oldest first")
    listing.add_argument("--state", default="", help="only these states (comma-separated)")
    listing.set_defaults(func=guarded(_list))
    show = jobs_sub.add_parser("show", parents=[common], help="one job with its history")
    show.add_argument("job_id", metavar="ID")
    show.set_defaults(func=guarded(_show))
    cancel = jobs_sub.add_parser("cancel", parents=[common], help="stop and cancel a job")
    cancel.add_argument("job_id", metavar="ID")
    cancel.set_defaults(func=guarded(_cancel))


def job_document(args: argparse.Namespace) -> dict[str, Any]:
    """The job to submit: the file's keys, then the flags given (pure but for the file)."""
    doc: dict[str, Any] = {}
    if args.file:
        doc = _read(args.file)
    for key in FLAG_FIELDS:
        value = getattr(args, key)
        if value is not None:
            doc[key] = value
    for key in ("args", "allowed_regions"):
        if getattr(args, key):
            doc[key] = list(getattr(args, key))
    for key in ("preemptible", "sensitive"):
        if getattr(args, key):
            doc[key] = True
    if args.env:
        env = dict(doc.get("env") or {})
        for item in args.env:
            name, sep, value = item.partition("=")
            if not sep:
                raise CliError(f"--env {item!r}: expected KEY=VALUE", 2)
            env[name] = value
        doc["env"] = env
    return doc


def _read(path: str) -> dict[str, Any]:
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"cannot read {path}: {exc}", 2) from None
    try:
        return read_job_file(text, path)
    except JobFileError as exc:
        raise CliError(_lines(exc), 2) from None


def _lines(exc: JobFileError) -> str:
    """Each reason as ``file: key: problem``, one per line (each line ``metalguard: ``)."""
    return "\nmetalguard: ".join(f"{exc.source}: {reason}" for reason in exc.reasons)


def _submit(args: argparse.Namespace) -> int:
    doc = job_document(args)
    if args.file:  # a bad file is refused here, naming the file, its keys and problems
        try:
            parse_job(doc, 0.0)
        except JobRejectedError as exc:
            raise CliError(_lines(JobFileError(args.file, exc.reasons)), 2) from None
    body = _api(args).post("/v1/jobs", doc)
    if args.format == "json":
        return print_json(body)
    where = f" in {body['region']}" if "region" in body else ""
    print(f"{body['id']}: {body['name']} {body['state']}{where}")
    return 0


def _list(args: argparse.Namespace) -> int:
    path = "/v1/jobs" + (f"?state={quote(args.state)}" if args.state else "")
    body = _api(args).get(path)
    if args.format == "json":
        return print_json(body)
    rows = [
        [
            j["id"],
            j["name"],
            j["state"],
            str(j["priority"]),
            str(j["nodes"]),
            str(j["restarts"]),
            "-" if j["step"] is None else str(j["step"]),
            ",".join(p.rsplit(".", 1)[-1] for p in j["placement"]) or "-",
        ]
        for j in body["jobs"]
    ]
    print(table(["ID", "NAME", "STATE", "PRIO", "NODES", "RESTARTS", "STEP", "PLACEMENT"], rows))
    return 0


def _show(args: argparse.Namespace) -> int:
    body = _api(args).get(f"/v1/jobs/{quote(args.job_id, safe='')}")
    if args.format == "json":
        return print_json(body)
    print(describe(body))
    return 0


def _cancel(args: argparse.Namespace) -> int:
    body = _api(args).delete(f"/v1/jobs/{quote(args.job_id, safe='')}")
    if args.format == "json":
        return print_json(body)
    print(f"{body['id']}: cancel requested (state {body['state']})")
    return 0


def describe(body: dict[str, Any]) -> str:
    """One job as lines: its figures, then its history with reasons."""
    status = body["status"]
    ckpt = status.get("last_checkpoint")
    rows = [
        ["id", body["id"]],
        ["name", body["name"]],
        *([["region", body["region"]]] if "region" in body else []),
        ["state", body["state"] + (f" ({body['reason']})" if body["reason"] else "")],
        ["placement", ", ".join(body["placement"]) or "-"],
        ["restarts", str(body["restarts"])],
        ["checkpoint", f"step {ckpt['step']} {ckpt['path']}" if ckpt else "-"],
        ["resumed from", str(status.get("resumed_from_step") or "-")],
        ["steps redone", str(status.get("steps_redone", 0))],
        ["downtime", f"{status.get('downtime_s', 0.0):.1f} s"],
        ["digest", status.get("digest") or "-"],
    ]
    history = [
        [
            datetime.fromtimestamp(h["ts"], UTC).strftime("%H:%M:%S"),
            h["state"],
            h["reason"],
            "-" if h.get("step") is None else str(h["step"]),
        ]
        for h in status.get("history", [])
    ]
    text = table([], rows)
    if history:
        text += "\n\nhistory:\n" + table(["TIME", "STATE", "REASON", "STEP"], history, indent=2)
    return text


def _api(args: argparse.Namespace) -> ApiClient:
    return ApiClient.from_args(args, invalid="invalid job")
