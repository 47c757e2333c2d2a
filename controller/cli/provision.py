"""``metalguard provision images|instances|volumes ...`` over the HTTP API
(docs/provisioning.md).

- ``images list|add|show|delete``: the region's base images; ``add NAME --dir DIR``
  builds one from a directory of the storage host, ``add NAME --file FILE`` uploads a
  qcow2 or raw file;
- ``instances list|create|show|switch|release|replace``: tenants' bare-metal nodes;
  ``--wait`` (create, switch, release, replace) follows the instance until it is active,
  released or failed;
- ``volumes list|delete``: the tenants' copy-on-write volumes;
- ``nodes list|clear``: the nodes provisioning may deploy (MAC, state, tenant, failed
  deploys); ``clear NODE`` lets a node flagged after failed deploys be deployed again.

Same options and exit statuses as the other operator commands (controller/cli/ops.py):
0 done; 2 a usage error, a 4xx answer, or a 502/504 (the node's BMC or the storage
refused or did not answer: the request could not be carried out) — the server's message
printed, an invalid request's reasons one per line; 1 the API unreachable, another 5xx
answer, or with ``--wait`` a deploy that failed or did not settle in ``--timeout``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeAlias
from urllib.parse import quote

from metalguard.controller.cli.console import CliError, guarded, print_json, table
from metalguard.controller.cli.http import ApiClient, api_options

REFUSALS = frozenset({502, 504})
"""The service's answers that a BMC or the storage refused or did not answer: the request
could not be carried out (exit 2 with the message, like a 4xx)."""
SETTLED = frozenset({"active", "released", "deploy_failed"})
"""States an instance stays in by itself (``--wait`` ends there)."""
POLL_S = 0.5
DEFAULT_WAIT_S = 600.0
IMAGE_TIMEOUT_S = 3600.0
"""How long ``images add`` waits for the server (a build or an upload's conversion)."""
SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}

Sub: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def add_provision_parser(sub: Sub) -> None:
    """Register ``metalguard provision images|instances|volumes ...``."""
    common = api_options("bearer token (env METALGUARD_TOKEN; changes need an admin token)")
    prov = sub.add_parser(
        "provision",
        help="provisioning: base images, tenants' instances (bare-metal nodes), volumes",
    )
    what = prov.add_subparsers(dest="provision_what", metavar="WHAT", required=True)
    _images(what, common)
    _instances(what, common)
    _volumes(what, common)
    _nodes(what, common)


def _images(what: Sub, common: argparse.ArgumentParser) -> None:
    images = what.add_parser("images", help="the region's base system images")
    act = images.add_subparsers(dest="provision_action", metavar="ACTION", required=True)
    listing = act.add_parser("list", parents=[common], help="every image, by name")
    listing.set_defaults(func=guarded(_images_list))
    add = act.add_parser(
        "add",
        parents=[common],
        help="build an image from a directory of the storage host, or upload a file",
    )
    add.add_argument("name", metavar="NAME")
    source = add.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--dir", dest="directory", help="a directory on the controller's host (absolute)"
    )
    source.add_argument("--file", type=Path, help="a qcow2 or raw image file here to upload")
    add.add_argument(
        "--size", type=parse_size, default=0, help="with --dir: the file system's size (256M, 2G)"
    )
    add.set_defaults(func=guarded(_images_add))
    show = act.add_parser("show", parents=[common], help="one image")
    show.add_argument("name", metavar="NAME")
    show.set_defaults(func=guarded(_images_show))
    delete = act.add_parser("delete", parents=[common], help="remove an image no volume uses")
    delete.add_argument("name", metavar="NAME")
    delete.set_defaults(func=guarded(_images_delete))


def _instances(what: Sub, common: argparse.ArgumentParser) -> None:
    instances = what.add_parser("instances", help="tenants' instances: nodes booted for them")
    act = instances.add_subparsers(dest="provision_action", metavar="ACTION", required=True)
    wait = argparse.ArgumentParser(add_help=False)
    wait.add_argument(
        "--wait", action="store_true", help="follow it until it is active, released or failed"
    )
    wait.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_WAIT_S,
        help=f"with --wait: give up after S seconds (default {DEFAULT_WAIT_S:.0f})",
    )

    listing = act.add_parser("list", parents=[common], help="every instance, oldest first")
    listing.add_argument("--state", default="", help="only these states (comma-separated)")
    listing.add_argument("--tenant", default="")
    listing.add_argument("--node", default="", help="a node handle region.cluster.node")
    listing.set_defaults(func=guarded(_instances_list))

    create = act.add_parser(
        "create", parents=[common, wait], help="boot a node for a tenant from an image"
    )
    create.add_argument("--tenant", required=True)
    create.add_argument("--image", required=True)
    create.add_argument("--node", default="", help="a node handle (default: any available)")
    create.add_argument("--volume", default="", help="boot this existing volume of the tenant")
    create.add_argument("--id", dest="instance_id", default="", help="the instance's id")
    create.add_argument("--user-data", type=Path, help="a script the image runs once booted")
    create.add_argument(
        "--sensitive",
        action="store_true",
        help="only on a node whose DMA isolation is 'isolated' (docs/security.md)",
    )
    create.set_defaults(func=guarded(_instances_create))

    show = act.add_parser("show", parents=[common], help="one instance with its history")
    show.add_argument("instance_id", metavar="ID")
    show.set_defaults(func=guarded(_instances_show))

    switch = act.add_parser(
        "switch",
        parents=[common, wait],
        help="give the instance's node to another tenant (detach, attach, network boot)",
    )
    switch.add_argument("instance_id", metavar="ID")
    switch.add_argument("--tenant", required=True)
    switch.add_argument("--image", required=True)
    switch.add_argument("--volume", default="", help="boot this existing volume of the tenant")
    switch.add_argument("--user-data", type=Path)
    switch.set_defaults(func=guarded(_instances_switch))

    release = act.add_parser(
        "release", parents=[common, wait], help="power the node off and free it"
    )
    release.add_argument("instance_id", metavar="ID")
    release.add_argument(
        "--delete-volume",
        action="store_true",
        help="also delete the tenant's volume (default: kept)",
    )
    release.set_defaults(func=guarded(_instances_release))

    replace = act.add_parser(
        "replace",
        parents=[common, wait],
        help="boot a replacement node on the instance's volume (its node failed)",
    )
    replace.add_argument("instance_id", metavar="ID")
    replace.set_defaults(func=guarded(_instances_replace))


def _volumes(what: Sub, common: argparse.ArgumentParser) -> None:
    volumes = what.add_parser("volumes", help="tenants' copy-on-write root volumes")
    act = volumes.add_subparsers(dest="provision_action", metavar="ACTION", required=True)
    listing = act.add_parser("list", parents=[common], help="every volume, by name")
    listing.add_argument("--tenant", default="")
    listing.set_defaults(func=guarded(_volumes_list))
    delete = act.add_parser(
        "delete", parents=[common], help="delete a volume no live instance boots (its data too)"
    )
    delete.add_argument("name", metavar="NAME")
    delete.set_defaults(func=guarded(_volumes_delete))


def _nodes(what: Sub, common: argparse.ArgumentParser) -> None:
    nodes = what.add_parser("nodes", help="the nodes provisioning may deploy")
    act = nodes.add_subparsers(dest="provision_action", metavar="ACTION", required=True)
    listing = act.add_parser("list", parents=[common], help="every provisioned node, by handle")
    listing.set_defaults(func=guarded(_nodes_list))
    clear = act.add_parser(
        "clear", parents=[common], help="clear a node flagged after failed deploys"
    )
    clear.add_argument("node", metavar="NODE", help="a node handle region.cluster.node")
    clear.set_defaults(func=guarded(_nodes_clear))


# --- images ------------------------------------------------------------------------------


def _images_list(args: argparse.Namespace) -> int:
    body = _api(args).get("/v1/images")
    if args.format == "json":
        return print_json(body)
    rows = [
        [
            i["name"],
            i["format"],
            human_bytes(i["size_bytes"]),
            human_bytes(i["virtual_size"]),
            i["sha256"][:12],
            i["source"],
        ]
        for i in body["images"]
    ]
    print(table(["NAME", "FORMAT", "SIZE", "DISK", "SHA256", "SOURCE"], rows))
    return 0


def _images_add(args: argparse.Namespace) -> int:
    api = _api(args)
    if args.file is not None:
        path: Path = args.file
        try:
            with path.open("rb") as f:
                size = path.stat().st_size
                body = api.upload("/v1/images", f, size, {"name": args.name}, IMAGE_TIMEOUT_S)
        except OSError as exc:
            raise CliError(f"cannot read {path}: {exc}", 2) from None
    else:
        doc = {"name": args.name, "directory": args.directory, "size_bytes": args.size}
        body = api.request("POST", "/v1/images", body=_json(doc), timeout=IMAGE_TIMEOUT_S)
    if args.format == "json":
        return print_json(body)
    print(f"image {body['name']}: {human_bytes(body['size_bytes'])} ({body['source']})")
    return 0


def _images_show(args: argparse.Namespace) -> int:
    body = _api(args).get(f"/v1/images/{_seg(args.name)}")
    if args.format == "json":
        return print_json(body)
    rows = [
        ["name", body["name"]],
        ["format", body["format"]],
        ["size", f"{human_bytes(body['size_bytes'])} on the storage host"],
        ["disk", human_bytes(body["virtual_size"])],
        ["sha256", body["sha256"]],
        ["source", body["source"]],
        ["created", _when(body["created_ts"])],
    ]
    print(table([], rows))
    return 0


def _images_delete(args: argparse.Namespace) -> int:
    body = _api(args).delete(f"/v1/images/{_seg(args.name)}")
    if args.format == "json":
        return print_json(body)
    print(f"image {body['name']} deleted")
    return 0


# --- instances ---------------------------------------------------------------------------


def _instances_list(args: argparse.Namespace) -> int:
    query = {k: getattr(args, k) for k in ("state", "tenant", "node") if getattr(args, k)}
    body = _api(args).get("/v1/instances", query or None)
    if args.format == "json":
        return print_json(body)
    rows = [
        [
            i["instance_id"],
            i["tenant"],
            i["image"],
            i["state"],
            i["node"],
            i["volume"],
            str(i["attempts"]),
            i["error"],
        ]
        for i in body["instances"]
    ]
    headers = ["ID", "TENANT", "IMAGE", "STATE", "NODE", "VOLUME", "ATTEMPTS", "ERROR"]
    print(table(headers, rows))
    return 0


def _instances_create(args: argparse.Namespace) -> int:
    doc: dict[str, Any] = {"tenant": args.tenant, "image": args.image}
    for key in ("node", "volume", "instance_id"):
        if getattr(args, key):
            doc[key] = getattr(args, key)
    if args.user_data is not None:
        doc["user_data"] = _read_text(args.user_data)
    if args.sensitive:
        doc["sensitive"] = True
    api = _api(args)
    body = api.post("/v1/instances", doc)
    return _done(args, api, body, "create")


def _instances_show(args: argparse.Namespace) -> int:
    body = _api(args).get(f"/v1/instances/{_seg(args.instance_id)}")
    if args.format == "json":
        return print_json(body)
    print(describe(body))
    return 0


def _instances_switch(args: argparse.Namespace) -> int:
    doc: dict[str, Any] = {"tenant": args.tenant, "image": args.image}
    if args.volume:
        doc["volume"] = args.volume
    if args.user_data is not None:
        doc["user_data"] = _read_text(args.user_data)
    api = _api(args)
    body = api.post(f"/v1/instances/{_seg(args.instance_id)}/switch", doc)
    return _done(args, api, body, "switch")


def _instances_release(args: argparse.Namespace) -> int:
    api = _api(args)
    keep = "false" if args.delete_volume else "true"
    body = api.request(
        "DELETE", f"/v1/instances/{_seg(args.instance_id)}", query={"keep_volume": keep}
    )
    return _done(args, api, body, "release")


def _instances_replace(args: argparse.Namespace) -> int:
    api = _api(args)
    body = api.post(f"/v1/instances/{_seg(args.instance_id)}/replace", {})
    return _done(args, api, body, "replace")


def _done(args: argparse.Namespace, api: ApiClient, body: dict[str, Any], verb: str) -> int:
    """Print the answer (after following it with ``--wait``); the exit status."""
    if args.wait:
        body = follow(
            lambda: api.get(f"/v1/instances/{_seg(body['instance_id'])}"),
            body,
            args.timeout,
            progress=None if args.format == "json" else _progress,
        )
    if args.format == "json":
        print_json(body)
    else:
        print(line(body))
    if not args.wait:
        return 0
    if body["state"] == "deploy_failed":
        raise CliError(f"{verb} of {body['instance_id']} failed: {body['error']}", 1)
    if body["state"] not in SETTLED:
        raise CliError(f"{body['instance_id']} still {body['state']} after {args.timeout:.0f} s", 1)
    return 0


def follow(
    fetch: Callable[[], dict[str, Any]],
    body: dict[str, Any],
    timeout_s: float,
    *,
    progress: Callable[[dict[str, Any]], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """``body`` fetched again until its state is settled or ``timeout_s`` passed;
    ``progress`` is told each new state."""
    end = clock() + timeout_s
    seen = body["state"]
    while body["state"] not in SETTLED and clock() < end:
        sleep(POLL_S)
        body = fetch()
        if body["state"] != seen and progress is not None:
            progress(body)
        seen = body["state"]
    return body


def _progress(body: dict[str, Any]) -> None:
    print(f"metalguard: {body['instance_id']} {body['state']}", file=sys.stderr, flush=True)


def line(body: dict[str, Any]) -> str:
    """One instance as one line: id, state, tenant, image, node, volume."""
    text = (
        f"{body['instance_id']}: {body['state']} (tenant {body['tenant']}, image "
        f"{body['image']}, node {body['node'] or '-'}, volume {body['volume']})"
    )
    return text + (f": {body['error']}" if body.get("error") else "")


def describe(body: dict[str, Any]) -> str:
    """One instance as lines: its figures, its ready report, then its history."""
    ready = body.get("ready_report") or {}
    rows = [
        ["id", body["instance_id"]],
        ["state", body["state"] + (f" ({body['error']})" if body["error"] else "")],
        ["tenant", body["tenant"]],
        ["image", body["image"]],
        ["volume", body["volume"]],
        ["node", body["node"] or "-"],
        ["attempts", str(body["attempts"])],
        ["ready", _when(body["ready_ts"]) if body.get("ready_ts") else "-"],
        ["user data", f"{body['user_data_bytes']} bytes" if body["user_data_bytes"] else "-"],
        ["created", _when(body["created_ts"])],
    ]
    text = table([], rows)
    if ready:
        text += "\n\nready report:\n" + table([], [[k, v] for k, v in sorted(ready.items())], 2)
    history = [
        [_clock(h["ts"]), h["state"], h.get("node") or "-", h.get("reason") or ""]
        for h in body.get("history", [])
    ]
    if history:
        text += "\n\nhistory:\n" + table(["TIME", "STATE", "NODE", "REASON"], history, indent=2)
    return text


# --- volumes -----------------------------------------------------------------------------


def _volumes_list(args: argparse.Namespace) -> int:
    body = _api(args).get("/v1/volumes", {"tenant": args.tenant} if args.tenant else None)
    if args.format == "json":
        return print_json(body)
    rows = [
        [v["name"], v["tenant"], v["image"], human_bytes(v["size_bytes"]), v["instance"] or "-"]
        for v in body["volumes"]
    ]
    print(table(["NAME", "TENANT", "IMAGE", "SIZE", "INSTANCE"], rows))
    return 0


def _volumes_delete(args: argparse.Namespace) -> int:
    body = _api(args).delete(f"/v1/volumes/{_seg(args.name)}")
    if args.format == "json":
        return print_json(body)
    print(f"volume {body['name']} deleted (tenant {body['tenant']})")
    return 0


# --- nodes -------------------------------------------------------------------------------


def _nodes_list(args: argparse.Namespace) -> int:
    body = _api(args).get("/v1/provision/nodes")
    if args.format == "json":
        return print_json(body)
    rows = [
        [
            n["node"],
            n["mac"],
            n["grade"] or "-",
            n["state"] + (" (flagged)" if n["flagged"] else ""),
            n["instance_id"],
            n["tenant"],
            str(n["failures"]),
        ]
        for n in body["nodes"]
    ]
    print(table(["NODE", "MAC", "GRADE", "STATE", "INSTANCE", "TENANT", "FAILURES"], rows))
    return 0


def _nodes_clear(args: argparse.Namespace) -> int:
    body = _api(args).post(f"/v1/provision/nodes/{_seg(args.node)}/clear", {})
    if args.format == "json":
        return print_json(body)
    print(f"{body['node']}: {body['state']}, failures {body['failures']}, not flagged")
    return 0


# --- helpers (pure but for the files) ------------------------------------------------------


def parse_size(text: str) -> int:
    """``256M``, ``2G``, ``1GiB``, ``4096``: bytes (binary units); ArgumentTypeError else."""
    m = SIZE_RE.match(text)
    if m is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 512M, 2G)")
    unit = (m.group(2) or "").upper()[:1]
    return int(m.group(1)) * UNITS[unit if unit != "B" else ""]


def human_bytes(n: int | None) -> str:
    """Bytes as people read them: ``512 B``, ``196 KiB``, ``1.5 GiB``."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _read_text(path: Path) -> str:
    try:
        return sys.stdin.read() if str(path) == "-" else path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"cannot read {path}: {exc}", 2) from None


def _json(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc).encode()


def _when(ts: float | None) -> str:
    if not ts:
        return "-"
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _clock(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%H:%M:%S")


def _seg(text: str) -> str:
    return quote(text, safe="")


def _api(args: argparse.Namespace) -> ApiClient:
    return ApiClient.from_args(args, invalid="invalid request", refusals=REFUSALS)
