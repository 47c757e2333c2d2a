"""IPMI sensors out of band: ``ipmitool`` or FreeIPMI's ``ipmi-sensors`` as a subprocess.

The parsers are pure (text in, :class:`IpmiParse` out) and accept the formats the tools
print: ``ipmitool sdr elist`` (v2, five ``|`` columns), ``ipmitool sdr`` (v1, three
columns), ``ipmitool -c sdr`` (CSV) and ``ipmi-sensors --comma-separated-output``.  A line
that fits none of them (``Unable to send command: Invalid argument`` and similar noise
the tools interleave on a busy BMC) is skipped and counted, never fatal.

:func:`read_bmc` runs the tool with a timeout and turns the result into a
:class:`proto.telemetry.BmcReading`; a missing tool, a timeout or a failing exit are a
reading with ``reachable=False`` and the reason, never a raise.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

from metalguard.agent.bmc.credentials import load_credentials
from metalguard.agent.bmc.targets import BmcTarget
from metalguard.proto.telemetry import BmcReading, BmcSensor
from metalguard.runtime.deadlines import within

SOURCE: Final = "ipmi"
DEFAULT_PORT: Final = 623

_STATUS: Final[dict[str, str]] = {
    "ok": "ok",
    "ns": "absent",  # no sensor / not available
    "na": "absent",
    "nc": "warning",
    "lnc": "warning",
    "unc": "warning",
    "cr": "critical",
    "lcr": "critical",
    "ucr": "critical",
    "nr": "critical",
    "lnr": "critical",
    "unr": "critical",
}
"""ipmitool's sensor status column -> BmcSensor.status."""

_UNITS: Final[dict[str, tuple[str, str]]] = {
    "rpm": ("fan", "rpm"),
    "degrees c": ("temperature", "C"),
    "c": ("temperature", "C"),
    "volts": ("voltage", "V"),
    "v": ("voltage", "V"),
    "amps": ("current", "A"),
    "a": ("current", "A"),
    "watts": ("power", "W"),
    "w": ("power", "W"),
}
"""Unit text (lower case) -> (BmcSensor.kind, unit as docs/bmc.md names it)."""

FREEIPMI_SDR_CACHE: Final = os.path.join(tempfile.gettempdir(), "metalguard-freeipmi")
"""ipmi-sensors' SDR cache (its default, ~/.freeipmi, is read-only under the unit)."""
_PSU_RE: Final = re.compile(r"\b(power supply|psu\d*|ps\s?\d+)\b", re.IGNORECASE)
_READING_RE: Final = re.compile(r"^(-?\d+(?:\.\d+)?)\s*(.*)$")
_HEX_RE: Final = re.compile(r"^0x[0-9a-fA-F]+$")


@dataclass
class IpmiParse:
    """What a parser made of one tool output."""

    sensors: list[BmcSensor] = field(default_factory=list)
    skipped: int = 0
    """Lines that fit no known format (tool noise), skipped."""
    skipped_lines: list[str] = field(default_factory=list)
    """The first few skipped lines, for the reading's message."""

    def skip(self, line: str) -> None:
        """Count a line that is not a sensor row."""
        self.skipped += 1
        if len(self.skipped_lines) < 3:
            self.skipped_lines.append(line.strip())


def _kind_unit(name: str, unit_text: str) -> tuple[str, str]:
    unit_key = unit_text.strip().lower()
    kind, unit = _UNITS.get(unit_key, ("other", unit_text.strip()))
    if _PSU_RE.search(name):
        kind = "psu"
    elif kind == "other" and "fan" in name.lower():
        kind = "fan"
    return kind, unit


def _status(text: str) -> str:
    return _STATUS.get(text.strip().lower(), "unknown")


def sensor_from_reading(name: str, reading: str, status: str) -> BmcSensor:
    """One sensor from ipmitool's name, reading text (``5040 RPM``, ``110 Watts, Presence
    detected``, ``0x00``, ``No Reading``) and status column."""
    first = reading.split(",", 1)[0].strip()
    value: float | None = None
    unit_text = ""
    if _HEX_RE.match(first):
        unit_text = "discrete"
    elif match := _READING_RE.match(first):
        value = float(match.group(1))
        unit_text = match.group(2)
    kind, unit = _kind_unit(name, unit_text)
    if unit == "discrete":
        unit = ""
    return BmcSensor(name=name.strip(), kind=kind, value=value, unit=unit, status=_status(status))


def elist_row(line: str) -> BmcSensor | None:
    """One ``ipmitool sdr elist`` (v2) row ``name | id | status | entity | reading``."""
    cols = [c.strip() for c in line.split("|")]
    if len(cols) != 5 or not cols[0] or not re.fullmatch(r"[0-9A-Fa-f]+h", cols[1]):
        return None
    return sensor_from_reading(cols[0], cols[4], cols[2])


def v1_row(line: str) -> BmcSensor | None:
    """One ``ipmitool sdr`` (v1) row ``name | reading | status``."""
    cols = [c.strip() for c in line.split("|")]
    if len(cols) != 3 or not cols[0] or cols[2].lower() not in _STATUS:
        return None
    return sensor_from_reading(cols[0], cols[1], cols[2])


def sensor_row(line: str) -> BmcSensor | None:
    """One ``ipmitool sensor`` row ``name | value | unit | status | lnr | lcr | lnc | unc |
    ucr | unr`` (``na`` where a value or threshold is absent; a discrete sensor's status
    column is its state bit mask, read as ``unknown``)."""
    cols = [c.strip() for c in line.split("|")]
    if len(cols) != 10 or not cols[0]:
        return None
    name, value_text, unit_text, status = cols[:4]
    discrete = unit_text == "discrete"
    if status.lower() not in _STATUS and not (discrete and _HEX_RE.match(status)):
        return None
    kind, unit = _kind_unit(name, "" if discrete else unit_text)
    value = None if _HEX_RE.match(value_text) else _float(value_text)
    return BmcSensor(
        name=name,
        kind=kind,
        value=value,
        unit=unit,
        status="unknown" if discrete else _status(status),  # discrete: a state bit mask
        lower_critical=_float(cols[5]),
        upper_critical=_float(cols[8]),
    )


def csv_row(line: str) -> BmcSensor | None:
    """One ``ipmitool -c sdr`` row ``name,value,unit,status`` (``name,0x00,discrete,ok``)."""
    cols = [c.strip() for c in next(csv.reader([line]))]
    if len(cols) < 4 or not cols[0] or cols[3].lower() not in _STATUS:
        return None
    name, value_text, unit_text, status = cols[:4]
    kind, unit = _kind_unit(name, "" if unit_text == "discrete" else unit_text)
    return BmcSensor(
        name=name, kind=kind, value=_float(value_text), unit=unit, status=_status(status)
    )


def _parse_rows(text: str, rows: Sequence[Callable[[str], BmcSensor | None]]) -> IpmiParse:
    out = IpmiParse()
    for line in text.splitlines():
        if not line.strip():
            continue
        for row in rows:
            if (sensor := row(line)) is not None:
                out.sensors.append(sensor)
                break
        else:
            out.skip(line)
    return out


def parse_sdr_elist(text: str) -> IpmiParse:
    """``ipmitool sdr elist`` (v2) output."""
    return _parse_rows(text, (elist_row,))


def parse_sdr_v1(text: str) -> IpmiParse:
    """``ipmitool sdr`` (v1) output."""
    return _parse_rows(text, (v1_row,))


def parse_sdr_csv(text: str) -> IpmiParse:
    """``ipmitool -c sdr`` output."""
    return _parse_rows(text, (csv_row,))


def _float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


_FREEIPMI_EVENT: Final[dict[str, str]] = {
    "ok": "ok",
    "n/a": "unknown",
    "presence detected": "ok",
    "device present": "ok",
    "device absent": "absent",
    "device removed/device absent": "absent",
    "at or below (<=) lower non-critical threshold": "warning",
    "at or above (>=) upper non-critical threshold": "warning",
    "at or below (<=) lower critical threshold": "critical",
    "at or above (>=) upper critical threshold": "critical",
    "at or below (<=) lower non-recoverable threshold": "critical",
    "at or above (>=) upper non-recoverable threshold": "critical",
    "power supply failure detected": "critical",
    "predictive failure": "warning",
}


def _freeipmi_status(event: str) -> str:
    text = event.strip().strip("'").strip().lower()
    if text in _FREEIPMI_EVENT:
        return _FREEIPMI_EVENT[text]
    if "critical" in text or "failure" in text or "non-recoverable" in text:
        return "critical"
    if "non-critical" in text or "warning" in text:
        return "warning"
    return "unknown"


def parse_ipmi_sensors_csv(text: str) -> IpmiParse:
    """FreeIPMI ``ipmi-sensors --comma-separated-output`` (header row first; with
    ``--output-sensor-thresholds`` the ``Lower C``/``Upper C`` columns give thresholds)."""
    out = IpmiParse()
    header: list[str] | None = None
    for line in text.splitlines():
        if not line.strip():
            continue
        cols = [c.strip() for c in next(csv.reader([line]))]
        if header is None:
            if len(cols) >= 5 and cols[0] == "ID" and cols[1] == "Name":
                header = cols
            else:
                out.skip(line)
            continue
        if len(cols) != len(header) or not cols[0].isdigit():
            out.skip(line)
            continue
        row = dict(zip(header, cols, strict=True))
        kind, unit = _kind_unit(row["Name"], row.get("Units", ""))
        if kind == "other":
            kind = _freeipmi_kind(row.get("Type", ""), kind)
        out.sensors.append(
            BmcSensor(
                name=row["Name"],
                kind=kind,
                value=_float(row.get("Reading", "")),
                unit="" if unit == "N/A" else unit,
                status=_freeipmi_status(row.get("Event", "")),
                lower_critical=_float(row.get("Lower C", "")),
                upper_critical=_float(row.get("Upper C", "")),
            )
        )
    return out


def _freeipmi_kind(sensor_type: str, default: str) -> str:
    return {
        "temperature": "temperature",
        "fan": "fan",
        "voltage": "voltage",
        "current": "current",
        "power supply": "psu",
    }.get(sensor_type.strip().lower(), default)


def parse_sdr(text: str) -> IpmiParse:
    """Any of the formats above: FreeIPMI CSV when its header row is there, else each
    line as whichever ipmitool row shape (v2 elist, v1, ``sensor``, CSV) it fits."""
    if any(line.startswith("ID,Name,") for line in text.splitlines()[:5]):
        return parse_ipmi_sensors_csv(text)
    return _parse_rows(text, (elist_row, v1_row, sensor_row, csv_row))


def parse_chassis_power(text: str) -> str:
    """``ipmitool chassis power status`` (``Chassis Power is on``) -> ``on``/``off``, or ""."""
    match = re.search(r"Chassis Power is (on|off)", text, re.IGNORECASE)
    return match.group(1).lower() if match else ""


def parse_dcmi_power(text: str) -> BmcSensor | None:
    """``ipmitool dcmi power reading`` -> the instantaneous power as a sensor, or None."""
    match = re.search(r"Instantaneous power reading:\s*(-?\d+(?:\.\d+)?)\s*Watts", text)
    if match is None:
        return None
    return BmcSensor(name="DCMI Power", kind="power", value=float(match.group(1)), unit="W")


def health_of(sensors: Sequence[BmcSensor]) -> str:
    """Roll-up of the sensors' status: ``critical``, ``warning`` or ``ok`` ("" if none)."""
    statuses = {s.status for s in sensors}
    if "critical" in statuses:
        return "critical"
    if "warning" in statuses:
        return "warning"
    return "ok" if sensors else ""


# --- the subprocess -------------------------------------------------------------------


@dataclass(frozen=True)
class ToolResult:
    """How one tool run ended."""

    ok: bool
    stdout: str = ""
    message: str = ""


async def run_tool(
    argv: Sequence[str], timeout_s: float, env: dict[str, str] | None = None
) -> ToolResult:
    """Run ``argv`` with a timeout; a missing tool, a timeout or a non-zero exit are a
    ToolResult with ``ok=False`` and the reason (stderr's last line for an exit)."""
    exe = shutil.which(argv[0], path=(env or os.environ).get("PATH"))
    if exe is None:
        return ToolResult(False, message=f"{argv[0]} not found on PATH")
    try:
        proc = await asyncio.create_subprocess_exec(
            exe,
            *argv[1:],
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
    except OSError as exc:
        return ToolResult(False, message=f"{argv[0]}: cannot run: {exc}")
    try:
        stdout, stderr = await within(proc.communicate(), timeout_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        return ToolResult(False, message=f"{argv[0]} timed out after {timeout_s:g}s")
    out = stdout.decode("utf-8", "replace")
    if proc.returncode != 0:
        err = stderr.decode("utf-8", "replace").strip().splitlines()
        why = err[-1] if err else "no message"
        return ToolResult(False, stdout=out, message=f"{argv[0]} exited {proc.returncode}: {why}")
    return ToolResult(True, stdout=out)


def credentials_of(target: BmcTarget) -> tuple[str, str]:
    """(user, password) from the target's credentials file, ("", "") without one."""
    if not target.credentials:
        return "", ""
    creds = load_credentials(target.credentials)
    return creds.user, creds.password


@dataclass(frozen=True)
class IpmiProfile:
    """How to talk IPMI to a target, from its ``profile`` (docs/bmc.md)."""

    tool: str = "ipmitool"
    """``ipmitool`` or ``freeipmi`` (``ipmi-sensors``)."""
    cipher: int | None = None
    """RMCP+ cipher suite id (``-C`` / ``-I``); None lets the tool choose."""
    thresholds: bool = False
    """ipmitool: read ``ipmitool sensor`` (with thresholds; slower) instead of ``sdr elist``."""
    workarounds: tuple[str, ...] = ()
    """freeipmi: ``-W`` workaround flags for BMCs that bend the protocol (``opensesspriv``)."""


def parse_profile(profile: str) -> IpmiProfile:
    """``""``, ``ipmitool`` or ``freeipmi``, with optional ``cipher=N``, ``thresholds``
    (ipmitool) and ``workaround=FLAG`` (freeipmi), comma-separated: ``cipher=3``,
    ``thresholds,cipher=3``, ``freeipmi,cipher=3,workaround=opensesspriv``.
    ValueError naming the bad part."""
    tool, cipher, thresholds = "ipmitool", None, False
    workarounds: list[str] = []
    for part in (p.strip() for p in profile.split(",") if p.strip()):
        if part in ("ipmitool", "freeipmi"):
            tool = part
        elif part == "thresholds":
            thresholds = True
        elif part.startswith("cipher=") and part[7:].isdigit() and int(part[7:]) <= 17:
            cipher = int(part[7:])
        elif part.startswith("workaround=") and re.fullmatch(r"[a-z0-9]+", part[11:]):
            workarounds.append(part[11:])
        else:
            raise ValueError(
                f"profile: {part!r} is not ipmitool, freeipmi, thresholds, cipher=N (0-17)"
                " or workaround=FLAG"
            )
    if workarounds and tool != "freeipmi":
        raise ValueError("profile: workaround=FLAG needs freeipmi")
    if thresholds and tool != "ipmitool":
        raise ValueError("profile: thresholds is an ipmitool option (freeipmi reads them anyway)")
    return IpmiProfile(tool, cipher, thresholds, tuple(workarounds))


def ipmitool_argv(target: BmcTarget, user: str, *command: str) -> list[str]:
    """``ipmitool -I lanplus -H host -p port [-C n] [-U user -E] <command>`` for a target;
    the password travels in ``IPMI_PASSWORD`` (``-E``), never on the command line."""
    host, port = target.host_port(DEFAULT_PORT)
    argv = ["ipmitool", "-I", "lanplus", "-H", host, "-p", str(port)]
    argv += ["-N", f"{max(1, round(target.timeout_s))}", "-R", str(target.retries + 1)]
    if (cipher := parse_profile(target.profile).cipher) is not None:
        argv += ["-C", str(cipher)]
    if user:
        argv += ["-U", user, "-E"]
    return [*argv, *command]


def ipmi_sensors_argv(target: BmcTarget, config_file: str = "") -> list[str]:
    """FreeIPMI ``ipmi-sensors`` for a target; user and password come from
    ``config_file`` (freeipmi.conf format), never the command line."""
    host, port = target.host_port(DEFAULT_PORT)
    argv = ["ipmi-sensors", "-D", "LAN_2_0", "-h", f"{host}:{port}"]
    argv += ["--session-timeout", str(int(target.timeout_s * 1000))]
    argv += ["--retransmission-timeout", str(max(1, int(target.timeout_s * 1000) // 2))]
    profile = parse_profile(target.profile)
    if profile.cipher is not None:
        argv += ["-I", str(profile.cipher)]
    if profile.workarounds:
        argv += ["-W", ",".join(profile.workarounds)]
    os.makedirs(FREEIPMI_SDR_CACHE, mode=0o700, exist_ok=True)  # FreeIPMI does not create it
    argv += ["--quiet-cache", "--sdr-cache-directory", FREEIPMI_SDR_CACHE]
    if config_file:
        argv += ["--config-file", config_file]
    return [*argv, "--comma-separated-output", "--output-sensor-thresholds"]


def tool_env(password: str) -> dict[str, str]:
    """The subprocess environment: ours plus ``IPMI_PASSWORD`` when there is one."""
    env = dict(os.environ)
    if password:
        env["IPMI_PASSWORD"] = password
    return env


async def read_bmc(target: BmcTarget, *, tool: str = "") -> BmcReading:
    """Read a BMC's sensors and chassis power over IPMI; never raises.

    ``target.profile`` (:func:`parse_profile`) picks the tool: ``freeipmi`` runs
    ``ipmi-sensors``, else ``ipmitool sdr elist`` then ``ipmitool chassis power status``.
    ``tool`` overrides the executable (a path), for tests and unusual installs.
    """
    try:
        profile = parse_profile(target.profile)
        user, password = credentials_of(target)
    except Exception as exc:  # a bad profile or credentials file fails this reading only
        return BmcReading(source=SOURCE, node=target.node, reachable=False, message=str(exc))
    budget = target.timeout_s * (target.retries + 1) + 1.0
    power_state = ""
    if profile.tool == "freeipmi":
        with tempfile.NamedTemporaryFile("w", prefix="mg-freeipmi-", suffix=".conf") as conf:
            if user:
                conf.write(f"username {user}\n")
            if password:
                conf.write(f"password {password}\n")
            conf.flush()  # NamedTemporaryFile is created 0600
            argv = ipmi_sensors_argv(target, conf.name)
            if tool:
                argv[0] = tool
            result = await run_tool(argv, budget)
    else:
        env = tool_env(password)
        command = ("sensor",) if profile.thresholds else ("sdr", "elist")
        argv = ipmitool_argv(target, user, *command)
        if tool:
            argv[0] = tool
        result = await run_tool(argv, budget, env)
        if result.ok:
            power_argv = ipmitool_argv(target, user, "chassis", "power", "status")
            power_argv[0] = argv[0]
            power = await run_tool(power_argv, budget, env)
            power_state = parse_chassis_power(power.stdout) if power.ok else ""
    if not result.ok:
        return BmcReading(source=SOURCE, node=target.node, reachable=False, message=result.message)
    parsed = parse_sdr(result.stdout)
    message = ""
    if parsed.skipped:
        message = f"skipped {parsed.skipped} unparsable line(s): {'; '.join(parsed.skipped_lines)}"
    return BmcReading(
        source=SOURCE,
        node=target.node,
        reachable=True,
        power_state=power_state,
        health=health_of(parsed.sensors),
        sensors=tuple(parsed.sensors),
        message=message,
    )
