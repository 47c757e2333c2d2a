"""Validating what callers and the config give the provisioning service (pure).

:func:`parse_request` turns plain data (a POST body) into an :class:`InstanceRequest`,
:func:`parse_switch` a switch body into a :class:`SwitchRequest`; both collect every
problem at once (unknown keys, types, patterns, then the semantic checks) and raise
:class:`SpecError` with all of them.  :func:`request_problems` is the semantic part alone
(the service runs it on every request it gets, decoded or not).  MAC addresses:
:func:`normalize_mac`, :func:`mac_path` (the boot server's ``52-54-00-12-34-01`` form),
:func:`node_problems` (the ``[[provision.nodes]]`` table).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, Final

import msgspec

from metalguard.proto.documents import describe_validation_error
from metalguard.proto.provision import ImageName, InstanceRequest, TenantName

MAX_USER_DATA: Final = 64 * 1024
"""Bytes of user data an instance may carry (it is served to the node as text)."""
MAC_RE: Final = re.compile(r"^[0-9a-f]{2}([:-][0-9a-f]{2}){5}\Z")
HANDLE_PART_RE: Final = re.compile(r"^[^.*>\s]{1,128}\Z")
INSTANCE_ID_RE: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}\Z")
VOLUME_RE: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}\Z")
SET_BY_SERVICE: Final = ("v", "type")


class SpecError(ValueError):
    """A request is invalid; ``reasons`` lists every problem found."""

    def __init__(self, reasons: list[str]) -> None:
        super().__init__("; ".join(reasons))
        self.reasons = reasons


class SwitchRequest(msgspec.Struct, frozen=True, kw_only=True):
    """POST /v1/instances/{id}/switch: the tenant and image the node boots next."""

    tenant: TenantName
    image: ImageName
    volume: str = ""
    """An existing volume of ``tenant`` to boot, or "" for a new one from ``image``."""
    user_data: str = ""


def _decode_each(
    data: dict[str, Any], kind: type[msgspec.Struct], required: dict[str, Any]
) -> list[str]:
    """Decode ``data`` key by key (so one bad value does not hide another); the bad
    keys are removed from ``data``, their reasons returned."""
    reasons: list[str] = []
    fields = set(kind.__struct_fields__) - set(SET_BY_SERVICE)
    for key in sorted(set(data) - fields):
        reasons.append(f"{key}: unknown key")
        del data[key]
    for key, value in list(data.items()):
        try:
            msgspec.convert({**required, key: value}, kind)
        except msgspec.ValidationError as exc:
            reasons.append(describe_validation_error(str(exc)))
            del data[key]
    for key in required:
        if key not in data and not any(r.startswith(f"{key}:") for r in reasons):
            reasons.append(f"{key}: missing (required)")
    return reasons


def parse_request(raw: Any) -> InstanceRequest:
    """Validate an instance request (plain data) into an InstanceRequest; SpecError with
    every reason found."""
    if not isinstance(raw, dict):
        raise SpecError(["the request must be an object (a table of keys)"])
    data = {k: v for k, v in raw.items() if k not in SET_BY_SERVICE}
    reasons = _decode_each(data, InstanceRequest, {"tenant": "probe", "image": "probe"})
    if reasons:
        raise SpecError(reasons)
    req = msgspec.convert(data, InstanceRequest)
    problems = request_problems(req)
    if problems:
        raise SpecError(problems)
    return req


def parse_switch(raw: Any) -> SwitchRequest:
    """Validate a switch body into a SwitchRequest; SpecError with every reason found."""
    if not isinstance(raw, dict):
        raise SpecError(["the request must be an object (a table of keys)"])
    data = dict(raw)
    reasons = _decode_each(data, SwitchRequest, {"tenant": "probe", "image": "probe"})
    if reasons:
        raise SpecError(reasons)
    req = msgspec.convert(data, SwitchRequest)
    problems = volume_problems(req.volume) + user_data_problems(req.user_data)
    if problems:
        raise SpecError(problems)
    return req


def handle_problems(handle: str, key: str = "node") -> list[str]:
    """Why ``handle`` is not a node handle ``region.cluster.node`` (empty: it is)."""
    parts = handle.split(".")
    if len(parts) != 3 or not all(HANDLE_PART_RE.match(p) for p in parts):
        return [f"{key}: {handle!r} is not a node handle (region.cluster.node)"]
    return []


def volume_problems(volume: str) -> list[str]:
    """Why ``volume`` ("" = a new one) is not a volume name."""
    if volume and not VOLUME_RE.match(volume):
        return [
            "volume: letters, digits, '.', '-' and '_' only (1 to 128, starting with a "
            "letter or digit)"
        ]
    return []


def user_data_problems(user_data: str) -> list[str]:
    """Why ``user_data`` cannot be served to a node."""
    if len(user_data.encode()) > MAX_USER_DATA:
        return [f"user_data: at most {MAX_USER_DATA} bytes"]
    if "\x00" in user_data:
        return ["user_data: must not contain NUL characters"]
    return []


def request_problems(req: InstanceRequest) -> list[str]:
    """What is semantically wrong with a decoded request (empty: it may be served)."""
    reasons: list[str] = []
    if req.node:
        reasons += handle_problems(req.node)
    if req.instance_id and not INSTANCE_ID_RE.match(req.instance_id):
        reasons.append(
            "instance_id: letters, digits, '-' and '_' only (1 to 64, starting with a "
            "letter or digit)"
        )
    reasons += volume_problems(req.volume)
    reasons += user_data_problems(req.user_data)
    return reasons


def normalize_mac(mac: str) -> str:
    """A MAC address as lower-case hex with colons (``52:54:00:12:34:01``); ValueError
    when it is not one (colons or hyphens accepted)."""
    text = mac.strip().lower()
    if not MAC_RE.match(text):
        raise ValueError(f"{mac!r} is not a MAC address (six hex pairs)")
    return text.replace("-", ":")


def mac_path(mac: str) -> str:
    """The MAC as iPXE's ``${net0/mac:hexhyp}`` writes it: ``52-54-00-12-34-01``."""
    return normalize_mac(mac).replace(":", "-")


def node_problems(nodes: Iterable[tuple[str, str]]) -> list[str]:
    """What is wrong with a ``[[provision.nodes]]`` table of (node handle, MAC): bad
    handles or MACs, a node or MAC listed twice."""
    reasons: list[str] = []
    seen_nodes: set[str] = set()
    seen_macs: dict[str, str] = {}
    for i, (node, mac) in enumerate(nodes):
        reasons += handle_problems(node, f"nodes[{i}].node")
        if node in seen_nodes:
            reasons.append(f"nodes[{i}].node: {node} is listed twice")
        seen_nodes.add(node)
        try:
            norm = normalize_mac(mac)
        except ValueError as exc:
            reasons.append(f"nodes[{i}].mac: {exc}")
            continue
        if norm in seen_macs:
            reasons.append(f"nodes[{i}].mac: {norm} is also {seen_macs[norm]}'s")
        seen_macs.setdefault(norm, node)
    return reasons
