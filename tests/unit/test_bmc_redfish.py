"""The pure Redfish document -> reading functions over the trimmed DMTF mockup."""

from __future__ import annotations

import json
from typing import Any

from metalguard.agent.bmc import redfish
from metalguard.agent.bmc.targets import BmcTarget
from metalguard.proto.telemetry import BmcSensor
from tests.support import FIXTURES

MOCKUP = FIXTURES / "redfish" / "public-rackmount1" / "redfish" / "v1"


def doc(path: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((MOCKUP / path / "index.json").read_text())
    return loaded


def test_system_power_state_and_health() -> None:
    assert redfish.system_state(doc("Systems/437XR1138R2")) == ("on", "ok")
    assert redfish.system_state(
        {"PowerState": "PoweringOff", "Status": {"Health": "Critical"}}
    ) == (
        "powering_off",
        "critical",
    )
    assert redfish.system_state({}) == ("", "")
    assert redfish.power_state("Paused") == "paused"
    assert redfish.power_state(None) == ""


def test_legacy_thermal() -> None:
    sensors = {s.name: s for s in redfish.sensors_from_thermal(doc("Chassis/1U/Thermal"))}
    assert sensors["CPU1 Temp"] == BmcSensor(
        name="CPU1 Temp", kind="temperature", value=41.0, unit="C", status="ok", upper_critical=45.0
    )
    assert sensors["CPU2 Temp"].status == "unknown"  # Disabled, no Health
    assert sensors["Chassis Intake Temp"].lower_critical == 5.0
    assert sensors["BaseBoard System Fan"] == BmcSensor(
        name="BaseBoard System Fan", kind="fan", value=2100.0, unit="rpm", status="ok"
    )


def test_thermal_v1_0_fan_names_and_rpm() -> None:
    old = {
        "Fans": [
            {"FanName": "Fan 3", "ReadingRPM": 7000, "Status": {"State": "Absent"}},
            {"Name": "Fan 4", "Reading": 40, "ReadingUnits": "Percent", "Status": {}},
        ]
    }
    fan3, fan4 = redfish.sensors_from_thermal(old)
    assert (fan3.name, fan3.value, fan3.unit, fan3.status) == ("Fan 3", 7000.0, "rpm", "absent")
    assert (fan4.value, fan4.unit, fan4.status) == (40.0, "%", "unknown")


def test_legacy_power() -> None:
    psu, vrm = redfish.sensors_from_power(doc("Chassis/1U/Power"))
    assert psu == BmcSensor(
        name="Power Supply Bay", kind="psu", value=325.0, unit="W", status="warning"
    )
    assert (vrm.kind, vrm.value, vrm.lower_critical, vrm.upper_critical) == (
        "voltage",
        12.0,
        11.0,
        13.0,
    )


def test_thermal_subsystem_fan_sensor_and_metrics() -> None:
    bay1 = redfish.sensor_from_fan(doc("Chassis/1U/ThermalSubsystem/Fans/Bay1"))
    assert (bay1.value, bay1.unit, bay1.status) == (2200.0, "rpm", "ok")
    percent_only = redfish.sensor_from_fan({"Name": "F", "SpeedPercent": {"Reading": 30}})
    assert (percent_only.value, percent_only.unit) == (30.0, "%")
    pairs = redfish.temperatures_from_metrics(doc("Chassis/1U/ThermalSubsystem/ThermalMetrics"))
    assert [(s.name, s.value, uri.rsplit("/", 1)[-1]) for s, uri in pairs] == [
        ("Intake", 24.8, "IntakeTemp"),
        ("Exhaust", 40.5, "ExhaustTemp"),
    ]
    intake = redfish.sensor_from_sensor(doc("Chassis/1U/Sensors/IntakeTemp"))
    assert intake == BmcSensor(
        name="Front Panel Intake Temperature",
        kind="temperature",
        value=24.8,
        unit="C",
        status="ok",
        lower_critical=5.0,
        upper_critical=40.0,
    )


def test_power_subsystem_supply() -> None:
    bay1 = redfish.sensor_from_power_supply(
        doc("Chassis/1U/PowerSubsystem/PowerSupplies/Bay1"),
        doc("Chassis/1U/PowerSubsystem/PowerSupplies/Bay1/Metrics"),
    )
    assert (bay1.kind, bay1.value, bay1.status) == ("psu", 325.0, "warning")
    bay2 = redfish.sensor_from_power_supply(
        doc("Chassis/1U/PowerSubsystem/PowerSupplies/Bay2"), None
    )
    assert (bay2.value, bay2.status) == (None, "absent")


def test_garbage_documents_do_not_raise() -> None:
    assert redfish.sensors_from_thermal({"Temperatures": "nope", "Fans": [1, None]}) == []
    assert redfish.sensors_from_power({"PowerSupplies": [{"Name": 3, "Status": "x"}]}) == [
        BmcSensor(name="?", kind="psu", unit="W", status="unknown")
    ]
    assert redfish.members({"Members": [{"@odata.id": 5}, {}]}) == []
    assert redfish.link({"Thermal": []}, "Thermal") == ""
    odd = redfish.sensor_from_sensor({"Reading": True, "Thresholds": {"UpperCritical": 3}})
    assert (odd.value, odd.upper_critical, odd.kind) == (None, None, "other")


def test_rollup_and_base_url() -> None:
    crit = BmcSensor(name="f", kind="fan", status="critical")
    assert redfish.rollup("ok", [crit]) == "critical"
    assert redfish.rollup("warning", []) == "warning"
    assert redfish.rollup("", [BmcSensor(name="t", kind="temperature", status="ok")]) == ""
    t = BmcTarget(node="a.b.c", address="10.0.0.5", protocol="redfish")
    assert redfish.base_url(t) == "https://10.0.0.5:443"
    v6 = BmcTarget(node="a.b.c", address="[fd00::5]:8443", protocol="redfish")
    assert redfish.base_url(v6) == "https://[fd00::5]:8443"
