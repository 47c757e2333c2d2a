"""SNMP profiles: ENTITY-SENSOR-MIB and Dell iDRAC rows -> sensors (pure)."""

from __future__ import annotations

import pytest

from metalguard.agent.bmc.snmp_profiles import (
    ENTITY_SENSOR,
    IDRAC_PROFILE,
    PROFILES,
    Walked,
    entity_sensor_value,
    join_columns,
    parse_oid,
    profile_named,
    worst_status,
)
from metalguard.proto.telemetry import BmcSensor


@pytest.mark.parametrize(
    ("raw", "scale", "precision", "expected"),
    [
        (5400, 9, 0, 5400.0),  # units
        (452, 9, 1, 45.2),  # one decimal place
        (23500, 8, 0, 23.5),  # milli
        (12150, 8, 0, 12.15),
        (125, 10, 2, 1250.0),  # kilo, two decimals
        (3, 11, 0, 3_000_000.0),  # mega
        (7, 14, 0, 7e18),  # exa is 14 in RFC 3433 (before peta)
        (7, 15, 0, 7e15),  # peta
        (42, 9, -2, 42.0),  # a negative precision is accuracy only
        (42, None, None, 42.0),
        (42, 99, 0, 42.0),  # unknown scale counts as units
        (None, 9, 0, None),
    ],
)
def test_entity_sensor_value_applies_scale_and_precision(
    raw: int | None, scale: int | None, precision: int | None, expected: float | None
) -> None:
    assert entity_sensor_value(raw, scale, precision) == pytest.approx(expected)


def _entity(rows: dict[int, dict[str, int | str | None]], names: dict[int, str]) -> Walked:
    return Walked(
        tables={
            "sensor": {(i,): row for i, row in rows.items()},
            "physical": {(i,): {"name": n} for i, n in names.items()},
        }
    )


def test_entity_sensor_kinds_units_status_and_names() -> None:
    walked = _entity(
        {
            11: {"type": 10, "scale": 9, "precision": 0, "value": 5400, "oper_status": 1},
            13: {"type": 10, "scale": 9, "precision": 0, "value": 0, "oper_status": 3},
            21: {"type": 8, "scale": 9, "precision": 1, "value": 452, "oper_status": 1},
            31: {"type": 4, "scale": 8, "precision": 0, "value": 12150, "oper_status": 1},
            32: {"type": 5, "scale": 8, "precision": 0, "value": 1500, "oper_status": 2},
            33: {"type": 12, "scale": 9, "precision": 0, "value": 1, "oper_status": 1},
            40: {"type": 7, "scale": 9, "precision": 0, "value": 50},
        },
        {1: "Chassis", 11: "Fan 1", 13: "Fan 3", 21: "CPU1 Temp", 31: "P12V", 33: "PSU2 OK"},
    )
    converted = ENTITY_SENSOR.convert(walked)
    by_name = {s.name: s for s in converted.sensors}
    assert by_name["Fan 1"] == BmcSensor(
        name="Fan 1", kind="fan", value=5400.0, unit="rpm", status="ok"
    )
    assert by_name["Fan 3"].status == "critical"
    assert by_name["CPU1 Temp"].kind == "temperature"
    assert by_name["CPU1 Temp"].value == pytest.approx(45.2)
    assert (by_name["P12V"].kind, by_name["P12V"].unit) == ("voltage", "V")
    assert by_name["sensor 32"].kind == "current"  # no entPhysicalName: a made-up name
    assert by_name["sensor 32"].status == "absent"
    assert by_name["PSU2 OK"].kind == "psu"
    assert by_name["sensor 40"].kind == "other"
    assert by_name["sensor 40"].status == "unknown"
    assert "Chassis" not in by_name  # a physical entity without a sensor row
    assert converted.health == "critical"
    assert converted.power_state == ""


def test_entity_sensor_healthy_when_no_sensor_failed() -> None:
    walked = _entity({11: {"type": 10, "value": 1, "oper_status": 1}}, {11: "Fan"})
    assert ENTITY_SENSOR.convert(walked).health == "ok"


def test_idrac_scales_readings_and_thresholds() -> None:
    walked = Walked(
        scalars={"global_status": 5, "power_state": 4},
        tables={
            "fan": {(1, 1): {"status": 4, "reading": 720, "name": "Fan2", "lower_critical": 600}},
            "temperature": {
                (1, 1): {
                    "status": 3,
                    "reading": 245,
                    "name": "Inlet",
                    "upper_critical": 470,
                    "lower_critical": -70,
                }
            },
            "voltage": {(1, 1): {"status": 3, "reading": 12096, "name": "12V"}},
            "psu": {(1, 2): {"status": 6, "name": "PS2 Status"}},
        },
    )
    converted = IDRAC_PROFILE.convert(walked)
    fan, temp, volt, psu = converted.sensors
    assert (fan.kind, fan.value, fan.unit, fan.status, fan.lower_critical) == (
        "fan",
        720.0,
        "rpm",
        "warning",
        600.0,
    )
    assert (temp.value, temp.upper_critical, temp.lower_critical) == (24.5, 47.0, -7.0)
    assert volt.value == pytest.approx(12.096)
    assert (psu.kind, psu.value, psu.status) == ("psu", None, "critical")
    assert (converted.health, converted.power_state) == ("critical", "on")


def test_idrac_without_scalars_takes_health_from_sensors() -> None:
    walked = Walked(tables={"fan": {(1, 1): {"status": 3, "reading": 5000}}})
    converted = IDRAC_PROFILE.convert(walked)
    assert converted.health == "ok"
    assert converted.power_state == ""
    assert converted.sensors[0].name == "fan 1.1"


def test_idrac_power_state_off() -> None:
    assert IDRAC_PROFILE.convert(Walked(scalars={"power_state": 3})).power_state == "off"


def test_join_columns_joins_on_index() -> None:
    table = join_columns({"a": {(2,): 1, (1,): 2}, "b": {(1,): "x"}})
    assert table == {(1,): {"a": 2, "b": "x"}, (2,): {"a": 1}}
    assert list(table) == [(1,), (2,)]


def test_parse_oid() -> None:
    assert parse_oid(".1.3.6.1") == (1, 3, 6, 1)
    with pytest.raises(ValueError, match="not a numeric OID"):
        parse_oid("1.3.x")


def test_worst_status() -> None:
    ok = BmcSensor(name="a", kind="fan", status="ok")
    warn = BmcSensor(name="b", kind="fan", status="warning")
    assert worst_status(()) == "ok"
    assert worst_status((ok, warn)) == "warning"


def test_profiles_by_name() -> None:
    assert set(PROFILES) == {"entity-sensor", "idrac"}
    assert profile_named("") is ENTITY_SENSOR
    with pytest.raises(KeyError, match="unknown SNMP profile"):
        profile_named("nope")
