"""smartctl JSON parsing, exit-status decoding, discovery and assessment, over real outputs."""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from metalguard.agent.collectors.smart_assess import SmartThresholds, assess, is_failing
from metalguard.agent.collectors.smart_parse import (
    CAPABILITY_HINT,
    NO_DATA,
    ExitStatus,
    ScanEntry,
    SmartJsonError,
    decode_exit_status,
    describe_critical_warning,
    describe_exit_status,
    devices_from_sysfs,
    interpret_output,
    parse_scan,
    parse_smartctl_json,
    smartctl_args,
)
from metalguard.proto.telemetry import SmartDevice
from tests.support import FIXTURES

SMARTCTL = FIXTURES / "smartctl"
ALL_JSON = sorted(SMARTCTL.glob("*.json"))
SAMSUNG = "smartctl_exporter__nvme-null-SAMSUNG_MZWLL3T2HAJQ-00005-nvme0.json"
INTEL = "smartctl_exporter__nvme-null-INTEL_SSDPEDMD800G4-nvme0.json"
MICRON = "smartctl_exporter__nvme-null-Micron_7450_MTFDKCB3T8TFR-nvme6.json"
SEAGATE_ATA = "smartctl_exporter__ST3500418AS_12.json"
HGST = "smartctl_exporter__HGST_HUS724020ALE640_28.json"
SEAGATE_SCSI = "smartctl_exporter__SEAGATE_ST373453LC_26.json"
TELEGRAF = "telegraf__nvme_response.json"

NVME_FIELDS = (
    "critical_warning",
    "media_errors",
    "percentage_used",
    "available_spare",
    "num_err_log_entries",
    "unsafe_shutdowns",
)
ATA_FIELDS = ("reallocated_sectors", "pending_sectors", "offline_uncorrectable")


def load(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((SMARTCTL / name).read_bytes())
    return doc


def parse(name: str) -> SmartDevice:
    return parse_smartctl_json((SMARTCTL / name).read_bytes())


# Error envelopes as smartctl 7.3 printed them on this machine (no "device" key).
OPEN_FAILED: dict[str, Any] = {
    "json_format_version": [1, 0],
    "smartctl": {
        "version": [7, 3],
        "argv": ["smartctl", "--json", "-a", "-d", "nvme", "/dev/nonexistent-mg"],
        "messages": [
            {
                "string": "Smartctl open device: /dev/nonexistent-mg failed: No such device",
                "severity": "error",
            }
        ],
        "exit_status": 2,
    },
}


# ---------------------------------------------------------------- every fixture parses


def test_fixture_set_is_complete() -> None:
    assert len(ALL_JSON) == 7


@pytest.mark.parametrize("path", ALL_JSON, ids=lambda p: p.name)
def test_every_fixture_parses_and_survives_the_wire(path: Path) -> None:
    device = parse_smartctl_json(path.read_bytes())
    assert device.device.startswith("/dev/")
    assert device.protocol in ("NVMe", "ATA", "SCSI")
    assert device.model
    assert device.passed is not None
    assert device.temperature_c is not None
    assert device.power_on_hours is not None
    # decoding with the wire type re-checks every NonNegInt constraint
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(device), type=SmartDevice)
    assert wire == device
    outcome = interpret_output(path.read_bytes())
    assert outcome.error is None
    assert outcome.device == device


EXPECTED: dict[str, dict[str, Any]] = {
    SAMSUNG: dict(
        device="/dev/nvme0",
        protocol="NVMe",
        model="SAMSUNG MZWLL3T2HAJQ-00005",
        passed=False,
        exit_status=8,
        critical_warning=0x10,
        temperature_c=40.0,
        power_on_hours=18376,
        unsafe_shutdowns=4,
        available_spare=100,
        percentage_used=0,
    ),
    INTEL: dict(
        device="/dev/nvme0",
        model="INTEL SSDPEDMD800G4",
        passed=True,
        exit_status=0,
        percentage_used=51,
        available_spare=93,
        critical_warning=0,
        media_errors=0,
        power_on_hours=54704,
        temperature_c=30.0,
    ),
    MICRON: dict(
        device="/dev/nvme6",
        passed=True,
        percentage_used=0,
        available_spare=100,
        power_on_hours=150,
        temperature_c=27.0,
    ),
    SEAGATE_ATA: dict(
        device="/dev/sda",
        protocol="ATA",
        model="ST3500418AS",
        passed=True,
        exit_status=0,
        reallocated_sectors=304,
        pending_sectors=0,
        offline_uncorrectable=0,
        reported_uncorrectable=0,
        temperature_c=33.0,
        power_on_hours=44668,
    ),
    HGST: dict(
        device="/dev/sdb",
        protocol="ATA",
        passed=True,
        exit_status=64,
        reallocated_sectors=0,
        reported_uncorrectable=None,  # the HGST has no attribute 187
        temperature_c=26.0,
        power_on_hours=83425,
    ),
    SEAGATE_SCSI: dict(
        device="/dev/sdb",
        protocol="SCSI",
        model="SEAGATE ST373453LC",
        passed=True,
        grown_defects=260,
        temperature_c=33.0,
        power_on_hours=102880,
    ),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_values(name: str) -> None:
    device = parse(name)
    for field, want in EXPECTED[name].items():
        assert getattr(device, field) == want, field


@pytest.mark.parametrize(
    ("name", "none_fields"),
    [
        (SEAGATE_SCSI, (*NVME_FIELDS, *ATA_FIELDS, "reported_uncorrectable")),
        (SEAGATE_ATA, (*NVME_FIELDS, "grown_defects")),
        (MICRON, (*ATA_FIELDS, "reported_uncorrectable", "grown_defects")),
    ],
)
def test_fields_of_other_protocols_are_none(name: str, none_fields: tuple[str, ...]) -> None:
    device = parse(name)
    assert {f: getattr(device, f) for f in none_fields} == dict.fromkeys(none_fields)


def _influx_line(text: str) -> tuple[dict[str, str], dict[str, str]]:
    """Tags and fields of one influx line-protocol line (escaped spaces in tags)."""
    head, fields, _ts = re.split(r"(?<!\\) ", text.strip())
    tags = dict(t.split("=", 1) for t in re.split(r"(?<!\\),", head)[1:])
    return (
        {k: v.replace("\\ ", " ") for k, v in tags.items()},
        dict(f.split("=", 1) for f in fields.split(",")),
    )


def test_telegraf_nvme_matches_telegrafs_own_parse() -> None:
    tags, fields = _influx_line((SMARTCTL / "telegraf__nvme_expected.out").read_text())
    device = parse(TELEGRAF)
    assert device.device == tags["name"]
    assert device.model == tags["model"]
    assert device.serial == tags["serial"]
    assert device.passed is (fields["health_ok"] == "true")
    for ours, theirs in [
        ("critical_warning", "critical_warning"),
        ("media_errors", "media_errors"),
        ("percentage_used", "percentage_used"),
        ("available_spare", "available_spare"),
        ("num_err_log_entries", "num_err_log_entries"),
        ("power_on_hours", "power_on_hours"),
        ("unsafe_shutdowns", "unsafe_shutdowns"),
        ("temperature_c", "temperature"),
    ]:
        assert getattr(device, ours) == int(fields[theirs].rstrip("i")), ours
    assert device.num_err_log_entries == 4871


# ---------------------------------------------------------------- exit status


@pytest.mark.parametrize(
    ("bit", "meaning"),
    [
        (0, "command line did not parse"),
        (1, "open failed"),
        (2, "a SMART command failed"),
        (3, "disk failing"),
        (4, "prefail attribute at or below threshold"),
        (5, "an attribute was at or below threshold in the past"),
        (6, "error log has records"),
        (7, "self-test log has errors"),
    ],
)
def test_each_exit_bit_decodes(bit: int, meaning: str) -> None:
    assert decode_exit_status(1 << bit) == ExitStatus(1 << bit)
    assert describe_exit_status(1 << bit) == [meaning]
    assert (ExitStatus(1 << bit) in NO_DATA) is (bit <= 2)


def test_exit_status_combinations() -> None:
    assert decode_exit_status(0) == ExitStatus(0)
    assert describe_exit_status(0) == []
    assert describe_exit_status(8 | 64) == ["disk failing", "error log has records"]
    assert decode_exit_status(0x1FF) == ExitStatus(0xFF)  # only 8 bits exist
    assert describe_exit_status(parse(HGST).exit_status or 0) == ["error log has records"]


def test_hgst_error_log_records_are_not_a_failure() -> None:
    device = parse(HGST)
    assert device.passed is True
    assert ExitStatus.ERROR_LOG_HAS_RECORDS in decode_exit_status(device.exit_status or 0)
    assert assess(device) == []


def test_disk_failing_bit_means_not_passed() -> None:
    doc = load(SEAGATE_ATA)
    doc["smartctl"]["exit_status"] = 8
    assert parse_smartctl_json(doc).passed is False
    del doc["smartctl"]["exit_status"]
    assert parse_smartctl_json(doc).exit_status is None
    outcome = interpret_output(doc, returncode=8)
    assert outcome.device is not None
    assert (outcome.device.exit_status, outcome.device.passed) == (8, False)


def test_nvme_critical_warning_overrides_passed() -> None:
    doc = load(MICRON)
    doc["nvme_smart_health_information_log"]["critical_warning"] = 0x04
    assert doc["smart_status"]["passed"] is True  # a doctored file: status says passed
    assert parse_smartctl_json(doc).passed is False
    assert describe_critical_warning(0x15) == [
        "available spare below threshold",
        "reliability degraded",
        "volatile memory backup failed",
    ]


# ---------------------------------------------------------------- no-data outputs


def test_open_failed_is_an_error_naming_the_cause() -> None:
    outcome = interpret_output(json.dumps(OPEN_FAILED).encode(), fallback_name="/dev/x")
    assert outcome.device is None
    assert outcome.error is not None
    assert "open failed" in outcome.error
    assert "No such device" in outcome.error
    assert "exit status 2" in outcome.error
    # the parse itself still works and uses the fallback name
    device = parse_smartctl_json(OPEN_FAILED, fallback_name="/dev/x")
    assert (device.device, device.exit_status, device.passed) == ("/dev/x", 2, None)


def test_permission_denied_names_the_capabilities() -> None:
    doc = copy.deepcopy(OPEN_FAILED)
    doc["smartctl"]["messages"][0]["string"] = (
        "Smartctl open device: /dev/sda failed: Permission denied"
    )
    error = interpret_output(doc).error
    assert error is not None
    assert CAPABILITY_HINT in error
    assert "CAP_SYS_RAWIO" in error
    assert "CAP_SYS_ADMIN" in error


def test_partial_read_keeps_the_device_and_reports_the_error() -> None:
    doc = load(SEAGATE_ATA)
    doc["smartctl"]["exit_status"] = 4
    outcome = interpret_output(doc)
    assert outcome.device is not None
    assert outcome.device.reallocated_sectors == 304
    assert outcome.error is not None
    assert "a SMART command failed" in outcome.error


def test_standby_disk_is_not_an_error() -> None:
    doc: dict[str, Any] = {
        "smartctl": {
            "messages": [
                {"string": "Device is in STANDBY mode, exit(2)", "severity": "information"}
            ],
            "exit_status": 2,
        },
        "device": {"name": "/dev/sdc", "type": "sat", "protocol": "ATA"},
    }
    outcome = interpret_output(doc)
    assert outcome.error is None
    assert outcome.low_power_mode == "STANDBY"
    assert outcome.device is not None
    assert (outcome.device.device, outcome.device.passed) == ("/dev/sdc", None)


@pytest.mark.parametrize("data", [b"", b"{not json", b"[1, 2]", b"\xff\xfe", b"smartctl 6.6 ..."])
def test_non_json_raises_smart_json_error(data: bytes) -> None:
    with pytest.raises(SmartJsonError):
        parse_smartctl_json(data)
    with pytest.raises(SmartJsonError):
        interpret_output(data)
    with pytest.raises(SmartJsonError):
        parse_scan(data)


# ---------------------------------------------------------------- field details


def test_ata_temperature_falls_back_to_attribute_194_string_then_low_byte() -> None:
    doc = load(SEAGATE_ATA)
    del doc["temperature"]
    row = next(r for r in doc["ata_smart_attributes"]["table"] if r["id"] == 194)
    assert row["raw"]["value"] > 255  # vendor-packed: taken whole it would be nonsense
    assert parse_smartctl_json(doc).temperature_c == 33.0
    del row["raw"]["string"]
    assert parse_smartctl_json(doc).temperature_c == 33.0


def test_ata_count_uses_the_leading_number_of_raw_string() -> None:
    doc = load(SEAGATE_ATA)
    row = next(r for r in doc["ata_smart_attributes"]["table"] if r["id"] == 5)
    row["raw"] = {"value": 0x0000_0002_0000_0007, "string": "7 (2 0)"}
    assert parse_smartctl_json(doc).reallocated_sectors == 7


def test_megaraid_disks_get_distinct_names() -> None:
    doc = load(SEAGATE_ATA)
    doc["device"] = {"name": "/dev/bus/0", "type": "sat+megaraid,3", "protocol": "ATA"}
    assert parse_smartctl_json(doc).device == "/dev/bus/0 -d sat+megaraid,3"


_json_scalar = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
_json = st.recursive(
    _json_scalar,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=8,
)
_KEYS = [
    ("smartctl", "exit_status"),
    ("smartctl", "messages"),
    ("device", "name"),
    ("device", "type"),
    ("smart_status", "passed"),
    ("temperature", "current"),
    ("power_on_time", "hours"),
    ("nvme_smart_health_information_log", "critical_warning"),
    ("nvme_smart_health_information_log", "media_errors"),
    ("ata_smart_attributes", "table"),
]


@given(
    base=st.sampled_from([SAMSUNG, SEAGATE_ATA, SEAGATE_SCSI]),
    edits=st.lists(st.tuples(st.sampled_from(_KEYS), _json), max_size=4),
    top=st.dictionaries(st.sampled_from(["scsi_grown_defect_list", "model_name"]), _json),
)
def test_garbage_values_never_raise_and_stay_wire_valid(
    base: str, edits: list[tuple[tuple[str, str], Any]], top: dict[str, Any]
) -> None:
    doc = load(base)
    for (outer, inner), value in edits:
        if not isinstance(doc.get(outer), dict):
            doc[outer] = {}
        doc[outer][inner] = value
    doc.update(top)
    outcome = interpret_output(json.dumps(doc).encode())
    if outcome.device is not None:
        msgspec.msgpack.decode(msgspec.msgpack.encode(outcome.device), type=SmartDevice)
    assert outcome.device is not None or outcome.error


# ---------------------------------------------------------------- discovery


def test_parse_scan() -> None:
    doc = {
        "smartctl": {"exit_status": 0},
        "devices": [
            {"name": "/dev/sda", "info_name": "/dev/sda [SAT]", "type": "sat", "protocol": "ATA"},
            {"name": "/dev/nvme0", "info_name": "/dev/nvme0", "type": "nvme", "protocol": "NVMe"},
            {
                "name": "/dev/sdb",
                "type": "scsi",
                "protocol": "SCSI",
                "open_error": "Permission denied",
            },
            {"info_name": "no name: skipped"},
            "not an object",
        ],
    }
    assert parse_scan(json.dumps(doc).encode()) == [
        ScanEntry("/dev/sda", "sat", "ATA"),
        ScanEntry("/dev/nvme0", "nvme", "NVMe"),
        ScanEntry("/dev/sdb", "scsi", "SCSI", "Permission denied"),
    ]
    # what smartctl 7.3 prints on a machine without disks: no "devices" key
    assert parse_scan({"json_format_version": [1, 0], "smartctl": {"exit_status": 0}}) == []


def test_devices_from_sysfs_listing_of_the_node_exporter_tree() -> None:
    sysfs = FIXTURES / "node_exporter" / "sys"
    entries = devices_from_sysfs(os.listdir(sysfs / "class/nvme"), os.listdir(sysfs / "block"))
    assert entries == [
        ScanEntry("/dev/nvme0", "nvme", "NVMe"),
        *(ScanEntry(f"/dev/{n}") for n in ("sda", "sdi", "sdj", "sdk", "sdl", "sdm", "sdn")),
    ]


def test_devices_from_sysfs_filters_and_sorts_naturally() -> None:
    nvme = ["nvme10", "nvme2", "nvme-subsys0", "nvme0n1", "nvme-fabrics"]
    block = ["sdaa", "sdz", "sda", "sda1", "dm-0", "md0", "nvme0n1", "loop0"]
    assert [e.name for e in devices_from_sysfs(nvme, block)] == [
        "/dev/nvme2",
        "/dev/nvme10",
        "/dev/sda",
        "/dev/sdz",
        "/dev/sdaa",
    ]


@pytest.mark.parametrize(
    ("entry", "argv"),
    [
        (ScanEntry("/dev/nvme0", "nvme", "NVMe"), ["-d", "nvme", "/dev/nvme0"]),
        (ScanEntry("/dev/sda", "sat", "ATA"), ["-d", "sat", "-n", "standby", "/dev/sda"]),
        (ScanEntry("/dev/sdb", "scsi", "SCSI"), ["-d", "scsi", "/dev/sdb"]),
        (ScanEntry("/dev/sdc"), ["-n", "standby", "/dev/sdc"]),
    ],
)
def test_smartctl_args(entry: ScanEntry, argv: list[str]) -> None:
    assert smartctl_args("smartctl", entry) == ["smartctl", "--json", "-a", *argv]


# ---------------------------------------------------------------- assess


def kinds(device: SmartDevice) -> list[str]:
    return [p.kind for p in assess(device)]


def test_samsung_with_critical_warning_is_failing() -> None:
    problems = assess(parse(SAMSUNG))
    assert [p.kind for p in problems] == ["failed"]
    assert is_failing(problems)
    assert "0x10" in problems[0].message
    assert "volatile memory backup failed" in problems[0].message


def test_intel_is_worn_not_failing() -> None:
    problems = assess(parse(INTEL))
    assert [(p.kind, p.severity, p.value) for p in problems] == [("worn", "degraded", 51)]
    assert not is_failing(problems)


@pytest.mark.parametrize("name", [MICRON, HGST, TELEGRAF])
def test_healthy_disks_are_not_flagged(name: str) -> None:
    assert assess(parse(name)) == []


def test_seagate_reallocated_and_scsi_grown_defects() -> None:
    assert [(p.kind, p.value) for p in assess(parse(SEAGATE_ATA))] == [("reallocated", 304)]
    assert [(p.kind, p.value) for p in assess(parse(SEAGATE_SCSI))] == [("grown_defects", 260)]


def test_thresholds_are_configurable() -> None:
    intel = parse(INTEL)
    assert assess(intel, SmartThresholds(worn_percentage_used=60)) == []
    seagate = parse(SEAGATE_ATA)
    assert assess(seagate, SmartThresholds(reallocated_sectors=500)) == []
    assert kinds(parse(MICRON)) == []
    assert [p.kind for p in assess(parse(MICRON), SmartThresholds(hot_celsius=27))] == ["hot"]


def test_each_rule() -> None:
    base = SmartDevice(device="/dev/x", passed=True, exit_status=0)
    assert assess(base) == []
    assert assess(SmartDevice(device="/dev/x")) == []  # nothing known, nothing flagged
    cases: dict[str, dict[str, Any]] = {
        "worn_out": dict(percentage_used=100),
        "low_spare": dict(available_spare=20),
        "media_errors": dict(media_errors=1),
        "pending": dict(pending_sectors=1),
        "offline_uncorrectable": dict(offline_uncorrectable=1),
        "reported_uncorrectable": dict(reported_uncorrectable=2),
        "prefail_threshold": dict(exit_status=16),
        "selftest_errors": dict(exit_status=128),
        "hot": dict(temperature_c=70.0),
    }
    for kind, fields in cases.items():
        assert kinds(msgspec.structs.replace(base, **fields)) == [kind], kind
    failing = {"worn_out", "prefail_threshold"}
    for kind, fields in cases.items():
        problems = assess(msgspec.structs.replace(base, **fields))
        assert is_failing(problems) is (kind in failing), kind
    # not problems: old error-log records, past threshold crossings, unsafe shutdowns
    quiet = dict(exit_status=32 | 64, num_err_log_entries=10_000, unsafe_shutdowns=500)
    assert kinds(msgspec.structs.replace(base, **quiet)) == []
