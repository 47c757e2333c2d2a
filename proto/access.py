"""How a process reaches its region's NATS: the ``[nats]`` section both the agent's and
the controller's config files share, the TLS context it asks for, and the keyword
options of nats-py's ``connect`` it comes to (plain data: nothing here imports nats)."""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from typing import Annotated, Any, Protocol

import msgspec

from metalguard.proto.addresses import AddressError, check_nats_servers
from metalguard.proto.base import Token

Seconds = Annotated[float, msgspec.Meta(ge=0.05)]
"""A duration in a config file (at least 50 ms)."""


class ConfigSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A table of a config file: immutable, and a misspelled key is an error."""


class NatsAccess(ConfigSection, frozen=True):
    """``[nats]``: servers, subject prefix, credentials, TLS, timeouts."""

    servers: tuple[str, ...] = ("nats://127.0.0.1:4222",)
    """``host[:port]`` or ``nats://``, ``tls://``, ``ws://``, ``wss://`` URLs (port 4222
    by default), checked at load (:func:`metalguard.proto.addresses.check_nats_servers`)."""
    prefix: Token = "mg"
    credentials: str = ""
    """A NATS .creds file (JWT + nkey seed): this process's own user."""
    nkey_seed: str = ""
    """A file holding this process's nkey seed (nkey auth without JWT)."""
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    inbox_prefix: str = ""
    """Reply subjects of this process's requests start with this (nats-py's
    ``inbox_prefix``); per-node credentials allow only the node's own (docs/security.md).
    Empty: ``_INBOX``."""
    connect_timeout_s: Seconds = 2.0
    """One connection attempt."""
    publish_timeout_s: Seconds = 5.0
    """How long to wait for a JetStream acknowledgement."""

    def __post_init__(self) -> None:
        try:
            check_nats_servers(self.servers)
        except AddressError as exc:
            raise ValueError(f"servers{'' if str(exc).startswith('[') else ': '}{exc}") from None


def tls_context(ca: str | None, cert: str | None, key: str | None) -> ssl.SSLContext | None:
    """The TLS context for these files (server verification, client certificate), or None
    for plain TCP; ValueError naming the problem when the files are unusable."""
    if not (ca or cert):
        return None
    try:
        ctx = ssl.create_default_context(cafile=ca or None)
        if cert:
            ctx.load_cert_chain(cert, key or None)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"NATS TLS files unusable: {exc}") from None
    return ctx


class NatsEndpoint(Protocol):
    """What :func:`connect_options` reads: a :class:`NatsAccess` section, or the agent's
    connection settings (where an unset file is None rather than "")."""

    @property
    def servers(self) -> Sequence[str]: ...
    @property
    def credentials(self) -> str | None: ...
    @property
    def nkey_seed(self) -> str | None: ...
    @property
    def inbox_prefix(self) -> str | None: ...
    @property
    def connect_timeout_s(self) -> float: ...


def connect_options(
    access: NatsEndpoint,
    *,
    name: str,
    tls: ssl.SSLContext | None,
    reconnect_wait_s: float,
    tls_hostname: str | None = None,
) -> dict[str, Any]:
    """The keyword options of nats-py's ``connect`` for ``access``: servers, client
    ``name``, credentials (a .creds file or an nkey seed), ``tls`` (see :func:`tls_context`),
    the reply-subject prefix, and reconnects that never stop, ``reconnect_wait_s`` apart.
    Callers add their own callbacks and tuning."""
    options: dict[str, Any] = {
        "servers": list(access.servers),
        "name": name,
        "connect_timeout": access.connect_timeout_s,
        "allow_reconnect": True,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": reconnect_wait_s,
    }
    optional = {
        "user_credentials": access.credentials,
        "nkeys_seed": access.nkey_seed,
        "tls": tls,
        "tls_hostname": tls_hostname,
        "inbox_prefix": access.inbox_prefix,
    }
    options.update((key, value) for key, value in optional.items() if value not in (None, ""))
    return options
