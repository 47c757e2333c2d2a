"""One /dev/kmsg record, parsed (pure; Linux Documentation/ABI/testing/dev-kmsg).

A ``read()`` of /dev/kmsg returns one record::

    PRIORITY,SEQ,TIMESTAMP_US,FLAGS[,...];TEXT
     KEY=VALUE
     KEY=VALUE

PRIORITY is ``facility * 8 + level``; the kernel logs with facility 0, user space (a write
to /dev/kmsg) never can. Continuation lines (a leading space) carry the device the record
names (``DEVICE=+pci:0000:31:00.0``, ``b8:0`` a block device, ``n2`` a network interface by
index, ``c1:3`` a character device) and its ``SUBSYSTEM``. Non-printable bytes in TEXT are
written ``\\xHH``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Final

KERNEL_FACILITY: Final = 0
LEVELS: Final = ("emerg", "alert", "crit", "err", "warning", "notice", "info", "debug")
_ESCAPE = re.compile(r"\\x([0-9a-fA-F]{2})")


class KmsgFormatError(ValueError):
    """A record that is not in /dev/kmsg's format; the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class KmsgRecord:
    """One record of the kernel's log buffer."""

    facility: int
    level: int
    seq: int
    ts_us: int
    """Microseconds since boot (CLOCK_MONOTONIC)."""
    text: str
    flags: str = "-"
    """``-`` a complete record, ``c`` the start of a continued one, ``+`` a continuation."""
    fields: dict[str, str] = field(default_factory=dict)
    """The continuation lines' ``KEY=VALUE`` (``SUBSYSTEM``, ``DEVICE``)."""

    @property
    def from_kernel(self) -> bool:
        """Logged by the kernel (facility 0), not written from user space."""
        return self.facility == KERNEL_FACILITY

    @property
    def device(self) -> str:
        """The device the record's ``DEVICE`` field names, as a person writes it: a PCI
        address (``0000:31:00.0``), ``block 8:0``, ``netdev 2``, ``char 1:3``, else the raw
        value ("" without one)."""
        return device_name(self.fields.get("DEVICE", ""))


def device_name(value: str) -> str:
    """``DEVICE=`` as a person writes it (see :attr:`KmsgRecord.device`)."""
    if not value:
        return ""
    if value.startswith("+"):
        _, _, name = value[1:].partition(":")
        return name or value[1:]
    kinds = {"b": "block", "c": "char", "n": "netdev"}
    kind = kinds.get(value[0])
    return f"{kind} {value[1:]}" if kind and value[1:] else value


def unescape(text: str) -> str:
    """TEXT with the kernel's ``\\xHH`` escapes decoded."""
    if "\\x" not in text:
        return text
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 16)), text)


def parse_record(raw: str | bytes) -> KmsgRecord:
    """The record of one ``read()`` (or one record of a file in the same format);
    KmsgFormatError naming what is wrong."""
    if isinstance(raw, bytes):
        raw = raw.decode("utf-8", errors="replace")
    head, sep, rest = raw.partition(";")
    if not sep:
        raise KmsgFormatError(f"no ';' after the record's prefix: {raw[:60]!r}")
    parts = head.split(",")
    if len(parts) < 4:
        raise KmsgFormatError(f"prefix {head[:60]!r} is not PRIORITY,SEQ,TIMESTAMP,FLAGS")
    try:
        priority, seq, ts_us = int(parts[0]), int(parts[1]), int(parts[2])
    except ValueError:
        raise KmsgFormatError(f"prefix {head[:60]!r} has a field that is not a number") from None
    if priority < 0 or seq < 0 or ts_us < 0:
        raise KmsgFormatError(f"prefix {head[:60]!r} has a negative field")
    lines = rest.split("\n")
    text = unescape(lines[0])
    fields: dict[str, str] = {}
    for line in lines[1:]:
        if not line.startswith(" "):
            continue  # the record's trailing newline
        key, eq, value = line[1:].partition("=")
        if eq and key:
            fields[key] = unescape(value)
    return KmsgRecord(
        facility=priority >> 3,
        level=priority & 7,
        seq=seq,
        ts_us=ts_us,
        text=text,
        flags=parts[3] or "-",
        fields=fields,
    )


def split_records(data: str) -> list[str]:
    """A text of records (a file in /dev/kmsg's format, several reads' worth) cut into
    one string per record: a record is a line not starting with a space, with the
    continuation lines that follow it."""
    records: list[str] = []
    current: list[str] = []
    for line in data.split("\n"):
        if line.startswith(" ") and current:
            current.append(line)
            continue
        if current:
            records.append("\n".join(current))
        current = [line] if line else []
    if current:
        records.append("\n".join(current))
    return records


def text_record(text: str, seq: int = 0, ts_us: int = 0, level: int = 6) -> KmsgRecord:
    """A kernel record with this text (a line of dmesg's output, a fixture's line)."""
    return KmsgRecord(facility=KERNEL_FACILITY, level=level, seq=seq, ts_us=ts_us, text=text)
