"""The credentials directory of ``metalguard creds`` (docs/security.md).

::

    DIR/users.json               every user: kind, name, public nkey, seed file
    DIR/nats-server.conf         the authorization block, rendered from users.json
    DIR/controllers/NAME.nk      a controller's nkey seed   ([nats] nkey_seed)
    DIR/nodes/R.C.N.nk           a node's nkey seed
    DIR/subscribers/NAME.nk      a subscriber's nkey seed

Seeds are written with mode 0600 and never overwritten; ``nats-server.conf`` is replaced
atomically (a reload of the server picks the new users up: ``nats-server --signal reload``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import msgspec
import nkeys  # type: ignore[import-untyped]

from metalguard.controller.creds.permissions import (
    CredsState,
    Kind,
    User,
    node_inbox,
    parse_node,
    render_conf,
    subscriber_inbox,
    with_user,
)
from metalguard.proto.subjects import Subjects, check_token

STATE_FILE = "users.json"
CONF_FILE = "nats-server.conf"
FOLDERS: dict[Kind, str] = {
    "node": "nodes",
    "controller": "controllers",
    "subscriber": "subscribers",
}


class CredsError(Exception):
    """The directory or a request is unusable; the message says why."""


@dataclass(frozen=True, slots=True)
class Added:
    """What an add wrote: the user, its seed file, its inbox prefix (nodes, subscribers)."""

    user: User
    seed_path: Path
    inbox_prefix: str


def new_seed() -> tuple[bytes, str]:
    """A fresh user nkey: (seed, public key)."""
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    return seed, nkeys.from_seed(seed).public_key.decode()


def init(
    directory: Path,
    prefix: str = "mg",
    controllers: tuple[str, ...] = ("controller",),
    strict_qos: bool = False,
) -> list[Added]:
    """Create the directory, its first controller users and the conf; CredsError if it
    already holds credentials."""
    Subjects(prefix)  # validates the prefix
    if (directory / STATE_FILE).exists():
        raise CredsError(f"{directory} already holds credentials ({STATE_FILE})")
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    state = CredsState(prefix=prefix, strict_qos=strict_qos)
    added: list[Added] = []
    for name in controllers:
        state, item = _add(directory, state, "controller", check_token(name, "controller"))
        added.append(item)
    _save(directory, state)
    return added


def add(directory: Path, kind: Kind, name: str) -> Added:
    """Add a user (a node is ``REGION.CLUSTER.NODE``) and rewrite the conf."""
    state = load(directory)
    if kind == "node":
        parse_node(name)
    else:
        check_token(name, "name")
    state, item = _add(directory, state, kind, name)
    _save(directory, state)
    return item


def load(directory: Path) -> CredsState:
    """Read ``DIR/users.json``; CredsError when missing or invalid."""
    path = directory / STATE_FILE
    try:
        return msgspec.json.decode(path.read_bytes(), type=CredsState)
    except FileNotFoundError:
        raise CredsError(f"{directory} holds no credentials: run `metalguard creds init`") from None
    except (OSError, msgspec.DecodeError) as exc:
        raise CredsError(f"{path}: {exc}") from None


def _add(directory: Path, state: CredsState, kind: Kind, name: str) -> tuple[CredsState, Added]:
    seed, public = new_seed()
    relative = f"{FOLDERS[kind]}/{name}.nk"
    user = User(kind=kind, name=name, nkey=public, seed_file=relative)
    try:
        state = with_user(state, user)
    except ValueError as exc:
        raise CredsError(str(exc)) from None
    path = directory / relative
    path.parent.mkdir(mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(seed + b"\n")
    inbox = ""
    if kind == "node":
        inbox = node_inbox(state.prefix, name)
    elif kind == "subscriber":
        inbox = subscriber_inbox(state.prefix, name)
    return state, Added(user, path, inbox)


def _save(directory: Path, state: CredsState) -> None:
    _replace(directory / STATE_FILE, msgspec.json.format(msgspec.json.encode(state)) + b"\n")
    _replace(directory / CONF_FILE, render_conf(state).encode())


def _replace(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
