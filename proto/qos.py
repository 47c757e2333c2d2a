"""QosProfile: the declared RDMA flow-control settings of a cluster or node.

The same Struct is the TOML file form (docs/qos.md), so unknown keys are rejected here,
unlike the telemetry messages, which ignore fields they do not know.
"""

from __future__ import annotations

import re
import tomllib
import types
import typing
from typing import Annotated, Any, Literal

import msgspec

from metalguard.proto.base import (
    SCHEMA_VERSION,
    TAG_FIELD,
    Message,
    NonNegInt,
    Percent,
    Priority,
    Record,
)
from metalguard.proto.documents import describe_validation_error

Dscp = Annotated[int, msgspec.Meta(ge=0, le=63)]
Probability = Annotated[float, msgspec.Meta(ge=0, le=1)]


class InterfaceMatch(Record, frozen=True, forbid_unknown_fields=True):
    """Which interfaces a profile applies to: names, or a match by driver / PCI class."""

    names: tuple[str, ...] = ()
    driver: str | None = None
    pci_class: str | None = None


class EcnMarking(Record, frozen=True, forbid_unknown_fields=True):
    """ECN/RED marking thresholds of one traffic class."""

    min_kb: Annotated[int, msgspec.Meta(ge=1)]
    max_kb: Annotated[int, msgspec.Meta(ge=1)]
    probability: Probability = 1.0


class TrafficClass(Record, frozen=True, forbid_unknown_fields=True):
    """One priority queue: which priorities it serves and its bandwidth share."""

    name: str
    priorities: tuple[Priority, ...]
    bandwidth_percent: Percent
    strict: bool = False
    ecn: EcnMarking | None = None


class Dcqcn(Record, frozen=True, forbid_unknown_fields=True):
    """DCQCN congestion-control parameters (notification and reaction points)."""

    np: dict[str, NonNegInt] = {}
    rp: dict[str, NonNegInt] = {}


class QosProfile(Message, frozen=True, forbid_unknown_fields=True, tag="qos_profile"):
    """A cluster's (or one node's override) declared flow-control profile."""

    version: NonNegInt
    interfaces: InterfaceMatch = InterfaceMatch()
    trust: Literal["dscp", "pcp"] = "dscp"
    pfc_priorities: tuple[Priority, ...] = ()
    dscp_map: dict[Dscp, Priority] = {}
    link_rate_mbit: Annotated[int, msgspec.Meta(ge=1)] | None = None
    traffic_class: tuple[TrafficClass, ...] = ()
    dcqcn: Dcqcn | None = None


class ProfileError(ValueError):
    """A QosProfile is invalid; ``reasons`` lists every problem, each naming its key."""

    def __init__(self, reasons: list[str]) -> None:
        super().__init__("; ".join(reasons) if reasons else "invalid QoS profile")
        self.reasons = list(reasons)


_IFNAME_RE = re.compile(r"^[^/\s:]{1,15}\Z")
_KNOB_RE = re.compile(r"^[a-z0-9_]{1,64}\Z")
DEFAULT_PRIORITY = 0
"""The priority of traffic whose DSCP the profile does not map."""


def _in(value: object, lo: float, hi: float) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and lo <= value <= hi


def profile_problems(profile: QosProfile) -> list[str]:
    """Every semantic problem of a (type-valid) profile, each naming the key; [] if fine.

    Also re-checks ranges, since a Struct built in code is not validated by msgspec.
    """
    out: list[str] = []
    if not _in(profile.version, 0, float("inf")):
        out.append(f"version: must be >= 0 (got {profile.version})")
    for i, name in enumerate(profile.interfaces.names):
        if not _IFNAME_RE.match(name):
            out.append(f"interfaces.names[{i}]: {name!r} is not an interface name")
    if profile.link_rate_mbit is not None and not _in(profile.link_rate_mbit, 1, float("inf")):
        out.append(f"link_rate_mbit: must be >= 1 (got {profile.link_rate_mbit})")
    seen_pfc: set[int] = set()
    for i, prio in enumerate(profile.pfc_priorities):
        if not _in(prio, 0, 7):
            out.append(f"pfc_priorities[{i}]: priority {prio} is outside 0-7")
        elif prio in seen_pfc:
            out.append(f"pfc_priorities[{i}]: priority {prio} is listed twice")
        seen_pfc.add(prio)
    for dscp, prio in sorted(profile.dscp_map.items()):
        if not _in(dscp, 0, 63):
            out.append(f"dscp_map[{dscp}]: DSCP {dscp} is outside 0-63")
        if not _in(prio, 0, 7):
            out.append(f"dscp_map[{dscp}]: priority {prio} is outside 0-7")
    out.extend(_class_problems(profile))
    if profile.dcqcn is not None:
        for side in ("np", "rp"):
            for knob, value in getattr(profile.dcqcn, side).items():
                if not _KNOB_RE.match(knob):
                    out.append(f"dcqcn.{side}.{knob}: not a parameter name ([a-z0-9_])")
                if not _in(value, 0, float("inf")) or not isinstance(value, int):
                    out.append(f"dcqcn.{side}.{knob}: must be an integer >= 0 (got {value!r})")
    return out


def _class_problems(profile: QosProfile) -> list[str]:
    out: list[str] = []
    classes = profile.traffic_class
    if not classes:
        return out
    owner: dict[int, str] = {}
    names: set[str] = set()
    total = 0.0
    for i, tc in enumerate(classes):
        key = f"traffic_class[{i}]"
        if not tc.name.strip():
            out.append(f"{key}.name: must not be empty")
        elif tc.name in names:
            out.append(f"{key}.name: class name {tc.name!r} is used twice")
        names.add(tc.name)
        if not tc.priorities:
            out.append(f"{key}.priorities: must list at least one priority")
        for prio in tc.priorities:
            if not _in(prio, 0, 7):
                out.append(f"{key}.priorities: priority {prio} is outside 0-7")
            elif prio in owner:
                out.append(f"{key}.priorities: priority {prio} is already in class {owner[prio]!r}")
            else:
                owner[prio] = tc.name
        if not _in(tc.bandwidth_percent, 0, 100):
            out.append(f"{key}.bandwidth_percent: {tc.bandwidth_percent} is outside 0-100")
        total += tc.bandwidth_percent
        if tc.ecn is not None:
            ecn = tc.ecn
            if not _in(ecn.min_kb, 1, float("inf")) or not _in(ecn.max_kb, 1, float("inf")):
                out.append(f"{key}.ecn: min_kb and max_kb must be >= 1")
            elif ecn.min_kb >= ecn.max_kb:
                out.append(f"{key}.ecn: min_kb ({ecn.min_kb}) must be < max_kb ({ecn.max_kb})")
            if not _in(ecn.probability, 0, 1):
                out.append(f"{key}.ecn.probability: {ecn.probability} is outside 0-1")
    if abs(total - 100.0) > 1e-6:
        out.append(f"traffic_class: bandwidth_percent shares sum to {total:g}, must be 100")
    if DEFAULT_PRIORITY not in owner:
        out.append(f"traffic_class: priority {DEFAULT_PRIORITY} (unmapped DSCP) is in no class")
    for dscp, prio in sorted(profile.dscp_map.items()):
        if _in(prio, 0, 7) and prio not in owner:
            out.append(f"dscp_map[{dscp}]: priority {prio} is in no traffic_class")
    return out


def decode_profile(data: bytes | str, fmt: Literal["toml", "json"]) -> QosProfile:
    """Decode a TOML or JSON profile and check it; ProfileError lists every problem."""
    if isinstance(data, bytes):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ProfileError([f"not UTF-8 text: {exc}"]) from None
    else:
        text = data
    raw: object
    if fmt == "toml":
        try:
            raw = tomllib.loads(text)
        except (tomllib.TOMLDecodeError, ValueError) as exc:  # ValueError: a too-long number
            raise ProfileError([f"not valid TOML: {exc}"]) from None
        except RecursionError:
            raise ProfileError(["not valid TOML: nested too deeply"]) from None
    elif fmt == "json":
        try:
            raw = msgspec.json.decode(text)
        except msgspec.DecodeError as exc:
            raise ProfileError([f"not valid JSON: {exc}"]) from None
        except RecursionError:
            raise ProfileError(["not valid JSON: nested too deeply"]) from None
    else:
        raise ProfileError([f"unknown profile format {fmt!r}"])
    return profile_from_builtins(raw)


def profile_from_builtins(raw: object) -> QosProfile:
    """Validate plain data (a decoded TOML/JSON document) into a checked QosProfile."""
    if not isinstance(raw, dict):
        raise ProfileError([f"a profile must be a table/object, not {type(raw).__name__}"])
    raw = _int_keys(raw)
    try:
        profile = msgspec.convert(raw, QosProfile)
    except msgspec.ValidationError:
        raise ProfileError(_type_problems(raw)) from None
    problems = profile_problems(profile)
    if profile.v > SCHEMA_VERSION:
        problems.insert(
            0, f"v: schema version {profile.v} is newer than the supported {SCHEMA_VERSION}"
        )
    if problems:
        raise ProfileError(problems)
    return profile


def _int_keys(raw: dict[str, Any]) -> dict[str, Any]:
    """TOML/JSON keys are strings: turn the dscp_map keys that are integers into ints."""
    dmap = raw.get("dscp_map")
    if not isinstance(dmap, dict):
        return raw
    fixed = {(int(k) if _decimal_key(k) else k): v for k, v in dmap.items()}
    return {**raw, "dscp_map": fixed}


def _decimal_key(key: object) -> bool:
    """A key that is a short decimal number in ASCII digits (``int()`` refuses others:
    ``"²"`` is a digit to ``str.isdigit``, and 5,000 digits exceed Python's limit)."""
    if not isinstance(key, str):
        return False
    digits = key.strip()
    return 0 < len(digits) <= 18 and digits.isascii() and digits.isdigit()


def _type_problems(raw: dict[str, Any]) -> list[str]:
    """Every type / range / unknown-key error, found field by field (msgspec stops at one)."""
    out = _struct_problems(raw, QosProfile, "")
    if TAG_FIELD in raw and raw[TAG_FIELD] != "qos_profile":
        out.insert(0, f"{TAG_FIELD}: must be 'qos_profile' (got {raw[TAG_FIELD]!r})")
    return out or ["invalid profile"]


def _struct_problems(raw: dict[str, Any], struct: Any, prefix: str) -> list[str]:
    fields = {f.encode_name: f for f in msgspec.structs.fields(struct)}
    tagged = struct is QosProfile
    out = [
        f"{prefix}{key}: unknown key"
        for key in raw
        if key not in fields and not (tagged and key == TAG_FIELD)
    ]
    for name, field in fields.items():
        if name in raw:
            out.extend(_value_problems(raw[name], field.type, f"{prefix}{name}"))
        elif field.required:
            out.append(f"{prefix}{name}: missing (required)")
    return out


def _value_problems(value: Any, type_: Any, key: str) -> list[str]:
    origin, args = typing.get_origin(type_), typing.get_args(type_)
    if origin in (typing.Union, types.UnionType) and value is not None:
        structs = [a for a in args if isinstance(a, type) and issubclass(a, msgspec.Struct)]
        if structs and isinstance(value, dict):
            return _struct_problems(value, structs[0], f"{key}.")
    if isinstance(type_, type) and issubclass(type_, msgspec.Struct) and isinstance(value, dict):
        return _struct_problems(value, type_, f"{key}.")
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis and isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _value_problems(v, args[0], f"{key}[{i}]")]
    if origin is dict and isinstance(value, dict):
        out: list[str] = []
        for k, v in value.items():
            kp = _check(k, args[0], f"{key}[{k}]")
            out.extend(p.replace(": ", ": key: ", 1) for p in kp)
            out.extend(_value_problems(v, args[1], f"{key}[{k}]"))
        return out
    return _check(value, type_, key)


def _check(value: object, type_: Any, key: str) -> list[str]:
    try:
        msgspec.convert(value, type_)
    except msgspec.ValidationError as exc:
        message = str(exc)
        if " - at `$" in message:
            message = message.replace(" - at `$", f" - at `$.{key}", 1)
        else:
            message = f"{message} - at `$.{key}`"
        return [describe_validation_error(message)]
    return []
