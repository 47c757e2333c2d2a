"""Per-process NATS users and their permissions (docs/security.md): pure.

metalguard uses nkey users without an operator: every node, controller and read-only
subscriber has its own nkey (an Ed25519 key pair; the server keeps only the public key)
and its own permissions in an ``authorization { users = [...] }`` block that a
nats-server config includes.  This module decides the permissions and renders the
block; :mod:`controller.creds_store` keeps the keys and the list of users on disk.

What each kind of user may do (``<p>`` the subject prefix, ``<P>`` it upper-cased):

- **node** ``r.c.n``: publish only ``<p>.tel.r.c.n`` and ``<p>.evt.r.c.n.>``, replies to
  the commands it received (``allow_responses``) and the JetStream calls its QoS watch
  needs on ``KV_<P>_QOS`` for its own two keys; subscribe only to ``<p>.cmd.r.c.n.>``
  and its own inbox ``_INBOX_<P>.r.c.n.>`` (the agent's ``[nats] inbox_prefix``).
- **subscriber**: subscribe to ``<p>.ctl.>`` and its inbox; read the ``<P>_CONTROL``
  stream through consumers; publish nothing else.
- **controller**: everything of the prefix except speaking for a node (``<p>.tel``,
  ``<p>.evt``), and the JetStream and KV API.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Literal

import msgspec

from metalguard.proto.subjects import Subjects, check_token

Kind = Literal["node", "controller", "subscriber"]
STATE_VERSION = 1


class User(msgspec.Struct, frozen=True, kw_only=True):
    """One NATS user: its kind, name, public nkey and where its seed file is."""

    kind: Kind
    name: str
    """``region.cluster.node`` for a node; a token otherwise."""
    nkey: str
    """The public user nkey (``U...``)."""
    seed_file: str
    """The seed's path relative to the credentials directory."""


class CredsState(msgspec.Struct, frozen=True, kw_only=True):
    """``DIR/users.json``: what ``nats-server.conf`` is rendered from."""

    v: int = STATE_VERSION
    prefix: str = "mg"
    strict_qos: bool = False
    """Allow only filter-checked consumer creates on the QoS bucket (see qos_grants)."""
    users: tuple[User, ...] = ()


class Permissions(msgspec.Struct, frozen=True, kw_only=True):
    """A user's ``permissions`` block."""

    publish_allow: tuple[str, ...] = ()
    publish_deny: tuple[str, ...] = ()
    subscribe_allow: tuple[str, ...] = ()
    allow_responses: bool = False


def parse_node(name: str) -> tuple[str, str, str]:
    """``REGION.CLUSTER.NODE`` into its tokens; ValueError naming what is wrong."""
    parts = name.split(".")
    if len(parts) != 3:
        raise ValueError(f"node {name!r} must be REGION.CLUSTER.NODE")
    region, cluster, node = parts
    for what, token in (("region", region), ("cluster", cluster), ("node", node)):
        check_token(token, what)
    return region, cluster, node


def node_inbox(prefix: str, name: str) -> str:
    """A node's inbox prefix (its agent's ``[nats] inbox_prefix``)."""
    region, cluster, node = parse_node(name)
    return f"_INBOX_{prefix.upper()}.{region}.{cluster}.{node}"


def subscriber_inbox(prefix: str, name: str) -> str:
    """A subscriber's inbox prefix."""
    return f"_INBOX_{prefix.upper()}.sub.{check_token(name, 'name')}"


def qos_grants(subjects: Subjects, cluster: str, node: str, strict: bool) -> tuple[str, ...]:
    """What a node publishes to watch its own QoS keys (``<cluster>.<node>``, ``<cluster>``).

    A filter-checked consumer create names the filter in the subject
    (``$JS.API.CONSUMER.CREATE.<stream>.<name>.<filter>``), so it is allowed for the
    node's two keys only.  nats-py's KV watch (2.16) creates an unnamed ordered consumer
    on ``$JS.API.CONSUMER.CREATE.<stream>``, whose filter the server cannot check by
    subject: unless ``strict``, that subject is allowed too, and a node could then read
    (never write) another node's profile.
    """
    bucket = subjects.bucket("qos")
    stream = f"KV_{bucket}"
    keys = (f"$KV.{bucket}.{cluster}.{node}", f"$KV.{bucket}.{cluster}")
    grants = [f"$JS.API.STREAM.INFO.{stream}"]
    grants += [f"$JS.API.CONSUMER.CREATE.{stream}.*.{key}" for key in keys]
    grants += [f"$JS.API.DIRECT.GET.{stream}.{key}" for key in keys]
    grants += [
        f"$JS.API.CONSUMER.INFO.{stream}.*",
        f"$JS.API.CONSUMER.DELETE.{stream}.*",
        f"$JS.FC.{stream}.>",
    ]
    if not strict:
        grants.append(f"$JS.API.CONSUMER.CREATE.{stream}")
    return tuple(grants)


def node_permissions(prefix: str, name: str, strict_qos: bool = False) -> Permissions:
    """A node's permissions (see the module docstring)."""
    region, cluster, node = parse_node(name)
    s = Subjects(prefix)
    return Permissions(
        publish_allow=(
            s.telemetry(region, cluster, node),
            s.node_event(region, cluster, node, "*").removesuffix("*") + ">",
            *qos_grants(s, cluster, node, strict_qos),
        ),
        subscribe_allow=(
            s.command(region, cluster, node, "*").removesuffix("*") + ">",
            node_inbox(prefix, name) + ".>",
        ),
        allow_responses=True,
    )


def subscriber_permissions(prefix: str, name: str) -> Permissions:
    """A read-only subscriber of the controller's events (core and the control stream)."""
    s = Subjects(prefix)
    stream = s.stream_control
    return Permissions(
        publish_allow=(
            f"$JS.API.STREAM.INFO.{stream}",
            f"$JS.API.STREAM.MSG.GET.{stream}",
            f"$JS.API.DIRECT.GET.{stream}.>",
            f"$JS.API.CONSUMER.CREATE.{stream}",
            f"$JS.API.CONSUMER.CREATE.{stream}.>",
            f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.*",
            f"$JS.API.CONSUMER.INFO.{stream}.*",
            f"$JS.API.CONSUMER.DELETE.{stream}.*",
            f"$JS.API.CONSUMER.MSG.NEXT.{stream}.*",
            f"$JS.ACK.{stream}.>",
            f"$JS.FC.{stream}.>",
        ),
        subscribe_allow=(s.all_of("ctl"), subscriber_inbox(prefix, name) + ".>"),
    )


def controller_permissions(prefix: str) -> Permissions:
    """A controller's permissions: all but speaking for a node."""
    s = Subjects(prefix)
    return Permissions(
        publish_allow=(f"{prefix}.>", "$JS.>", "$KV.>", "_INBOX.>"),
        publish_deny=(s.all_of("tel"), s.all_of("evt")),
        subscribe_allow=(">",),
        allow_responses=True,
    )


def permissions_of(user: User, state: CredsState) -> Permissions:
    """The permissions of one user of ``state``."""
    match user.kind:
        case "node":
            return node_permissions(state.prefix, user.name, state.strict_qos)
        case "subscriber":
            return subscriber_permissions(state.prefix, user.name)
        case "controller":
            return controller_permissions(state.prefix)
    raise ValueError(f"unknown user kind {user.kind!r}")


def render_conf(state: CredsState) -> str:
    """The ``authorization`` block for nats-server (include it from the server's config)."""
    lines = [
        "# metalguard credentials: written by `metalguard creds`; do not edit by hand.",
        f"# prefix {state.prefix!r}; {len(state.users)} users. Include from nats-server.conf:",
        "#   include ./nats-server.conf",
        "authorization {",
        "  users = [",
        *_user_lines(state, "    "),
        "  ]",
        "}",
        "",
    ]
    return "\n".join(lines)


SYSTEM_ACCOUNT = "SYS"


def account_of(region: str) -> str:
    """The NATS account of a region's users in a federation (``r1`` -> ``R1``)."""
    return region.upper()


def render_federation(regions: dict[str, CredsState]) -> str:
    """The ``accounts`` block for every server of a supercluster (docs/federation.md):
    one account per region with JetStream, that region's users and permissions, its
    federation subjects exported and the other regions' imported; ValueError when the
    regions' prefixes differ or a node user belongs to another region."""
    if not regions:
        raise ValueError("no region given")
    for region in regions:
        check_token(region, "region")
    prefixes = {state.prefix for state in regions.values()}
    if len(prefixes) != 1:
        raise ValueError(f"the regions' prefixes differ: {sorted(prefixes)}")
    (prefix,) = prefixes
    for region, state in regions.items():
        for user in state.users:
            if user.kind == "node" and parse_node(user.name)[0] != region:
                raise ValueError(f"node {user.name} is in the credentials of region {region}")
    lines = [
        "# metalguard federation: written by `metalguard creds federate`; do not edit by hand.",
        f"# prefix {prefix!r}; regions {', '.join(sorted(regions))}. Include from every",
        "# server's nats-server.conf (instead of each region's nats-server.conf).",
        "accounts {",
    ]
    for region in sorted(regions):
        state = regions[region]
        exports = federation_exports(prefix, region)
        imports = federation_imports(prefix, region, regions)
        lines += [
            f"  {account_of(region)}: {{",
            "    jetstream: enabled",
            "    users = [",
            *_user_lines(state, "      "),
            "    ]",
            "    exports = [",
            *(f"      {e}" for e in exports),
            "    ]",
            "    imports = [",
            *(f"      {i}" for i in imports),
            "    ]",
            "  }",
        ]
    lines += [f"  {SYSTEM_ACCOUNT}: {{ }}", "}", f"system_account: {SYSTEM_ACCOUNT}", ""]
    return "\n".join(lines)


def _federation_subjects(prefix: str, region: str) -> tuple[tuple[str, str], ...]:
    """(export kind, subject) of what a region shares: its summaries, lookups and
    forwarded jobs."""
    s = Subjects(prefix)
    return (
        ("stream", s.fed_summary(region)),
        ("service", s.fed_lookup(region)),
        ("service", s.fed_submit(region)),
    )


def federation_exports(prefix: str, region: str) -> list[str]:
    """A region account's ``exports`` entries (pure)."""
    shared = _federation_subjects(prefix, region)
    return [f"{{ {kind}: {_q(subject)} }}" for kind, subject in shared]


def federation_imports(prefix: str, region: str, regions: Iterable[str]) -> list[str]:
    """A region account's ``imports`` entries: what every other region exports (pure)."""
    return [
        f"{{ {kind}: {{ account: {account_of(other)}, subject: {_q(subject)} }} }}"
        for other in sorted(regions)
        if other != region
        for kind, subject in _federation_subjects(prefix, other)
    ]


def _user_lines(state: CredsState, indent: str) -> list[str]:
    lines = []
    for user in sorted(state.users, key=lambda u: (u.kind, u.name)):
        p = permissions_of(user, state)
        lines.append(f"{indent}# {user.kind} {user.name}")
        lines.append(f"{indent}{{ nkey: {_q(user.nkey)}, permissions: {{")
        publish = f"allow: {_list(p.publish_allow)}"
        if p.publish_deny:
            publish += f", deny: {_list(p.publish_deny)}"
        lines.append(f"{indent}    publish: {{ {publish} }}")
        lines.append(f"{indent}    subscribe: {{ allow: {_list(p.subscribe_allow)} }}")
        if p.allow_responses:
            lines.append(f"{indent}    allow_responses: true")
        lines.append(f"{indent}}} }}")
    return lines


def with_user(state: CredsState, user: User) -> CredsState:
    """``state`` with ``user`` added; ValueError when that kind and name exist."""
    if any(u.kind == user.kind and u.name == user.name for u in state.users):
        raise ValueError(f"{user.kind} {user.name!r} already exists")
    return msgspec.structs.replace(state, users=(*state.users, user))


def _q(text: str) -> str:
    return json.dumps(text)


def _list(items: Iterable[str]) -> str:
    return "[" + ", ".join(_q(i) for i in items) + "]"
