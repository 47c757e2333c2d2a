"""The IPMI parsers over real tool outputs (tests/fixtures/bmc, from telegraf's tests)."""

from __future__ import annotations

from collections import Counter

import pytest

from metalguard.agent.bmc import ipmi
from metalguard.proto.telemetry import BmcSensor
from tests.support import FIXTURES

BMC = FIXTURES / "bmc"
NOISE = "Unable to send command: Invalid argument"


def read(name: str) -> str:
    return (BMC / name).read_text()


@pytest.mark.parametrize(
    ("name", "sensors", "skipped"),
    [
        ("telegraf_ipmitool_sdr_elist_v2_curated.txt", 7, 0),
        ("telegraf_ipmitool_sdr_elist_v2_with_errors.txt", 7, 2),
        ("telegraf_ipmitool_sdr_v1_ibm.txt", 133, 0),
        ("telegraf_ipmitool_sdr_v1_with_errors.txt", 9, 3),
        ("telegraf_ipmitool_single_lines.txt", 5, 0),
    ],
)
def test_every_sdr_output_parses_and_noise_is_counted(
    name: str, sensors: int, skipped: int
) -> None:
    text = read(name)
    parsed = ipmi.parse_sdr(text)
    assert len(parsed.sensors) == sensors
    assert parsed.skipped == skipped
    assert parsed.skipped == text.count(NOISE)
    assert all(line == NOISE for line in parsed.skipped_lines)
    # every non-noise, non-empty line became exactly one sensor
    rows = [ln for ln in text.splitlines() if ln.strip() and ln != NOISE]
    assert [s.name for s in parsed.sensors] == [r.split("|")[0].strip() for r in rows]


def test_noisy_output_gives_the_same_sensors_as_clean_output() -> None:
    clean = ipmi.parse_sdr(read("telegraf_ipmitool_sdr_elist_v2_curated.txt"))
    noisy = ipmi.parse_sdr(read("telegraf_ipmitool_sdr_elist_v2_with_errors.txt"))
    assert noisy.sensors == clean.sensors


def test_elist_values_units_kinds_and_status() -> None:
    sensors = {
        s.name: s
        for s in ipmi.parse_sdr_elist(read("telegraf_ipmitool_sdr_elist_v2_curated.txt")).sensors
    }
    assert sensors["Fan1"] == BmcSensor(
        name="Fan1", kind="fan", value=5040.0, unit="rpm", status="ok"
    )
    assert sensors["Inlet Temp"] == BmcSensor(
        name="Inlet Temp", kind="temperature", value=25.0, unit="C", status="ok"
    )
    assert (sensors["Current 1"].kind, sensors["Current 1"].value, sensors["Current 1"].unit) == (
        "current",
        7.2,
        "A",
    )
    psu = sensors["Power Supply 1"]
    assert (psu.kind, psu.value, psu.unit, psu.status) == ("psu", 110.0, "W", "ok")
    assert sensors["SEL"].status == "absent"  # "ns", "No Reading"
    assert sensors["SEL"].value is None
    assert sensors["Intrusion"].value is None  # discrete sensor with an empty reading


def test_v1_ibm_values() -> None:
    parsed = ipmi.parse_sdr_v1(read("telegraf_ipmitool_sdr_v1_ibm.txt"))
    sensors = {s.name: s for s in parsed.sensors}
    assert sensors["Ambient Temp"].value == 20.0
    assert sensors["Ambient Temp"].kind == "temperature"
    assert (sensors["Planar 12V"].kind, sensors["Planar 12V"].value) == ("voltage", 12.04)
    assert (sensors["Fan 1A Tach"].kind, sensors["Fan 1A Tach"].value) == ("fan", 2610.0)
    assert (sensors["Avg Power"].kind, sensors["Avg Power"].unit) == ("power", "W")
    assert sensors["Fan 1"].value is None  # discrete 0x00, not the number 0
    assert sensors["DASD Backplane 3"].status == "absent"  # Not Readable | ns
    kinds = Counter(s.kind for s in parsed.sensors)
    assert kinds["fan"] >= 6
    assert kinds["psu"] >= 2


def test_negative_reading_and_mixed_single_lines() -> None:
    parsed = ipmi.parse_sdr(read("telegraf_ipmitool_single_lines.txt"))
    sensors = {s.name: s for s in parsed.sensors}
    assert sensors["DIMM Thrm Mrgn 1"].value == -55.0
    assert sensors["PS1 Status"].kind == "psu"
    assert sensors["Avg Power"].value == 210.0


def test_ipmitool_csv() -> None:
    text = (
        "Inlet Temp,25,degrees C,ok\n"
        "Fan1,5040,RPM,ok\n"
        "PS1 Status,0x02,discrete,ok\n"
        "CPU1 VCore,0.98,Volts,lcr\n"
        "bogus line\n"
    )
    parsed = ipmi.parse_sdr(text)
    assert [s.name for s in parsed.sensors] == ["Inlet Temp", "Fan1", "PS1 Status", "CPU1 VCore"]
    assert parsed.skipped == 1
    assert parsed.sensors[3].status == "critical"
    assert parsed.sensors[2].value is None


def test_freeipmi_comma_separated_output_with_thresholds() -> None:
    text = (
        "ID,Name,Type,Reading,Units,Lower NR,Lower C,Lower NC,Upper NC,Upper C,Upper NR,Event\n"
        "4,CPU Temp,Temperature,44.00,C,N/A,N/A,N/A,85.00,90.00,95.00,'OK'\n"
        "6,FAN 1,Fan,4500.00,RPM,300.00,500.00,700.00,N/A,N/A,N/A,'OK'\n"
        "9,VBAT,Voltage,2.85,V,N/A,2.70,2.80,N/A,N/A,N/A,"
        "'At or Below (<=) Lower Non-Critical Threshold'\n"
        "33,PS2 Status,Power Supply,N/A,N/A,N/A,N/A,N/A,N/A,N/A,N/A,"
        "'Presence detected' 'Power Supply input lost (AC/DC)' 'Power Supply Failure detected'\n"
        "Unable to establish IPMI v2 / RMCP+ session\n"
    )
    parsed = ipmi.parse_sdr(text)
    assert parsed.skipped == 1
    sensors = {s.name: s for s in parsed.sensors}
    assert sensors["CPU Temp"] == BmcSensor(
        name="CPU Temp", kind="temperature", value=44.0, unit="C", status="ok", upper_critical=90.0
    )
    assert (sensors["FAN 1"].kind, sensors["FAN 1"].lower_critical) == ("fan", 500.0)
    assert sensors["VBAT"].status == "warning"
    assert (sensors["PS2 Status"].kind, sensors["PS2 Status"].status) == ("psu", "critical")


def test_chassis_power_and_dcmi() -> None:
    assert ipmi.parse_chassis_power(read("telegraf_ipmitool_chassis_power_on.txt")) == "on"
    assert ipmi.parse_chassis_power("Chassis Power is off\n") == "off"
    assert ipmi.parse_chassis_power("Error: Unable to establish IPMI v2 / RMCP+ session") == ""
    dcmi = ipmi.parse_dcmi_power(read("telegraf_ipmitool_dcmi_power_reading.txt"))
    assert dcmi is not None
    assert (dcmi.kind, dcmi.value, dcmi.unit) == ("power", 167.0, "W")
    assert ipmi.parse_dcmi_power("nothing here") is None


def test_health_rollup() -> None:
    ok = BmcSensor(name="a", kind="fan", status="ok")
    warn = BmcSensor(name="b", kind="fan", status="warning")
    crit = BmcSensor(name="c", kind="fan", status="critical")
    assert ipmi.health_of([]) == ""
    assert ipmi.health_of([ok]) == "ok"
    assert ipmi.health_of([ok, warn]) == "warning"
    assert ipmi.health_of([warn, crit, ok]) == "critical"


def test_profile_options() -> None:
    assert ipmi.parse_profile("") == ipmi.IpmiProfile("ipmitool", None)
    assert ipmi.parse_profile("cipher=3") == ipmi.IpmiProfile("ipmitool", 3)
    assert ipmi.parse_profile("freeipmi, cipher=17") == ipmi.IpmiProfile("freeipmi", 17)
    assert ipmi.parse_profile("thresholds,cipher=3") == ipmi.IpmiProfile("ipmitool", 3, True)
    assert ipmi.parse_profile("freeipmi,workaround=opensesspriv,workaround=sun20").workarounds == (
        "opensesspriv",
        "sun20",
    )
    for bad in ("cipher=18", "cipher=x", "entity-sensor", "workaround=x", "freeipmi,thresholds"):
        with pytest.raises(ValueError, match="profile: "):
            ipmi.parse_profile(bad)


def test_ipmitool_sensor_list_with_thresholds() -> None:
    # `ipmitool sensor` as printed against OpenIPMI's ipmi_sim (ipmitool 1.8.19)
    text = (
        "Inlet Temp       | 25.000     | degrees C  | ok    | na        | na        | na"
        "        | 45.000    | 50.000    | 60.000    \n"
        "Fan1             | 5000.000   | RPM        | ok    | 300.000   | 400.000   | 500.000"
        "   | na        | na        | na        \n"
        "PS1 Status       | 0x1        | discrete   | 0x0100| na        | na        | na"
        "        | na        | na        | na        \n"
    )
    parsed = ipmi.parse_sdr(text)
    temp, fan, psu = parsed.sensors
    assert temp == BmcSensor(
        name="Inlet Temp",
        kind="temperature",
        value=25.0,
        unit="C",
        status="ok",
        upper_critical=50.0,
    )
    assert (fan.kind, fan.value, fan.lower_critical, fan.upper_critical) == (
        "fan",
        5000.0,
        400.0,
        None,
    )
    assert (psu.kind, psu.value, psu.status) == ("psu", None, "unknown")  # status: a bit mask
    assert parsed.skipped == 0
