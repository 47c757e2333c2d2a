"""The node's identity: names from config (defaults from the host), UUID from DMI."""

from __future__ import annotations

import re
import socket
from pathlib import Path

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")
_MAX_ID_BYTES = 256


def token_from_hostname(hostname: str) -> str:
    """The short host name made safe as a subject token (``gpu-17.dc1`` -> ``gpu-17``)."""
    short = hostname.split(".", 1)[0]
    return _UNSAFE.sub("-", short).strip("-") or "node"


def default_node_name() -> str:
    """This host's short name as a subject token."""
    return token_from_hostname(socket.gethostname())


def parse_uuid(text: str | None) -> str:
    """Normalise a product_uuid / machine-id value; empty when unusable."""
    if not text:
        return ""
    value = text.strip().lower()
    if not value or set(value) <= {"0", "-", "f"}:
        return ""  # unset DMI fields read as all zeros or all f's
    return value


def read_node_uuid(sysfs: Path, machine_id: Path = Path("/etc/machine-id")) -> str:
    """DMI product_uuid, else machine-id, else empty (never raises)."""
    for path in (sysfs / "class/dmi/id/product_uuid", machine_id):
        try:
            with path.open("rb") as f:
                value = parse_uuid(f.read(_MAX_ID_BYTES).decode(errors="replace"))
        except OSError:
            continue
        if value:
            return value
    return ""
