"""Pure parsing of ``smartctl --json`` output (smartmontools >= 7.0); no I/O here.

smartctl's exit status is a bitmask, not a success flag: it is decoded, never used to
decide whether stdout holds JSON.  Bits 0-2 mean smartctl got no (or partial) data and
become an error naming the cause; bits 3-7 describe the disk and stay on the reading.
Field names follow smartmontools 7.3 (``ataprint.cpp``, ``nvmeprint.cpp``, ``scsiprint.cpp``).
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import msgspec

from metalguard.proto.telemetry import NVME_CRITICAL_WARNING_BITS, SmartDevice

_UINT64_MAX = 2**64 - 1
"""Largest count the wire (msgpack) carries; NVMe counters are 128-bit in theory."""


class SmartJsonError(ValueError):
    """smartctl output that is not a JSON object (old smartctl, crash, wrong program)."""


class ExitStatus(enum.IntFlag):
    """smartctl's exit status bits (smartctl(8), EXIT STATUS)."""

    COMMAND_LINE = 1 << 0
    OPEN_FAILED = 1 << 1
    SMART_COMMAND_FAILED = 1 << 2
    DISK_FAILING = 1 << 3
    PREFAIL_AT_THRESHOLD = 1 << 4
    PAST_AT_THRESHOLD = 1 << 5
    ERROR_LOG_HAS_RECORDS = 1 << 6
    SELFTEST_LOG_HAS_ERRORS = 1 << 7


EXIT_MEANINGS: dict[ExitStatus, str] = {
    ExitStatus.COMMAND_LINE: "command line did not parse",
    ExitStatus.OPEN_FAILED: "open failed",
    ExitStatus.SMART_COMMAND_FAILED: "a SMART command failed",
    ExitStatus.DISK_FAILING: "disk failing",
    ExitStatus.PREFAIL_AT_THRESHOLD: "prefail attribute at or below threshold",
    ExitStatus.PAST_AT_THRESHOLD: "an attribute was at or below threshold in the past",
    ExitStatus.ERROR_LOG_HAS_RECORDS: "error log has records",
    ExitStatus.SELFTEST_LOG_HAS_ERRORS: "self-test log has errors",
}
"""One phrase per bit, as smartctl(8) words it."""

NO_DATA = ExitStatus.COMMAND_LINE | ExitStatus.OPEN_FAILED | ExitStatus.SMART_COMMAND_FAILED
"""Bits that mean smartctl could not read (all of) the device's SMART data."""

CAPABILITY_HINT = "smartctl needs CAP_SYS_RAWIO for ATA/SCSI and CAP_SYS_ADMIN for NVMe"
_DENIED = re.compile(r"Permission denied|Operation not permitted")
_LOW_POWER = re.compile(r"Device is in (\S+)(?: \(OS\))? mode")
_LEADING_INT = re.compile(r"\s*(\d+)")
_NVME_NAME = re.compile(r"nvme\d+")
_SD_NAME = re.compile(r"sd[a-z]+")


def decode_exit_status(status: int) -> ExitStatus:
    """The set bits of a smartctl exit status (only the low 8 bits exist)."""
    return ExitStatus(status & 0xFF)


def describe_exit_status(status: int) -> list[str]:
    """The meaning of each set bit, lowest bit first (empty for 0)."""
    flags = decode_exit_status(status)
    return [text for bit, text in EXIT_MEANINGS.items() if bit in flags]


def describe_critical_warning(value: int) -> list[str]:
    """The meaning of each set NVMe critical-warning bit (unknown bits are named by number)."""
    out = [text for bit, text in NVME_CRITICAL_WARNING_BITS.items() if value >> bit & 1]
    out += [f"bit {bit}" for bit in range(6, 8) if value >> bit & 1]
    return out


def load_json(doc: Mapping[str, Any] | bytes | str) -> Mapping[str, Any]:
    """``doc`` as a JSON object; raises :class:`SmartJsonError` if it is not one."""
    if isinstance(doc, Mapping):
        return doc
    try:
        loaded = json.loads(doc)
    except (ValueError, UnicodeDecodeError) as exc:
        raise SmartJsonError(f"not valid JSON: {exc}") from None
    if not isinstance(loaded, dict):
        raise SmartJsonError(f"JSON is a {type(loaded).__name__}, not an object")
    return loaded


def _obj(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _count(value: object) -> int | None:
    """A non-negative integer the wire can carry, else None (bools are not counts)."""
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if 0 <= value <= _UINT64_MAX else None


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _text(value: object) -> str:
    return value.strip() if isinstance(value, str) else ""


def _raw_count(row: Mapping[str, Any]) -> int | None:
    """An ATA attribute's raw count: the leading number of ``raw.string`` (smartctl has
    already unpacked vendor formats there), else ``raw.value``."""
    raw = _obj(row.get("raw"))
    match = _LEADING_INT.match(_text(raw.get("string")))
    if match:
        return _count(int(match.group(1)))
    return _count(raw.get("value"))


def _raw_temperature(row: Mapping[str, Any]) -> float | None:
    """Attribute 194/190: ``raw.value`` packs min/max in its high bytes; use the string's
    leading number, else the low byte."""
    raw = _obj(row.get("raw"))
    match = _LEADING_INT.match(_text(raw.get("string")))
    if match:
        return float(match.group(1))
    value = _count(raw.get("value"))
    return float(value & 0xFF) if value is not None else None


def _ata_table(doc: Mapping[str, Any]) -> dict[int, Mapping[str, Any]]:
    table = _obj(doc.get("ata_smart_attributes")).get("table")
    rows = table if isinstance(table, list) else []
    return {
        row["id"]: row
        for row in rows
        if isinstance(row, Mapping) and _count(row.get("id")) is not None
    }


def _protocol(doc: Mapping[str, Any]) -> str:
    protocol = _text(_obj(doc.get("device")).get("protocol"))
    if protocol:
        return protocol
    if "nvme_smart_health_information_log" in doc:
        return "NVMe"
    if "ata_smart_attributes" in doc:
        return "ATA"
    if any(key.startswith("scsi_") for key in doc):
        return "SCSI"
    return ""


def _device_name(doc: Mapping[str, Any], fallback: str) -> str:
    """``device.name``; qualified by its ``-d`` type when that addresses a disk behind a
    controller (``megaraid,0``), since several disks then share one name."""
    device = _obj(doc.get("device"))
    name = _text(device.get("name")) or fallback
    dev_type = _text(device.get("type"))
    return f"{name} -d {dev_type}" if "," in dev_type else name


def _model(doc: Mapping[str, Any]) -> str:
    return (
        _text(doc.get("model_name"))
        or _text(doc.get("scsi_model_name"))
        or " ".join(filter(None, (_text(doc.get("scsi_vendor")), _text(doc.get("scsi_product")))))
    )


def smartctl_exit_status(doc: Mapping[str, Any]) -> int | None:
    """``smartctl.exit_status`` from the envelope, if present."""
    return _count(_obj(doc.get("smartctl")).get("exit_status"))


def smartctl_messages(doc: Mapping[str, Any]) -> list[str]:
    """The ``smartctl.messages[].string`` texts, in order."""
    messages = _obj(doc.get("smartctl")).get("messages")
    items = messages if isinstance(messages, list) else []
    return [s for m in items if (s := _text(_obj(m).get("string")))]


def parse_smartctl_json(
    doc: Mapping[str, Any] | bytes | str, *, fallback_name: str = ""
) -> SmartDevice:
    """One ``smartctl --json -a`` output as a :class:`SmartDevice`.

    Fields that do not apply to the device's protocol (or that smartctl did not print)
    are None.  ``passed`` is ``smart_status.passed``; an NVMe with a non-zero critical
    warning, or exit status bit 3 (disk failing), is never passed.  ``fallback_name``
    names the device when the output has no ``device`` key (open failures).  Raises
    :class:`SmartJsonError` if ``doc`` is not a JSON object.
    """
    doc = load_json(doc)
    protocol = _protocol(doc)
    exit_status = smartctl_exit_status(doc)
    nvme = _obj(doc.get("nvme_smart_health_information_log"))
    ata = _ata_table(doc)

    def ata_count(attr_id: int) -> int | None:
        row = ata.get(attr_id)
        return _raw_count(row) if row is not None else None

    temperature = _number(_obj(doc.get("temperature")).get("current"))
    if temperature is None:
        temperature = _number(nvme.get("temperature"))
    if temperature is None:
        row = ata.get(194) or ata.get(190)
        temperature = _raw_temperature(row) if row is not None else None

    power_on_hours = _count(_obj(doc.get("power_on_time")).get("hours"))
    if power_on_hours is None:
        power_on_hours = _count(nvme.get("power_on_hours")) if nvme else ata_count(9)

    passed_raw = _obj(doc.get("smart_status")).get("passed")
    passed = passed_raw if isinstance(passed_raw, bool) else None
    critical_warning = _count(nvme.get("critical_warning"))
    if critical_warning:
        passed = False
    if exit_status is not None and ExitStatus.DISK_FAILING in decode_exit_status(exit_status):
        passed = False

    return SmartDevice(
        device=_device_name(doc, fallback_name),
        protocol=protocol,
        model=_model(doc),
        serial=_text(doc.get("serial_number")),
        passed=passed,
        exit_status=exit_status,
        temperature_c=temperature,
        power_on_hours=power_on_hours,
        critical_warning=critical_warning,
        media_errors=_count(nvme.get("media_errors")),
        percentage_used=_count(nvme.get("percentage_used")),
        available_spare=_count(nvme.get("available_spare")),
        num_err_log_entries=_count(nvme.get("num_err_log_entries")),
        unsafe_shutdowns=_count(nvme.get("unsafe_shutdowns")),
        reallocated_sectors=ata_count(5),
        pending_sectors=ata_count(197),
        offline_uncorrectable=ata_count(198),
        reported_uncorrectable=ata_count(187),
        grown_defects=_count(doc.get("scsi_grown_defect_list")),
    )


class SmartOutcome(NamedTuple):
    """What one smartctl output means: a reading, an error message, or both."""

    device: SmartDevice | None
    error: str | None
    low_power_mode: str = ""
    """Set (e.g. ``STANDBY``) when ``-n standby`` skipped a sleeping disk: not an error."""


def _has_health_data(doc: Mapping[str, Any]) -> bool:
    keys = ("smart_status", "nvme_smart_health_information_log", "ata_smart_attributes")
    return any(key in doc for key in keys) or "scsi_grown_defect_list" in doc


def interpret_output(
    doc: Mapping[str, Any] | bytes | str,
    *,
    fallback_name: str = "",
    returncode: int | None = None,
) -> SmartOutcome:
    """Decide what one ``smartctl --json -a`` output says.

    * A disk that ``-n standby`` left asleep: the device with no health fields, no error.
    * Exit bits 0-2 ("no data"): an error naming the cause and smartctl's own messages;
      the device too if the output still carries health data (a partial read).
    * Otherwise: the device.

    ``returncode`` (the process's) stands in for a missing ``smartctl.exit_status``.
    Raises :class:`SmartJsonError` if ``doc`` is not a JSON object.
    """
    doc = load_json(doc)
    device = parse_smartctl_json(doc, fallback_name=fallback_name)
    status = device.exit_status
    if status is None and returncode is not None and returncode >= 0:
        status = returncode
        device = _with_exit_status(device, status)
    messages = smartctl_messages(doc)
    for message in messages:
        match = _LOW_POWER.search(message)
        if match:
            return SmartOutcome(device, None, match.group(1))
    no_data = decode_exit_status(status or 0) & NO_DATA
    if not no_data:
        return SmartOutcome(device, None)
    causes = ", ".join(describe_exit_status(no_data))
    error = f"no SMART data (smartctl exit status {status}: {causes})"
    if messages:
        error += ": " + "; ".join(messages)
    return SmartOutcome(device if _has_health_data(doc) else None, with_permission_hint(error))


def with_permission_hint(message: str) -> str:
    """``message``, plus which capabilities smartctl needs if it says access was denied."""
    return f"{message} ({CAPABILITY_HINT})" if _DENIED.search(message) else message


def _with_exit_status(device: SmartDevice, status: int) -> SmartDevice:
    passed = False if ExitStatus.DISK_FAILING in decode_exit_status(status) else device.passed
    return msgspec.structs.replace(device, exit_status=status, passed=passed)


class ScanEntry(NamedTuple):
    """A device to query: its name and ``-d`` type (empty: let smartctl detect it)."""

    name: str
    type: str = ""
    protocol: str = ""
    open_error: str = ""
    """Set by ``--scan-open`` when smartctl could not open the device."""


def parse_scan(doc: Mapping[str, Any] | bytes | str) -> list[ScanEntry]:
    """The ``devices`` of ``smartctl --scan-open --json`` (or ``--scan``), in order.

    Raises :class:`SmartJsonError` if ``doc`` is not a JSON object.
    """
    devices = load_json(doc).get("devices")
    out = []
    for item in devices if isinstance(devices, list) else []:
        entry = _obj(item)
        name = _text(entry.get("name"))
        if name:
            out.append(
                ScanEntry(
                    name,
                    _text(entry.get("type")),
                    _text(entry.get("protocol")),
                    _text(entry.get("open_error")),
                )
            )
    return out


def _natural(name: str) -> tuple[int, str]:
    """Sort nvme2 before nvme10 and sdz before sdaa."""
    return len(name), name


def devices_from_sysfs(nvme_class: Iterable[str], block: Iterable[str]) -> list[ScanEntry]:
    """Fallback discovery from directory listings of ``<sysfs>/class/nvme`` (``nvmeN`` ->
    ``/dev/nvmeN``, an NVMe controller) and ``<sysfs>/block`` (``sdX`` -> ``/dev/sdX``,
    type left to smartctl).  Other names (nvme-subsys, dm-*, md*, partitions) are skipped."""
    nvme = sorted((n for n in nvme_class if _NVME_NAME.fullmatch(n)), key=_natural)
    disks = sorted((n for n in block if _SD_NAME.fullmatch(n)), key=_natural)
    return [ScanEntry(f"/dev/{n}", "nvme", "NVMe") for n in nvme] + [
        ScanEntry(f"/dev/{n}") for n in disks
    ]


def smartctl_args(smartctl: str, entry: ScanEntry) -> list[str]:
    """The argv that reads one device: ``--json -a``, its ``-d`` type if known, and
    ``-n standby`` unless it is known not to be ATA (so sleeping disks stay asleep)."""
    argv = [smartctl, "--json", "-a"]
    if entry.type:
        argv += ["-d", entry.type]
    protocol = entry.protocol.upper()
    if protocol not in ("NVME", "SCSI") and not entry.type.startswith(("nvme", "scsi")):
        argv += ["-n", "standby"]
    return [*argv, entry.name]
