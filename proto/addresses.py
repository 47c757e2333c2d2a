"""Addresses as users write them in config files, parsed strictly (pure: no I/O, no name
lookups; docs/agent.md, docs/controller.md, docs/bmc.md).

One parser per form; each returns the parsed address or raises :class:`AddressError`
whose message quotes the text, says what is wrong and lists the accepted forms::

    'http://[::1' : unclosed '[' (expected host, host:port, http://host[:port] or ...)

A host is a DNS name (letters, digits, ``-`` in dot-separated labels), an IPv4 address or
an IPv6 literal; an IPv6 literal with a port is written in brackets (``[fd00::5]:8443``).
A port is a decimal number from 1 to 65535 (0 only where a listen address asks for a free
port).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

_LABEL: Final = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")
_SCHEME: Final = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")

BMC_FORMS: Final = "host, host:port, http://host[:port] or https://host[:port]"
BMC_PLAIN_FORMS: Final = "host or host:port"
LISTEN_FORMS: Final = "host:port ([v6]:port for IPv6)"
NATS_FORMS: Final = "host[:port] or nats://, tls://, ws://, wss:// host[:port] URLs"
NATS_SCHEMES: Final = ("nats", "tls", "ws", "wss")


class AddressError(ValueError):
    """An address is not one of the forms accepted where it was written."""


@dataclass(frozen=True, slots=True)
class HostPort:
    """A host (IPv6 without brackets) and a port (None: the default of its use)."""

    host: str
    port: int | None = None

    @property
    def netloc(self) -> str:
        """``host:port`` (IPv6 bracketed), or the host alone when no port is set."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port is None else f"{host}:{self.port}"


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A URL's scheme and where it points (the port filled in from the scheme)."""

    scheme: str
    host: str
    port: int

    @property
    def url(self) -> str:
        """``scheme://host:port`` (IPv6 bracketed)."""
        return f"{self.scheme}://{HostPort(self.host, self.port).netloc}"


def _fail(text: str, problem: str, forms: str) -> AddressError:
    return AddressError(f"{text!r}: {problem} (expected {forms})")


def parse_host(text: str, forms: str = "a host name or IP address") -> str:
    """A DNS name, an IPv4 address or an IPv6 literal (brackets optional); AddressError
    otherwise. The host comes back without brackets."""
    host = text
    if host.startswith("[") or host.endswith("]"):
        if not (host.startswith("[") and host.endswith("]")):
            raise _fail(text, "unbalanced brackets", forms)
        inner = host[1:-1]
        try:
            ipaddress.IPv6Address(inner)
        except ValueError:
            raise _fail(text, "brackets hold an IPv6 address only", forms) from None
        return inner
    if not host:
        raise _fail(text, "no host", forms)
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise _fail(text, "not an IPv6 address", forms) from None
        return host
    labels = host.removesuffix(".").split(".")
    if all(label.isdigit() for label in labels):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            raise _fail(text, "not an IPv4 address", forms) from None
        return host
    if len(host) > 253 or not all(_LABEL.match(label) for label in labels):
        raise _fail(text, "not a valid host name", forms)
    return host


def parse_port(text: str, source: str, forms: str, *, allow_zero: bool = False) -> int:
    """A decimal port 1-65535 (0 too with ``allow_zero``); ``source`` is quoted in errors."""
    low = 0 if allow_zero else 1
    if not text.isascii() or not text.isdigit() or not low <= int(text) <= 65535:
        raise _fail(source, f"port {text!r} is not a number from {low} to 65535", forms)
    return int(text)


def parse_host_port(
    text: str,
    forms: str = "host or host:port",
    *,
    port_required: bool = False,
    allow_zero: bool = False,
) -> HostPort:
    """``host``, ``host:port``, ``[v6]``, ``[v6]:port`` or a bare IPv6 literal (no port).

    ``port_required``: a port must be given; ``allow_zero``: port 0 is accepted."""
    if text != text.strip() or not text:
        raise _fail(text, "empty" if not text.strip() else "surrounding spaces", forms)
    if any(c in text for c in "/?#@ \t"):
        raise _fail(text, "not a bare host[:port]", forms)
    if text.startswith("["):
        close = text.find("]")
        if close < 0:
            raise _fail(text, "unclosed '['", forms)
        host = parse_host(text[: close + 1], forms)
        rest = text[close + 1 :]
        if rest and not rest.startswith(":"):
            raise _fail(text, f"unexpected {rest!r} after ']'", forms)
        port_text = rest[1:] if rest else None
    elif text.count(":") > 1:  # a bare IPv6 literal: no port possible
        host, port_text = parse_host(text, forms), None
    else:
        head, sep, tail = text.partition(":")
        host = parse_host(head, forms)
        port_text = tail if sep else None
    if port_text is None:
        if port_required:
            raise _fail(text, "no port", forms)
        return HostPort(host)
    return HostPort(host, parse_port(port_text, text, forms, allow_zero=allow_zero))


def _split_scheme(text: str) -> tuple[str, str]:
    """``("scheme", rest)`` of ``scheme://rest``, or ``("", text)`` without a scheme."""
    match = _SCHEME.match(text)
    if match is None:
        return "", text
    return match.group(1).lower(), text[match.end() :]


def parse_bmc_address(text: str, protocol: str, default_port: int) -> Endpoint:
    """A ``[[bmc]]`` target's ``address``.

    Redfish: ``host``, ``host:port``, ``http://host[:port]`` (plain HTTP: labs,
    emulators) or ``https://host[:port]``; no scheme means HTTPS. A URL may end in one
    ``/`` and holds no user, path or query. Other protocols: ``host`` or ``host:port``
    (scheme ``""``). The port defaults to ``default_port`` (80 for an ``http://`` URL
    without one)."""
    redfish = protocol == "redfish"
    forms = BMC_FORMS if redfish else BMC_PLAIN_FORMS
    scheme, rest = _split_scheme(text)
    if scheme or "://" in text:
        if not redfish:
            raise _fail(text, f"a URL is for redfish targets, not {protocol}", forms)
        if scheme not in ("http", "https"):
            raise _fail(text, f"scheme {scheme!r} is not http or https", forms)
        if "@" in rest:
            raise _fail(text, "credentials go in the `credentials` file, not the URL", forms)
        rest = rest.removesuffix("/")
        if any(c in rest for c in "/?#"):
            raise _fail(text, "a path or query is not accepted (the service root is fixed)", forms)
    parsed = parse_host_port(rest, forms)
    if not scheme:
        scheme = "https" if redfish else ""
    port = parsed.port
    if port is None:
        port = 80 if scheme == "http" else default_port
    return Endpoint(scheme, parsed.host, port)


def parse_listen(text: str) -> HostPort:
    """A listen address, ``host:port`` or ``[v6]:port`` (port 0: any free port)."""
    if text.isdigit():
        raise _fail(text, "a port without a host", LISTEN_FORMS)
    bare = not any(c in text for c in "[]/?#@ \t")
    if bare and text.count(":") > 1:
        raise _fail(text, "an IPv6 address with a port goes in brackets", LISTEN_FORMS)
    return parse_host_port(text, LISTEN_FORMS, port_required=True, allow_zero=True)


def parse_nats_server(text: str) -> Endpoint:
    """One NATS server URL: ``host[:port]`` (nats://), or ``nats://``, ``tls://``,
    ``ws://``, ``wss://`` with ``host[:port]``, optionally ``user[:password]@`` before
    the host (a websocket URL may carry a path). The port defaults to 4222 (80/443 for
    ws/wss)."""
    scheme, rest = _split_scheme(text)
    if not scheme and "://" in text:
        raise _fail(text, "no scheme before '://'", NATS_FORMS)
    if scheme and scheme not in NATS_SCHEMES:
        raise _fail(text, f"scheme {scheme!r} is not one of {', '.join(NATS_SCHEMES)}", NATS_FORMS)
    scheme = scheme or "nats"
    if scheme in ("ws", "wss"):
        rest, _, _path = rest.partition("/")
    else:
        rest = rest.removesuffix("/")
    userinfo, at, hostport = rest.rpartition("@")
    if at and not userinfo:
        raise _fail(text, "empty user before '@'", NATS_FORMS)
    parsed = parse_host_port(hostport, NATS_FORMS)
    default = {"ws": 80, "wss": 443}.get(scheme, 4222)
    return Endpoint(scheme, parsed.host, default if parsed.port is None else parsed.port)


def check_nats_servers(servers: Sequence[str]) -> tuple[Endpoint, ...]:
    """Every server of a ``servers`` list parsed; AddressError for an empty list, a bad
    URL (named by its index) or websocket and plain URLs mixed (nats-py refuses that)."""
    if not servers:
        raise AddressError(f"empty (expected a list of {NATS_FORMS})")
    parsed = []
    for i, server in enumerate(servers):
        try:
            parsed.append(parse_nats_server(server))
        except AddressError as exc:
            raise AddressError(f"[{i}]: {exc}") from None
    websocket = {e.scheme in ("ws", "wss") for e in parsed}
    if len(websocket) > 1:
        raise AddressError("websocket (ws://, wss://) and plain URLs cannot be mixed")
    return tuple(parsed)
