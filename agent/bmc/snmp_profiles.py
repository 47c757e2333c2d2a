"""SNMP OID maps ("profiles") and the pure functions that turn walked rows into sensors.

A profile names the scalars to GET and the tables to walk; each table is a set of columns
whose rows are joined on the OID suffix after the column (the row index).  The walk
itself is :mod:`agent.bmc.snmp`; everything here is pure and tested without a network.

Values arrive already converted from SNMP types: ``int`` for INTEGER/Gauge/Counter,
``str`` for OCTET STRING, ``None`` when the agent has no such object.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Final

from metalguard.proto.telemetry import BmcSensor

Oid = tuple[int, ...]
Value = int | str | None
Row = dict[str, Value]
"""One table row: column name -> value."""
Table = dict[Oid, Row]
"""Rows by index (the OID suffix after the column)."""


@dataclass(frozen=True, slots=True)
class Walked:
    """What a profile's requests returned: scalar values and tables by name."""

    scalars: Mapping[str, Value] = field(default_factory=dict)
    tables: Mapping[str, Table] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Converted:
    """A profile's reading of one BMC."""

    sensors: tuple[BmcSensor, ...]
    health: str = ""
    power_state: str = ""


@dataclass(frozen=True, slots=True)
class Profile:
    """An OID map: scalars to GET, tables (columns) to walk, and the conversion."""

    name: str
    scalars: Mapping[str, Oid]
    tables: Mapping[str, Mapping[str, Oid]]
    convert: Callable[[Walked], Converted]


def parse_oid(text: str) -> Oid:
    """``"1.3.6.1"`` or ``".1.3.6.1"`` as a tuple of ints; ValueError when not numeric."""
    parts = text.strip().lstrip(".").split(".")
    if not parts or not all(p.isdigit() for p in parts):
        raise ValueError(f"not a numeric OID: {text!r}")
    return tuple(int(p) for p in parts)


def join_columns(columns: Mapping[str, Mapping[Oid, Value]]) -> Table:
    """Rows joined on their index: ``{index: {column: value}}`` (missing cells absent)."""
    table: Table = {}
    for column, cells in columns.items():
        for index, value in cells.items():
            table.setdefault(index, {})[column] = value
    return dict(sorted(table.items()))


def worst_status(sensors: tuple[BmcSensor, ...]) -> str:
    """``critical`` if any sensor is, else ``warning`` if any is, else ``ok``."""
    statuses = {s.status for s in sensors}
    for level in ("critical", "warning"):
        if level in statuses:
            return level
    return "ok"


def _int(value: Value) -> int | None:
    return value if isinstance(value, int) else None


def _text(value: Value) -> str:
    return value.strip() if isinstance(value, str) else ""


# --- ENTITY-SENSOR-MIB (RFC 3433) ---------------------------------------------------------

ENT_PHY_SENSOR_ENTRY: Final[Oid] = (1, 3, 6, 1, 2, 1, 99, 1, 1, 1)
ENT_PHYSICAL_NAME: Final[Oid] = (1, 3, 6, 1, 2, 1, 47, 1, 1, 1, 1, 7)

SCALE_EXPONENT: Final[dict[int, int]] = {
    1: -24,  # yocto
    2: -21,  # zepto
    3: -18,  # atto
    4: -15,  # femto
    5: -12,  # pico
    6: -9,  # nano
    7: -6,  # micro
    8: -3,  # milli
    9: 0,  # units
    10: 3,  # kilo
    11: 6,  # mega
    12: 9,  # giga
    13: 12,  # tera
    14: 18,  # exa (RFC 3433 lists exa before peta)
    15: 15,  # peta
    16: 21,  # zetta
    17: 24,  # yotta
}
"""entPhySensorScale (SiScaleUnits) -> power of ten."""

ENTITY_TYPE_KIND: Final[dict[int, tuple[str, str]]] = {
    3: ("voltage", "V"),  # voltsAC
    4: ("voltage", "V"),  # voltsDC
    5: ("current", "A"),  # amperes
    6: ("power", "W"),  # watts
    8: ("temperature", "C"),  # celsius
    10: ("fan", "rpm"),  # rpm
}
"""entPhySensorType -> (kind, unit); other types are kind ``other`` without a unit."""

ENTITY_OPER_STATUS: Final[dict[int, str]] = {1: "ok", 2: "absent", 3: "critical"}
"""entPhySensorOperStatus: ok(1), unavailable(2), nonoperational(3)."""

TRUTHVALUE = 12
_PSU_WORDS = ("psu", "power supply", "powersupply", "pws")


def entity_sensor_value(raw: int | None, scale: int | None, precision: int | None) -> float | None:
    """entPhySensorValue in base units: ``raw * 10^scale * 10^-precision``.

    A precision of 1..9 is the number of decimal places in ``raw``; 0 and the negative
    values (accuracy only) leave it as is.  An unknown scale counts as units.
    """
    if raw is None:
        return None
    exponent = SCALE_EXPONENT.get(scale if scale is not None else 9, 0)
    if precision is not None and 0 < precision <= 9:
        exponent -= precision
    return float(raw * 10**exponent) if exponent >= 0 else raw / 10 ** (-exponent)


def entity_sensor(index: Oid, row: Row, name: str) -> BmcSensor:
    """One entPhySensorEntry row (with its entPhysicalName) as a sensor."""
    sensor_type = _int(row.get("type"))
    kind, unit = ENTITY_TYPE_KIND.get(sensor_type or 0, ("other", ""))
    label = name or f"sensor {'.'.join(map(str, index))}"
    if sensor_type == TRUTHVALUE and any(w in label.lower() for w in _PSU_WORDS):
        kind = "psu"
    oper = _int(row.get("oper_status"))
    status = ENTITY_OPER_STATUS.get(oper, "unknown") if oper is not None else "unknown"
    return BmcSensor(
        name=label,
        kind=kind,
        value=entity_sensor_value(
            _int(row.get("value")), _int(row.get("scale")), _int(row.get("precision"))
        ),
        unit=unit,
        status=status,
    )


def convert_entity_sensor(walked: Walked) -> Converted:
    """entPhySensorTable joined with entPhysicalName; health is the worst sensor status."""
    names = walked.tables.get("physical", {})
    sensors = tuple(
        entity_sensor(index, row, _text(names.get(index, {}).get("name")))
        for index, row in walked.tables.get("sensor", {}).items()
        if "type" in row or "value" in row
    )
    return Converted(sensors=sensors, health=worst_status(sensors))


ENTITY_SENSOR: Final = Profile(
    name="entity-sensor",
    scalars={},
    tables={
        "sensor": {
            "type": (*ENT_PHY_SENSOR_ENTRY, 1),
            "scale": (*ENT_PHY_SENSOR_ENTRY, 2),
            "precision": (*ENT_PHY_SENSOR_ENTRY, 3),
            "value": (*ENT_PHY_SENSOR_ENTRY, 4),
            "oper_status": (*ENT_PHY_SENSOR_ENTRY, 5),
        },
        "physical": {"name": ENT_PHYSICAL_NAME},
    },
    convert=convert_entity_sensor,
)


# --- Dell iDRAC (IDRAC-MIB-SMIv2) ----------------------------------------------------------

IDRAC: Final[Oid] = (1, 3, 6, 1, 4, 1, 674, 10892, 5)
IDRAC_GLOBAL_SYSTEM_STATUS: Final[Oid] = (*IDRAC, 2, 1, 0)
IDRAC_SYSTEM_POWER_STATE: Final[Oid] = (*IDRAC, 2, 4, 0)

IDRAC_STATUS: Final[dict[int, str]] = {
    1: "unknown",  # other
    2: "unknown",
    3: "ok",
    4: "warning",  # nonCritical
    5: "critical",
    6: "critical",  # nonRecoverable
}
"""ObjectStatusEnum -> normalised status."""

IDRAC_POWER: Final[dict[int, str]] = {3: "off", 4: "on"}
"""systemPowerState (PowerStateStatusEnum): other(1), unknown(2), off(3), on(4)."""

IDRAC_TABLES: Final[dict[str, tuple[Oid, str, str, float]]] = {
    "fan": ((*IDRAC, 4, 700, 12, 1), "fan", "rpm", 1.0),  # coolingDeviceTable
    "temperature": ((*IDRAC, 4, 700, 20, 1), "temperature", "C", 10.0),  # tenths of C
    "voltage": ((*IDRAC, 4, 600, 20, 1), "voltage", "V", 1000.0),  # millivolts
    "psu": ((*IDRAC, 4, 600, 12, 1), "psu", "", 1.0),  # powerSupplyTable
}
"""Table -> (entry OID, kind, unit, divisor of the raw reading and thresholds)."""

_IDRAC_COLUMNS: Final[dict[str, int]] = {
    "status": 5,
    "reading": 6,
    "name": 8,
    "upper_critical": 10,
    "lower_critical": 13,
}
_IDRAC_PSU_COLUMNS: Final[dict[str, int]] = {"status": 5, "name": 8}


def _scaled(value: Value, divisor: float) -> float | None:
    raw = _int(value)
    return None if raw is None else raw / divisor


def idrac_sensor(table: str, index: Oid, row: Row) -> BmcSensor:
    """One row of an iDRAC probe table as a sensor (readings scaled to base units)."""
    _, kind, unit, divisor = IDRAC_TABLES[table]
    status = _int(row.get("status"))
    return BmcSensor(
        name=_text(row.get("name")) or f"{table} {'.'.join(map(str, index))}",
        kind=kind,
        value=None if table == "psu" else _scaled(row.get("reading"), divisor),
        unit=unit,
        status=IDRAC_STATUS.get(status, "unknown") if status is not None else "unknown",
        lower_critical=_scaled(row.get("lower_critical"), divisor),
        upper_critical=_scaled(row.get("upper_critical"), divisor),
    )


def convert_idrac(walked: Walked) -> Converted:
    """The probe tables, globalSystemStatus as health, systemPowerState as power state."""
    sensors = tuple(
        idrac_sensor(table, index, row)
        for table in IDRAC_TABLES
        for index, row in walked.tables.get(table, {}).items()
    )
    status = _int(walked.scalars.get("global_status"))
    health = IDRAC_STATUS.get(status, "unknown") if status is not None else worst_status(sensors)
    power = _int(walked.scalars.get("power_state"))
    return Converted(
        sensors=sensors,
        health=health,
        power_state=IDRAC_POWER.get(power, "unknown") if power is not None else "",
    )


IDRAC_PROFILE: Final = Profile(
    name="idrac",
    scalars={"global_status": IDRAC_GLOBAL_SYSTEM_STATUS, "power_state": IDRAC_SYSTEM_POWER_STATE},
    tables={
        table: {
            column: (*entry, number)
            for column, number in (_IDRAC_PSU_COLUMNS if table == "psu" else _IDRAC_COLUMNS).items()
        }
        for table, (entry, _, _, _) in IDRAC_TABLES.items()
    },
    convert=convert_idrac,
)

PROFILES: Final[dict[str, Profile]] = {p.name: p for p in (ENTITY_SENSOR, IDRAC_PROFILE)}
DEFAULT_PROFILE: Final = ENTITY_SENSOR.name


def profile_named(name: str) -> Profile:
    """The profile called ``name`` (empty: the default); KeyError naming the known ones."""
    try:
        return PROFILES[name or DEFAULT_PROFILE]
    except KeyError:
        raise KeyError(f"unknown SNMP profile {name!r} (known: {', '.join(PROFILES)})") from None
