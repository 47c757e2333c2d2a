"""The ``bmc_snmp`` source: a BMC's sensors over SNMP v2c or v3 (pysnmp asyncio API).

:func:`read_bmc` reads one ``[[bmc]]`` target through its profile's OID map
(:mod:`agent.bmc.snmp_profiles`): a GET of the profile's scalars and a GETBULK walk of
each table's columns.  Every request is bounded by the target's ``timeout_s`` and
``retries``; a BMC that does not answer, refuses the credentials or answers with an
error is a reading with ``reachable=False`` and the reason, never an exception.

:class:`SnmpReader` keeps one SNMP engine (one UDP socket) for many reads: the
bmc-proxy uses one for all its SNMP targets.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Mapping
from typing import Any, Final

from pyasn1.type import univ
from pysnmp.hlapi.v3arch.asyncio import (
    CommunityData,
    ContextData,
    ObjectIdentity,
    ObjectType,
    SnmpEngine,
    UdpTransportTarget,
    UsmUserData,
    bulk_cmd,
    get_cmd,
)
from pysnmp.hlapi.v3arch.asyncio import auth as usm
from pysnmp.proto import rfc1905

from metalguard.agent.bmc.credentials import BmcCredentials, CredentialsError, load_credentials
from metalguard.agent.bmc.snmp_profiles import (
    Oid,
    Profile,
    Value,
    Walked,
    join_columns,
    profile_named,
)
from metalguard.agent.bmc.targets import BmcTarget, unreachable
from metalguard.proto.telemetry import BmcReading

log = logging.getLogger(__name__)

SOURCE: Final = "snmp"
DEFAULT_PORT: Final = 161
MAX_REPETITIONS: Final = 24
"""Rows asked for per GETBULK (the agent may send fewer)."""
MAX_REQUESTS_PER_TABLE: Final = 64
"""A walk stops after this many requests: a table longer than ~1500 rows is not a BMC."""

AUTH_PROTOCOLS: Final[dict[str, Any]] = {
    "none": usm.USM_AUTH_NONE,
    "md5": usm.USM_AUTH_HMAC96_MD5,
    "sha": usm.USM_AUTH_HMAC96_SHA,
    "sha224": usm.USM_AUTH_HMAC128_SHA224,
    "sha256": usm.USM_AUTH_HMAC192_SHA256,
    "sha384": usm.USM_AUTH_HMAC256_SHA384,
    "sha512": usm.USM_AUTH_HMAC384_SHA512,
}
PRIV_PROTOCOLS: Final[dict[str, Any]] = {
    "none": usm.USM_PRIV_NONE,
    "des": usm.USM_PRIV_CBC56_DES,
    "3des": usm.USM_PRIV_CBC168_3DES,
    "aes": usm.USM_PRIV_CFB128_AES,
    "aes192": usm.USM_PRIV_CFB192_AES,
    "aes256": usm.USM_PRIV_CFB256_AES,
}

_ABSENT = (rfc1905.NoSuchObject, rfc1905.NoSuchInstance, rfc1905.EndOfMibView)

_HINTS: Final[dict[str, str]] = {
    "DecryptionError": "wrong priv_key or priv_protocol?",
    "WrongDigest": "wrong auth_key or auth_protocol?",
    "UnknownUserName": "the BMC has no such SNMPv3 user",
    "UnsupportedSecurityLevel": "the user's security level differs from the credentials'",
    "UnknownSecurityName": "the BMC has no such SNMPv3 user",
}
"""Error indications of pysnmp with what they usually mean."""


class SnmpRequestError(Exception):
    """A request got no usable answer: timeout, authentication, an error status."""

    def __init__(self, message: str, *, answered: bool) -> None:
        super().__init__(message)
        self.answered = answered


def auth_data(target: BmcTarget, credentials: BmcCredentials | None) -> Any:
    """CommunityData (v2c) or UsmUserData (v3) for the target."""
    if credentials is None:
        return CommunityData(target.community, mpModel=1)
    if not credentials.user:
        raise CredentialsError(f"{target.credentials}: user: missing (the SNMPv3 user)")
    return UsmUserData(
        credentials.user,
        authKey=credentials.auth_key or None,
        privKey=credentials.priv_key or None,
        authProtocol=AUTH_PROTOCOLS[credentials.auth],
        privProtocol=PRIV_PROTOCOLS[credentials.priv],
    )


def python_value(value: Any) -> Value:
    """An SNMP value as int (numbers), str (octet strings) or None (no such object)."""
    if isinstance(value, _ABSENT):
        return None
    if isinstance(value, univ.Integer):
        return int(value)
    if isinstance(value, univ.OctetString):
        return bytes(value.asOctets()).decode("utf-8", "replace").rstrip("\x00")
    return str(value.prettyPrint())


def _answer(result: tuple[Any, Any, Any, Any], what: str, target: BmcTarget) -> tuple[Any, ...]:
    error_indication, error_status, error_index, var_binds = result
    if error_indication:
        if type(error_indication).__name__ == "RequestTimedOut":
            tries = target.retries + 1
            raise SnmpRequestError(
                f"{what}: no answer within {target.timeout_s:g} s x {tries} "
                f"tr{'ies' if tries > 1 else 'y'}",
                answered=False,
            )
        hint = _HINTS.get(type(error_indication).__name__)
        detail = f"{error_indication}" + (f" ({hint})" if hint else "")
        raise SnmpRequestError(f"{what}: {detail}", answered=True)
    if error_status:
        raise SnmpRequestError(
            f"{what}: {error_status.prettyPrint()} at varbind {int(error_index)}", answered=True
        )
    return tuple(var_binds)


class SnmpReader:
    """Reads SNMP targets through shared engines; :meth:`close` releases their sockets.

    One engine serves every v2c target and every SNMPv3 target with the same secrets.
    pysnmp keeps one USM entry per user name in an engine, so targets whose v3 user has
    the same name but other keys get an engine of their own.
    """

    def __init__(self) -> None:
        self._engines: dict[tuple[str, ...], Any] = {}
        self._rows: dict[tuple[str, str, str], int] = {}
        """Rows each table of each target had last time: the next walk asks for that
        many plus one (to see the end) and is usually one request."""

    def close(self) -> None:
        """Close the engines' transports."""
        for engine in self._engines.values():
            engine.close_dispatcher()
        self._engines.clear()

    def _engine_for(self, credentials: BmcCredentials | None) -> Any:
        key: tuple[str, ...] = ()
        if credentials is not None:
            key = (credentials.user, credentials.auth, credentials.auth_key)
            key += (credentials.priv, credentials.priv_key)
        engine = self._engines.get(key)
        if engine is None:
            engine = self._engines[key] = SnmpEngine()
        return engine

    async def __call__(self, target: BmcTarget) -> BmcReading:
        """Read one target; unreachable or refused is a reading, never a raise."""
        try:
            profile = profile_named(target.profile)
            credentials = load_credentials(target.credentials) if target.credentials else None
            auth = auth_data(target, credentials)
        except (KeyError, CredentialsError) as exc:
            return unreachable(target, str(exc).strip("'\""))
        try:
            walked = await self.walk(self._engine_for(credentials), target, auth, profile)
        except SnmpRequestError as exc:
            reading = unreachable(target, str(exc))
            return reading if not exc.answered else _answered_error(reading)
        except Exception as exc:  # DNS failure, a malformed answer: still a reading
            log.debug("snmp %s: %s", target.address, exc, exc_info=True)
            return unreachable(target, f"{type(exc).__name__}: {exc}")
        converted = profile.convert(walked)
        message = "" if converted.sensors else f"no sensors in profile {profile.name}"
        return BmcReading(
            node=target.node,
            source=SOURCE,
            reachable=True,
            power_state=converted.power_state,
            health=converted.health,
            sensors=converted.sensors,
            message=message,
        )

    async def walk(self, engine: Any, target: BmcTarget, auth: Any, profile: Profile) -> Walked:
        """GET the profile's scalars and walk its tables; SnmpRequestError when unanswered."""
        host, port = target.host_port(DEFAULT_PORT)
        transport = await UdpTransportTarget.create(
            (host, port), timeout=target.timeout_s, retries=target.retries
        )
        scalars: dict[str, Value] = {}
        if profile.scalars:
            names = list(profile.scalars)
            var_binds = _answer(
                await get_cmd(
                    engine,
                    auth,
                    transport,
                    ContextData(),
                    *(ObjectType(ObjectIdentity(profile.scalars[n])) for n in names),
                    lookupMib=False,
                ),
                f"GET {profile.name} scalars from {target.address}",
                target,
            )
            scalars = {
                name: python_value(vb[1]) for name, vb in zip(names, var_binds, strict=False)
            }
        tables = {
            name: join_columns(
                await self._walk_columns(
                    engine, target, auth, transport, columns, (target.node, target.address, name)
                )
            )
            for name, columns in profile.tables.items()
        }
        return Walked(scalars=scalars, tables=tables)

    async def _walk_columns(
        self,
        engine: Any,
        target: BmcTarget,
        auth: Any,
        transport: Any,
        columns: Mapping[str, Oid],
        key: tuple[str, str, str],
    ) -> dict[str, dict[Oid, Value]]:
        """Walk several columns side by side with GETBULK, each until it leaves its root."""
        cells: dict[str, dict[Oid, Value]] = {name: {} for name in columns}
        cursor: dict[str, Oid] = dict(columns)
        known = self._rows.get(key)
        repetitions = MAX_REPETITIONS if known is None else min(known + 1, MAX_REPETITIONS)
        for _ in range(MAX_REQUESTS_PER_TABLE):
            if not cursor:
                break
            names = list(cursor)
            var_binds = _answer(
                await bulk_cmd(
                    engine,
                    auth,
                    transport,
                    ContextData(),
                    0,
                    repetitions,
                    *(ObjectType(ObjectIdentity(cursor[n])) for n in names),
                    lookupMib=False,
                ),
                f"GETBULK from {target.address}",
                target,
            )
            advanced: set[str] = set()
            finished: set[str] = set()
            for position, var_bind in enumerate(var_binds):
                name = names[position % len(names)]
                if name in finished:
                    continue
                oid, value = tuple(var_bind[0]), var_bind[1]
                root = columns[name]
                if isinstance(value, _ABSENT) or oid[: len(root)] != root or oid <= cursor[name]:
                    finished.add(name)
                    continue
                cells[name][oid[len(root) :]] = python_value(value)
                cursor[name] = oid
                advanced.add(name)
            for name in names:
                if name in finished or name not in advanced:
                    del cursor[name]
            repetitions = MAX_REPETITIONS
        self._rows[key] = max((len(c) for c in cells.values()), default=0)
        return cells


class ThreadedSnmpReader:
    """An :class:`SnmpReader` on its own event loop in its own thread.

    Decoding SNMP answers is CPU-bound pure Python (pyasn1, ~10 ms per answer); on the
    caller's loop a few hundred BMCs would delay everything else on it (the publisher's
    acks, the agent's own cycle, the watchdog).  In a thread, the interpreter switches
    to the caller's loop every few milliseconds instead.
    """

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._reader: SnmpReader | None = None

    def _start(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=loop.run_forever, name="bmc-snmp", daemon=True)
        self._thread.start()
        self._loop = loop
        return loop

    async def _read(self, target: BmcTarget) -> BmcReading:
        if self._reader is None:
            self._reader = SnmpReader()
        return await self._reader(target)

    async def __call__(self, target: BmcTarget) -> BmcReading:
        """Read one target on the reader's thread."""
        loop = self._loop or self._start()
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._read(target), loop))

    def close(self) -> None:
        """Close the engine, stop the loop, join the thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        self._loop = self._thread = None

        async def shutdown() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self._reader is not None:
                self._reader.close()
                self._reader = None
            # answers still in flight now meet a closed engine; nothing to report
            asyncio.get_running_loop().set_exception_handler(lambda _loop, _context: None)

        asyncio.run_coroutine_threadsafe(shutdown(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def _answered_error(reading: BmcReading) -> BmcReading:
    """The BMC answered, but not with data (wrong v3 keys, an error status)."""
    return BmcReading(
        node=reading.node,
        source=reading.source,
        reachable=False,
        message=f"answered with an error: {reading.message}",
    )


async def read_bmc(target: BmcTarget) -> BmcReading:
    """Read one target with a fresh engine (``agent collect``; the proxy shares one)."""
    reader = SnmpReader()
    try:
        return await reader(target)
    finally:
        reader.close()
