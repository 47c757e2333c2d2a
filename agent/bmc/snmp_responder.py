"""A simulated SNMP BMC: pysnmp's command responder serving recorded ``.snmprec`` data.

For tests, the bench and demos: one UDP port on loopback serves any number of datasets,
each as a v2c community (its own SNMP context) or the SNMPv3 user's default context.
GET, GETNEXT and GETBULK are answered from the dataset; nothing is writable.

The ``.snmprec`` format is snmpsim's: one ``OID|TAG|VALUE`` per line, TAG the ASN.1
type number (2 Integer32, 4 OCTET STRING, 5 NULL, 6 OBJECT IDENTIFIER, 64 IpAddress,
65 Counter32, 66 Gauge32, 67 TimeTicks, 68 Opaque, 70 Counter64), ``x`` after it for a
hex-encoded value (``4x|414243``); ``#`` starts a comment.
"""

from __future__ import annotations

import bisect
import socket
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Final

from pysnmp.carrier.asyncio.dgram import udp
from pysnmp.entity import config, engine
from pysnmp.entity.rfc3413 import cmdrsp
from pysnmp.entity.rfc3413 import context as snmp_context
from pysnmp.proto.api import v2c
from pysnmp.smi.instrum import AbstractMibInstrumController

from metalguard.agent.bmc.credentials import BmcCredentials
from metalguard.agent.bmc.snmp import AUTH_PROTOCOLS, PRIV_PROTOCOLS
from metalguard.agent.bmc.snmp_profiles import Oid, parse_oid

Record = tuple[Oid, Any]

_TYPES: Final[dict[int, Callable[[Any], Any]]] = {
    2: v2c.Integer32,
    4: v2c.OctetString,
    5: lambda _: v2c.Null(""),
    6: v2c.ObjectIdentifier,
    64: v2c.IpAddress,
    65: v2c.Counter32,
    66: v2c.Gauge32,
    67: v2c.TimeTicks,
    68: v2c.Opaque,
    70: v2c.Counter64,
}
_NUMERIC: Final = {2, 65, 66, 67, 70}


class SnmprecError(ValueError):
    """A line of a .snmprec file cannot be served; names the source and line."""


def parse_snmprec(text: str, source: str = "<snmprec>") -> list[Record]:
    """The records of a .snmprec document, sorted by OID."""
    records: dict[Oid, Any] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            oid_text, tag_text, value = line.split("|", 2)
            hex_value = tag_text.endswith("x")
            tag = int(tag_text.removesuffix("x"))
            make = _TYPES[tag]
            payload: Any = bytes.fromhex(value) if hex_value else value
            if tag in _NUMERIC:
                payload = int(payload)
            records[parse_oid(oid_text)] = make(payload)
        except (ValueError, KeyError) as exc:
            raise SnmprecError(f"{source}:{number}: cannot serve {line!r}: {exc}") from None
    return sorted(records.items())


def load_snmprec(path: Path) -> list[Record]:
    """Read and parse a .snmprec file."""
    return parse_snmprec(path.read_text(encoding="utf-8"), str(path))


class Dataset(AbstractMibInstrumController):  # type: ignore[misc]
    """Read-only MIB instrumentation over sorted records (GET and GETNEXT)."""

    def __init__(self, records: Iterable[Record]) -> None:
        self._records = sorted(records)
        self._oids = [oid for oid, _ in self._records]

    def read_variables(self, *var_binds: Any, **context: Any) -> list[tuple[Any, Any]]:
        """GET: the value, or noSuchObject."""
        out = []
        for name, _ in var_binds:
            oid = tuple(name)
            i = bisect.bisect_left(self._oids, oid)
            found = i < len(self._oids) and self._oids[i] == oid
            out.append(
                (v2c.ObjectIdentifier(oid), self._records[i][1] if found else v2c.NoSuchObject())
            )
        return out

    def read_next_variables(self, *var_binds: Any, **context: Any) -> list[tuple[Any, Any]]:
        """GETNEXT (and each GETBULK repetition): the next record, or endOfMibView."""
        out = []
        for name, _ in var_binds:
            oid = tuple(name)
            i = bisect.bisect_right(self._oids, oid)
            if i < len(self._oids):
                out.append((v2c.ObjectIdentifier(self._oids[i]), self._records[i][1]))
            else:
                out.append((v2c.ObjectIdentifier(oid), v2c.EndOfMibView()))
        return out

    def write_variables(self, *var_binds: Any, **context: Any) -> list[tuple[Any, Any]]:
        """Nothing is writable."""
        raise NotImplementedError("the simulated BMC is read-only")


class SnmpResponder:
    """One UDP port on ``host`` serving datasets by v2c community or SNMPv3 user."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        """Bind now (``port`` 0: any free port, see :attr:`port`); serve once the
        running event loop gets control."""
        self._engine = engine.SnmpEngine()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_DGRAM)
        sock.bind((host, port))
        self.host = host
        self.port: int = sock.getsockname()[1]
        transport = udp.Udp6Transport if family == socket.AF_INET6 else udp.UdpTransport
        domain = udp.DOMAIN_NAME if family == socket.AF_INET else udp.DOMAIN_NAME_6
        config.add_transport(self._engine, domain, transport().open_server_mode(sock=sock))
        self._context = snmp_context.SnmpContext(self._engine)
        self._communities = 0
        for responder in (
            cmdrsp.GetCommandResponder,
            cmdrsp.NextCommandResponder,
            cmdrsp.BulkCommandResponder,
        ):
            responder(self._engine, self._context)

    @property
    def address(self) -> str:
        """``host:port`` as a ``[[bmc]]`` target's ``address``."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def add_community(self, community: str, records: Iterable[Record]) -> None:
        """Serve ``records`` to SNMP v1/v2c requests with this community."""
        self._communities += 1
        name = f"bmc{self._communities}"
        self._context.register_context_name(name.encode(), Dataset(records))
        config.add_v1_system(self._engine, name, community, contextName=name.encode())

    def add_user(self, credentials: BmcCredentials, records: Iterable[Record]) -> None:
        """Serve ``records`` to SNMPv3 requests from this USM user (the default context,
        so one dataset for all v3 users of this responder)."""
        config.add_v3_user(
            self._engine,
            credentials.user,
            AUTH_PROTOCOLS[credentials.auth],
            credentials.auth_key or None,
            PRIV_PROTOCOLS[credentials.priv],
            credentials.priv_key or None,
        )
        self._context.unregister_context_name(b"")
        self._context.register_context_name(b"", Dataset(records))

    def close(self) -> None:
        """Stop serving and close the socket."""
        self._engine.close_dispatcher()
