"""Redfish out of band: power state, health, fans, temperatures and power supplies.

Two layers:

- pure functions turning Redfish JSON documents (DSP0268 schemas: ComputerSystem,
  Thermal, Power, ThermalSubsystem/Fan/ThermalMetrics, Sensor, PowerSupply) into
  :class:`proto.telemetry.BmcSensor` tuples;
- :class:`RedfishClient` (aiohttp): basic or session authentication, TLS verification on
  unless the target says ``verify_tls = false``, bounded timeouts and retries.

:func:`read_bmc` walks ServiceRoot -> Systems (first member) and every Chassis,
preferring the newer ThermalSubsystem/PowerSubsystem and falling back to the deprecated
Thermal/Power resources.  It never raises: an unreachable BMC, a refused login or a
garbled answer is a reading with ``reachable=False`` and the reason.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ssl
from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import Any, Final, Literal

import aiohttp
import msgspec

from metalguard.agent.bmc.credentials import load_credentials
from metalguard.agent.bmc.targets import BmcTarget
from metalguard.proto.telemetry import BmcReading, BmcSensor

SOURCE: Final = "redfish"
DEFAULT_PORT: Final = 443
ROOT: Final = "/redfish/v1"

AuthMode = Literal["auto", "basic", "session"]
Json = dict[str, Any]

_HEALTH: Final[dict[str, str]] = {"ok": "ok", "warning": "warning", "critical": "critical"}
_POWER_STATES: Final[dict[str, str]] = {
    "On": "on",
    "Off": "off",
    "PoweringOn": "powering_on",
    "PoweringOff": "powering_off",
    "Paused": "paused",
}
_UNITS: Final[dict[str, str]] = {
    "RPM": "rpm",
    "Percent": "%",
    "%": "%",
    "Cel": "C",
    "V": "V",
    "A": "A",
    "W": "W",
}
"""Redfish ``ReadingUnits`` (UCUM) -> the units docs/bmc.md names."""
_READING_KINDS: Final[dict[str, str]] = {
    "Temperature": "temperature",
    "Rotational": "fan",
    "Voltage": "voltage",
    "Current": "current",
    "Power": "power",
}


class RedfishError(Exception):
    """A Redfish request failed; the message says which and why."""


class RedfishAuthError(RedfishError):
    """The BMC refused the credentials (HTTP 401) or the account lacks the right (403)."""


# --- pure: documents -> readings -------------------------------------------------------


def power_state(text: object) -> str:
    """Redfish ``PowerState`` -> ``on``, ``off``, ``powering_on``, ``powering_off``,
    ``paused`` ("" when absent, the raw value lower-cased when unknown)."""
    if not isinstance(text, str):
        return ""
    return _POWER_STATES.get(text, text.lower())


def health(status: object) -> str:
    """A Redfish ``Status`` object's ``Health`` -> ``ok``/``warning``/``critical`` ("")."""
    if not isinstance(status, Mapping):
        return ""
    value = status.get("Health")
    return _HEALTH.get(value.lower(), "") if isinstance(value, str) else ""


def sensor_status(status: object) -> str:
    """A ``Status`` object as BmcSensor.status: ``absent`` for State Absent, else the
    health (``ok``/``warning``/``critical``), else ``unknown``."""
    if isinstance(status, Mapping) and status.get("State") == "Absent":
        return "absent"
    return health(status) or "unknown"


def _num(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _name(doc: Mapping[str, Any], *keys: str) -> str:
    for key in keys:
        if isinstance(value := doc.get(key), str) and value:
            return value
    return "?"


def system_state(doc: Mapping[str, Any]) -> tuple[str, str]:
    """A ComputerSystem document -> (power_state, health)."""
    return power_state(doc.get("PowerState")), health(doc.get("Status"))


def sensors_from_thermal(doc: Mapping[str, Any]) -> list[BmcSensor]:
    """The deprecated ``Thermal`` resource: ``Temperatures`` and ``Fans`` with their
    ``Lower/UpperThresholdCritical``."""
    out: list[BmcSensor] = []
    for temp in _objects(doc.get("Temperatures")):
        out.append(
            BmcSensor(
                name=_name(temp, "Name", "MemberId"),
                kind="temperature",
                value=_num(temp.get("ReadingCelsius")),
                unit="C",
                status=sensor_status(temp.get("Status")),
                lower_critical=_num(temp.get("LowerThresholdCritical")),
                upper_critical=_num(temp.get("UpperThresholdCritical")),
            )
        )
    for fan in _objects(doc.get("Fans")):
        value = _num(fan.get("Reading"))
        units = fan.get("ReadingUnits", "RPM")
        if value is None and (rpm := _num(fan.get("ReadingRPM"))) is not None:  # Thermal v1.0
            value, units = rpm, "RPM"
        out.append(
            BmcSensor(
                name=_name(fan, "Name", "FanName", "MemberId"),
                kind="fan",
                value=value,
                unit=_UNITS.get(str(units), str(units)),
                status=sensor_status(fan.get("Status")),
                lower_critical=_num(fan.get("LowerThresholdCritical")),
                upper_critical=_num(fan.get("UpperThresholdCritical")),
            )
        )
    return out


def sensors_from_power(doc: Mapping[str, Any]) -> list[BmcSensor]:
    """The deprecated ``Power`` resource: ``PowerSupplies`` (value: last output watts)
    and ``Voltages`` with thresholds."""
    out: list[BmcSensor] = []
    for psu in _objects(doc.get("PowerSupplies")):
        out.append(
            BmcSensor(
                name=_name(psu, "Name", "MemberId"),
                kind="psu",
                value=_num(psu.get("LastPowerOutputWatts", psu.get("PowerOutputWatts"))),
                unit="W",
                status=sensor_status(psu.get("Status")),
            )
        )
    for volt in _objects(doc.get("Voltages")):
        out.append(
            BmcSensor(
                name=_name(volt, "Name", "MemberId"),
                kind="voltage",
                value=_num(volt.get("ReadingVolts")),
                unit="V",
                status=sensor_status(volt.get("Status")),
                lower_critical=_num(volt.get("LowerThresholdCritical")),
                upper_critical=_num(volt.get("UpperThresholdCritical")),
            )
        )
    return out


def sensor_from_fan(doc: Mapping[str, Any]) -> BmcSensor:
    """A ThermalSubsystem ``Fan`` resource: RPM when it reports ``SpeedRPM``, else %."""
    speed = doc.get("SpeedPercent")
    speed = speed if isinstance(speed, Mapping) else {}
    rpm = _num(speed.get("SpeedRPM"))
    value, unit = (rpm, "rpm") if rpm is not None else (_num(speed.get("Reading")), "%")
    return BmcSensor(
        name=_name(doc, "Name", "Id"),
        kind="fan",
        value=value,
        unit=unit,
        status=sensor_status(doc.get("Status")),
    )


def _threshold(thresholds: Mapping[str, Any], key: str) -> float | None:
    entry = thresholds.get(key)
    return _num(entry.get("Reading")) if isinstance(entry, Mapping) else None


def sensor_from_sensor(doc: Mapping[str, Any], kind: str = "") -> BmcSensor:
    """A ``Sensor`` resource (Reading, ReadingUnits, Thresholds.Lower/UpperCritical)."""
    thresholds = doc.get("Thresholds")
    thresholds = thresholds if isinstance(thresholds, Mapping) else {}
    units = str(doc.get("ReadingUnits", ""))
    return BmcSensor(
        name=_name(doc, "Name", "Id"),
        kind=kind or _READING_KINDS.get(str(doc.get("ReadingType", "")), "other"),
        value=_num(doc.get("Reading")),
        unit=_UNITS.get(units, units),
        status=sensor_status(doc.get("Status")),
        lower_critical=_threshold(thresholds, "LowerCritical"),
        upper_critical=_threshold(thresholds, "UpperCritical"),
    )


def temperatures_from_metrics(doc: Mapping[str, Any]) -> list[tuple[BmcSensor, str]]:
    """ThermalMetrics ``TemperatureReadingsCelsius`` -> (sensor, DataSourceUri) pairs; the
    Sensor resource behind the URI, when read, adds status and thresholds."""
    out: list[tuple[BmcSensor, str]] = []
    for entry in _objects(doc.get("TemperatureReadingsCelsius")):
        sensor = BmcSensor(
            name=_name(entry, "DeviceName", "DataSourceUri"),
            kind="temperature",
            value=_num(entry.get("Reading")),
            unit="C",
            status="unknown",
        )
        uri = entry.get("DataSourceUri")
        out.append((sensor, uri if isinstance(uri, str) else ""))
    return out


def sensor_from_power_supply(
    doc: Mapping[str, Any], metrics: Mapping[str, Any] | None
) -> BmcSensor:
    """A PowerSubsystem ``PowerSupply`` (+ its ``Metrics``: OutputPowerWatts)."""
    value = None
    if metrics is not None and isinstance(out := metrics.get("OutputPowerWatts"), Mapping):
        value = _num(out.get("Reading"))
    return BmcSensor(
        name=_name(doc, "Name", "Id"),
        kind="psu",
        value=value,
        unit="W",
        status=sensor_status(doc.get("Status")),
    )


def members(doc: Mapping[str, Any]) -> list[str]:
    """A collection's member URIs."""
    return [
        m["@odata.id"] for m in _objects(doc.get("Members")) if isinstance(m.get("@odata.id"), str)
    ]


def link(doc: Mapping[str, Any], key: str) -> str:
    """``doc[key]["@odata.id"]`` or ""."""
    value = doc.get(key)
    if isinstance(value, Mapping) and isinstance(uri := value.get("@odata.id"), str):
        return uri
    return ""


def _objects(value: object) -> Iterable[Mapping[str, Any]]:
    if isinstance(value, list):
        yield from (v for v in value if isinstance(v, Mapping))


def rollup(system_health: str, sensors: Iterable[BmcSensor]) -> str:
    """The reading's health: the system's own, worsened by any critical/warning sensor."""
    statuses = {s.status for s in sensors}
    order = ["", "ok", "warning", "critical"]
    worst = max(
        [system_health, *(s for s in ("critical", "warning") if s in statuses)], key=order.index
    )
    return worst


# --- the client -------------------------------------------------------------------------


def ssl_context(verify: bool, cafile: str | None = None) -> ssl.SSLContext:
    """A client TLS context; ``verify=False`` accepts any certificate (self-signed BMCs)."""
    ctx = ssl.create_default_context(cafile=cafile)
    if not verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


class RedfishClient:
    """An authenticated Redfish session with one BMC; use as ``async with``.

    ``auth``: ``basic`` sends the credentials with every request; ``session`` logs in
    (POST ``SessionService/Sessions``), sends ``X-Auth-Token`` and deletes the session on
    close; ``auto`` tries a session and falls back to basic when the service has no
    SessionService.  Without a user, requests go unauthenticated.
    """

    def __init__(
        self,
        base_url: str,
        *,
        user: str = "",
        password: str = "",
        auth: AuthMode = "auto",
        verify_tls: bool = True,
        cafile: str | None = None,
        timeout_s: float = 3.0,
        retries: int = 1,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.user = user
        self.password = password
        self.auth = auth
        self.retries = retries
        self._ssl = ssl_context(verify_tls, cafile)
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._http: aiohttp.ClientSession | None = None
        self._headers: dict[str, str] = {"Accept": "application/json", "OData-Version": "4.0"}
        self.session_uri = ""
        """The session resource this client created (deleted on close)."""

    async def __aenter__(self) -> RedfishClient:
        self._http = aiohttp.ClientSession(
            timeout=self._timeout, connector=aiohttp.TCPConnector(ssl=self._ssl, limit=4)
        )
        try:
            await self._login()
        except BaseException:
            await self._http.close()
            raise
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if self.session_uri:
                await self._logout()
        finally:
            if self._http is not None:
                await self._http.close()

    async def _login(self) -> None:
        if not self.user:
            return
        basic = base64.b64encode(f"{self.user}:{self.password}".encode()).decode()
        if self.auth == "basic":
            self._headers["Authorization"] = f"Basic {basic}"
            return
        body = {"UserName": self.user, "Password": self.password}
        status, headers, _ = await self.request("POST", f"{ROOT}/SessionService/Sessions", body)
        if status in (200, 201) and (token := headers.get("X-Auth-Token")):
            self._headers["X-Auth-Token"] = token
            self.session_uri = headers.get("Location", "")
            return
        if status in (401, 403):
            raise RedfishAuthError(
                f"authentication failed: HTTP {status} for user {self.user!r} "
                f"(POST {ROOT}/SessionService/Sessions)"
            )
        if self.auth == "session":
            raise RedfishError(f"session login: HTTP {status}, no X-Auth-Token")
        self._headers["Authorization"] = f"Basic {basic}"  # auto: no SessionService

    async def _logout(self) -> None:
        uri = self.session_uri
        self.session_uri = ""
        # on failure the BMC expires the session after its SessionTimeout
        with contextlib.suppress(RedfishError, aiohttp.ClientError, TimeoutError):
            await self.request("DELETE", uri)

    def _url(self, path: str) -> str:
        return path if path.startswith(("http://", "https://")) else self.base_url + path

    async def request(
        self,
        method: str,
        path: str,
        body: Json | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[int, Mapping[str, str], Json | None]:
        """One request, retried on connection errors and timeouts (never on an HTTP
        answer); returns (status, headers, JSON body or None)."""
        assert self._http is not None, "use RedfishClient as `async with`"
        last: Exception | None = None
        for _attempt in range(self.retries + 1):
            try:
                async with self._http.request(
                    method, self._url(path), json=body, headers={**self._headers, **(headers or {})}
                ) as resp:
                    data: Json | None = None
                    if resp.content_type == "application/json":
                        loaded = await resp.json()
                        data = loaded if isinstance(loaded, dict) else None
                    else:
                        await resp.read()
                    return resp.status, resp.headers, data
            except aiohttp.ClientConnectorCertificateError as exc:
                raise RedfishError(
                    f"TLS certificate not trusted: {exc.certificate_error}"
                ) from None
            except (aiohttp.ClientConnectionError, TimeoutError) as exc:
                last = exc
        what = type(last).__name__ if last is not None else "error"
        raise RedfishError(f"{method} {path}: {what}: {last}".rstrip(": "))

    async def get(self, path: str) -> tuple[Json, str]:
        """GET a resource: (document, ETag or ""); RedfishError unless 200 + JSON."""
        status, headers, data = await self.request("GET", path)
        _check(status, "GET", path, data)
        if data is None:
            raise RedfishError(f"GET {path}: answer is not a JSON object")
        return data, headers.get("ETag", "")

    async def post(self, path: str, body: Json) -> Json | None:
        """POST an action; RedfishError unless 2xx."""
        status, _, data = await self.request("POST", path, body)
        _check(status, "POST", path, data)
        return data

    async def patch(self, path: str, body: Json, etag: str = "") -> Json | None:
        """PATCH a resource (with ``If-Match`` when an ETag is known); RedfishError unless 2xx."""
        headers = {"If-Match": etag} if etag else {}
        status, _, data = await self.request("PATCH", path, body, headers)
        _check(status, "PATCH", path, data)
        return data


def _check(status: int, method: str, path: str, data: Json | None) -> None:
    if 200 <= status < 300:
        return
    detail = _extended_message(data)
    if status in (401, 403):
        raise RedfishAuthError(f"authentication failed: HTTP {status} on {method} {path}{detail}")
    raise RedfishError(f"{method} {path}: HTTP {status}{detail}")


def _extended_message(data: Json | None) -> str:
    if not data or not isinstance(err := data.get("error"), Mapping):
        return ""
    infos = [i.get("Message") for i in _objects(err.get("@Message.ExtendedInfo"))]
    text = "; ".join(str(m) for m in infos if m) or str(err.get("message", ""))
    return f" ({text})" if text else ""


def base_url(target: BmcTarget) -> str:
    """``https://host:port`` of a target (IPv6 hosts bracketed); ``http://host:port``
    when its address is an ``http://`` URL (plain HTTP, no TLS)."""
    return target.endpoint(DEFAULT_PORT).url


def client_for(target: BmcTarget, *, cafile: str | None = None) -> RedfishClient:
    """A client for a target: its credentials file, TLS setting, timeout and retries;
    ``profile`` ``basic`` or ``session`` forces that authentication (default auto)."""
    user = password = ""
    if target.credentials:
        creds = load_credentials(target.credentials)
        user, password = creds.user, creds.password
    auth: AuthMode = "auto"
    if target.profile == "basic":
        auth = "basic"
    elif target.profile == "session":
        auth = "session"
    return RedfishClient(
        base_url(target),
        user=user,
        password=password,
        auth=auth,
        verify_tls=target.verify_tls,
        cafile=cafile,
        timeout_s=target.timeout_s,
        retries=target.retries,
    )


# --- the walk ---------------------------------------------------------------------------


async def first_system(client: RedfishClient, root: Json | None = None) -> tuple[str, Json, str]:
    """(URI, document, ETag) of the service's first ComputerSystem."""
    if root is None:
        root, _ = await client.get(f"{ROOT}/")
    systems_uri = link(root, "Systems")
    if not systems_uri:
        raise RedfishError("service root has no Systems")
    systems, _ = await client.get(systems_uri)
    uris = members(systems)
    if not uris:
        raise RedfishError(f"{systems_uri} has no members")
    doc, etag = await client.get(uris[0])
    return uris[0], doc, etag


async def _maybe(client: RedfishClient, uri: str) -> Json | None:
    if not uri:
        return None
    try:
        doc, _ = await client.get(uri)
    except RedfishAuthError:
        raise
    except RedfishError:
        return None
    return doc


async def chassis_sensors(client: RedfishClient, chassis: Mapping[str, Any]) -> list[BmcSensor]:
    """One chassis' fans, temperatures, voltages and power supplies."""
    out: list[BmcSensor] = []
    thermal_sub = await _maybe(client, link(chassis, "ThermalSubsystem"))
    if thermal_sub is not None:
        fans = await _maybe(client, link(thermal_sub, "Fans"))
        fan_docs = await asyncio.gather(*(_maybe(client, u) for u in members(fans or {})))
        out += [sensor_from_fan(d) for d in fan_docs if d is not None]
        metrics = await _maybe(client, link(thermal_sub, "ThermalMetrics"))
        pairs = temperatures_from_metrics(metrics or {})
        details = await asyncio.gather(*(_maybe(client, uri) for _, uri in pairs))
        for (sensor, _), detail in zip(pairs, details, strict=True):
            out.append(sensor_from_sensor(detail, "temperature") if detail else sensor)
    elif (thermal := await _maybe(client, link(chassis, "Thermal"))) is not None:
        out += sensors_from_thermal(thermal)
    power_sub = await _maybe(client, link(chassis, "PowerSubsystem"))
    if power_sub is not None:
        psus = await _maybe(client, link(power_sub, "PowerSupplies"))
        psu_docs = await asyncio.gather(*(_maybe(client, u) for u in members(psus or {})))
        for doc in psu_docs:
            if doc is not None:
                metrics = await _maybe(client, link(doc, "Metrics"))
                out.append(sensor_from_power_supply(doc, metrics))
    elif (power := await _maybe(client, link(chassis, "Power"))) is not None:
        out += sensors_from_power(power)
    return out


async def collect(client: RedfishClient) -> BmcReading:
    """Walk one logged-in service into a reading (RedfishError when the walk fails)."""
    root, _ = await client.get(f"{ROOT}/")
    _, system, _ = await first_system(client, root)
    state, system_health = system_state(system)
    sensors: list[BmcSensor] = []
    if chassis_uri := link(root, "Chassis"):
        collection, _ = await client.get(chassis_uri)
        for uri in members(collection):
            chassis = await _maybe(client, uri)
            if chassis is not None:
                sensors += await chassis_sensors(client, chassis)
    return BmcReading(
        source=SOURCE,
        reachable=True,
        power_state=state,
        health=rollup(system_health, sensors),
        sensors=tuple(sensors),
    )


async def read_bmc(target: BmcTarget, *, cafile: str | None = None) -> BmcReading:
    """Read one BMC over Redfish; never raises (failures are ``reachable=False``).

    The whole walk is bounded by ``timeout_s * (retries + 1) * 4`` seconds.
    """
    budget = target.timeout_s * (target.retries + 1) * 4
    try:
        async with asyncio.timeout(budget):
            async with client_for(target, cafile=cafile) as client:
                reading = await collect(client)
                return msgspec.structs.replace(reading, node=target.node)
    except RedfishError as exc:
        message = str(exc)
    except TimeoutError:
        message = f"no complete answer within {budget:g}s"
    except (aiohttp.ClientError, ssl.SSLError, OSError, ValueError) as exc:
        message = f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # a credentials file error, a BMC answering nonsense
        message = f"{type(exc).__name__}: {exc}"
    return BmcReading(source=SOURCE, node=target.node, reachable=False, message=message)
