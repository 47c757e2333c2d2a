"""Pure helpers of the NBD export server: QMP arguments, parsing its replies, the plan.

The daemon names nothing by our export names alone: each export is an NBD export (its
NBD name = the instance's secret export name) with the QMP id ``mg-<name>`` over a
qcow2 block node ``mgv-<hash of the name>`` that opens the volume (and, read-only, its
base).  :func:`plan` compares what the daemon has with what is wanted.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

EXPORT_NAME = re.compile(r"^[A-Za-z0-9_.-]{16,128}\Z")
"""An export name: the secret a node attaches with (at least 16 characters: it is the
only thing between a node and another tenant's volume on the NBD port)."""
EXPORT_ID_PREFIX = "mg-"
NODE_PREFIX = "mgv-"


def check_export_name(name: str) -> str:
    """``name`` if it is a valid export name, else ValueError."""
    if not isinstance(name, str) or not EXPORT_NAME.match(name):
        raise ValueError(
            "invalid export name: 16 to 128 letters, digits, '_', '-' or '.' "
            f"(got {len(name) if isinstance(name, str) else type(name).__name__} characters)"
        )
    return name


def export_id(name: str) -> str:
    """The QMP id of the export ``name`` (a QMP id starts with a letter: ``mg-``)."""
    return EXPORT_ID_PREFIX + name


def name_of_id(export_id_: str) -> str | None:
    """The export name of a QMP export id, None for an id that is not ours."""
    if not export_id_.startswith(EXPORT_ID_PREFIX):
        return None
    return export_id_[len(EXPORT_ID_PREFIX) :]


def node_name(name: str) -> str:
    """The block node of export ``name`` (a node name is at most 31 characters)."""
    return NODE_PREFIX + hashlib.sha256(name.encode()).hexdigest()[:24]


def blockdev_add_args(name: str, volume_path: str) -> dict[str, Any]:
    """``blockdev-add`` arguments opening the overlay at ``volume_path`` read-write.

    Its backing file (the base) is opened by qemu itself from the overlay's header, and
    read-only: writes land in the overlay only.  ``discard: unmap`` lets a guest's trim
    give space back.
    """
    return {
        "driver": "qcow2",
        "node-name": node_name(name),
        "discard": "unmap",
        "file": {"driver": "file", "filename": volume_path, "discard": "unmap"},
    }


def export_add_args(name: str) -> dict[str, Any]:
    """``block-export-add`` arguments: NBD export ``name``, writable."""
    return {
        "type": "nbd",
        "id": export_id(name),
        "node-name": node_name(name),
        "name": name,
        "writable": True,
    }


def export_del_args(name: str) -> dict[str, Any]:
    """``block-export-del``: ``hard`` drops a client still attached (the node is rebooted
    or released: its connection must not keep the volume open)."""
    return {"id": export_id(name), "mode": "hard"}


@dataclass(frozen=True)
class DaemonExport:
    """One export as ``query-block-exports`` lists it."""

    id: str
    node: str
    shutting_down: bool = False


def parse_exports(reply: object) -> list[DaemonExport]:
    """``query-block-exports``'s reply, as DaemonExports (ValueError on a bad shape)."""
    if not isinstance(reply, list):
        raise ValueError(f"query-block-exports: expected a list, got {type(reply).__name__}")
    out = []
    for item in reply:
        if not isinstance(item, dict) or not isinstance(item.get("id"), str):
            raise ValueError(f"query-block-exports: bad entry {item!r}")
        out.append(
            DaemonExport(
                id=item["id"],
                node=str(item.get("node-name", "")),
                shutting_down=bool(item.get("shutting-down", False)),
            )
        )
    return out


def parse_nodes(reply: object) -> dict[str, str]:
    """``query-named-block-nodes``' reply: node name -> the file it opens."""
    if not isinstance(reply, list):
        raise ValueError(f"query-named-block-nodes: expected a list, got {type(reply).__name__}")
    out = {}
    for item in reply:
        if isinstance(item, dict) and isinstance(item.get("node-name"), str):
            out[item["node-name"]] = str(item.get("file", ""))
    return out


@dataclass(frozen=True)
class Plan:
    """What to change in the daemon to serve exactly the wanted exports."""

    remove_exports: tuple[str, ...] = ()
    """QMP ids of exports to delete (not wanted, or over another file than wanted)."""
    remove_nodes: tuple[str, ...] = ()
    """Our block nodes to delete once their export is gone (or that have none)."""
    add: tuple[tuple[str, str], ...] = ()
    """(export name, volume path) to add."""
    keep: tuple[str, ...] = field(default=())
    """Export names already served as wanted."""


def plan(
    exports: Iterable[DaemonExport], nodes: Mapping[str, str], wanted: Mapping[str, str]
) -> Plan:
    """The changes that make the daemon serve ``wanted`` (export name -> volume path).

    An export of ours that is unwanted, shutting down or over another file is removed
    (and re-added when wanted); a foreign export (not ``mg-``) is removed too: the daemon
    is the region's own.  Our nodes that no kept export uses are removed.
    """
    remove: list[str] = []
    keep: list[str] = []
    used_nodes: set[str] = set()
    for exp in sorted(exports, key=lambda e: e.id):
        name = name_of_id(exp.id)
        ok = (
            name is not None
            and not exp.shutting_down
            and name in wanted
            and exp.node == node_name(name)
            and nodes.get(exp.node) == wanted[name]
        )
        if ok and name is not None:
            keep.append(name)
            used_nodes.add(exp.node)
        elif not exp.shutting_down:
            remove.append(exp.id)
    remove_nodes = sorted(n for n in nodes if n.startswith(NODE_PREFIX) and n not in used_nodes)
    add = tuple((n, wanted[n]) for n in sorted(wanted) if n not in keep)
    return Plan(tuple(remove), tuple(remove_nodes), add, tuple(keep))


# The NBD gate (nbdgate.py): which handshake options go through to the daemon ----------

NBD_OPT_EXPORT_NAME = 1
NBD_OPT_ABORT = 2
NBD_OPT_LIST = 3
NBD_OPT_STARTTLS = 5
NBD_OPT_GO = 7
NBD_REP_ACK = 1
NBD_REP_FLAG_ERROR = 1 << 31
NBD_REP_ERR_POLICY = NBD_REP_FLAG_ERROR | 2

REFUSED_OPTIONS = {
    NBD_OPT_LIST: "listing exports is not allowed: ask for your export by name",
    NBD_OPT_STARTTLS: "TLS is not offered by this server",
}
"""Options the gate answers itself with NBD_REP_ERR_POLICY, never forwarded: qemu lists
every export name to anyone who asks (NBD_OPT_LIST), and the names are the secrets."""


def gate_refusal(option: int) -> str | None:
    """The gate's refusal message for ``option``, or None to forward it to the daemon."""
    return REFUSED_OPTIONS.get(option)


def reply_is_final(reply_type: int) -> bool:
    """The daemon's reply ends its answer to an option (an ACK or an error)."""
    return reply_type == NBD_REP_ACK or bool(reply_type & NBD_REP_FLAG_ERROR)


def starts_transmission(option: int, reply_type: int) -> bool:
    """After this option (and reply) the connection carries block I/O, not haggling."""
    return option == NBD_OPT_EXPORT_NAME or (option == NBD_OPT_GO and reply_type == NBD_REP_ACK)
