"""Kernel log lines as people keep them, parsed into records (pure; docs/kmsg.md
"`metalguard agent kmsg scan`"): what ``dmesg`` prints in its formats, syslog and
``journalctl`` lines, and ``journalctl -o json``'s objects.

=========================================  ===========================================
``[  12.345678] text``                     ``dmesg`` (the time since boot)
``<3>[  12.345678] text``                  ``dmesg -r`` (the priority, raw)
``[Thu Dec  3 10:00:00 2026] text``        ``dmesg -T``
``kern  :err   : [  12.345678] text``      ``dmesg -x`` (facility and level decoded)
``2026-12-03T10:00:00,123456+00:00 text``  ``dmesg --time-format iso``
``Dec  3 10:00:00 host kernel: text``      syslog, ``journalctl -k`` (``-o short``)
``2026-12-03T10:00:00+0000 host kernel: …``  ``journalctl -o short-iso``, rsyslog
``kernel: text``                           a journal line without its date
``{"MESSAGE": ..., "_TRANSPORT": ...}``    ``journalctl -o json``
``text``                                   a bare message
=========================================  ===========================================

A syslog or journal line whose tag is not ``kernel`` (``sshd[42]:``), and a JSON entry
whose transport is not the kernel's, was not logged by the kernel: it becomes a record
with a user facility, ignored unless trusted, like a user write to /dev/kmsg.
"""

from __future__ import annotations

import json
import re
from typing import Final

from metalguard.agent.kmsg.record import LEVELS, KmsgRecord, unescape

USER_FACILITY: Final = 1
_MONOTONIC = r"\[\s*(?P<mono>\d+\.\d+)\]"
_PRIORITY = re.compile(r"^<(?P<prio>\d{1,3})>")
_DECODED = re.compile(
    r"^(?P<fac>kern|user|mail|daemon|auth|syslog|lpr|news|uucp|cron|authpriv|ftp|local[0-7])"
    r"\s*:(?P<lvl>emerg|alert|crit|err|warning|warn|notice|info|debug)\s*: ?"
)
_DMESG_LEVELS: Final = {**{name: n for n, name in enumerate(LEVELS)}, "warn": 4}
_KERNEL_TAG = re.compile(r"^kernel: ")
"""The journal's tag alone (a line whose date was cut off)."""
_DMESG = re.compile(rf"^{_MONOTONIC} ?")
_CALLER = re.compile(r"^\[\s*[TC]\d+\] ?")
"""The printk caller id some kernels add after the time (``[  T309]``, ``[   C3]``)."""
_CTIME = re.compile(r"^\[(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) [A-Z][a-z]{2} [ \d]\d [\d:]{8} \d{4}\] ?")
_ISO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)? ?")
"""``dmesg --time-format iso`` (a comma before the fraction: no host and tag follow)."""
_SYSLOG_DATE = re.compile(
    r"^(?:[^\W\d_]{3,4}\.? {1,2}\d{1,2} \d\d:\d\d:\d\d(?:\.\d+)?"
    r"|\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:?\d\d)?) "
)
"""syslog's and journalctl's dates (``-o short``, ``short-iso``, ``short-iso-precise``,
RFC 3339; a month in the machine's language, ``kwi 15``): a host (where the line kept
it) and a tag follow."""
_TAGGED = re.compile(r"(?:(?P<host>\S*[^\s:]) )?(?P<tag>[^\s:\[]+)(?:\[\d+\])?: ?")
_FACILITIES: Final = {"kern": 0, "user": 1}
_KERNEL_TRANSPORTS: Final = frozenset({"kernel", "driver"})


def parse_line(line: str, seq: int) -> KmsgRecord | None:
    """The record of one line in any of the formats above, numbered ``seq`` (its place
    in the input); None for a blank line."""
    text = line.rstrip("\r\n")
    if not text.strip():
        return None
    if text.lstrip().startswith("{"):
        entry = _journal_entry(text, seq)
        if entry is not None:
            return entry
    return _plain(text, seq)


def _plain(text: str, seq: int) -> KmsgRecord:
    facility, level, ts_us = 0, 6, 0
    if (m := _SYSLOG_DATE.match(text)) and (tagged := _TAGGED.match(text, m.end())):
        if tagged.group("tag") != "kernel":
            facility = USER_FACILITY
        text = text[tagged.end() :]
    elif m := _ISO.match(text) or _KERNEL_TAG.match(text):
        text = text[m.end() :]
    if m := _DECODED.match(text):
        facility = _FACILITIES.get(m.group("fac"), USER_FACILITY)
        level = _DMESG_LEVELS[m.group("lvl")]
        text = text[m.end() :]
    if m := _PRIORITY.match(text):
        prio = int(m.group("prio"))
        facility, level = prio >> 3, prio & 7
        text = text[m.end() :]
    if m := _DMESG.match(text):
        ts_us = int(float(m.group("mono")) * 1e6)
        text = text[m.end() :]
    elif m := _CTIME.match(text) or _ISO.match(text):
        text = text[m.end() :]
    if m := _CALLER.match(text):
        text = text[m.end() :]
    return KmsgRecord(facility=facility, level=level, seq=seq, ts_us=ts_us, text=unescape(text))


def _journal_entry(text: str, seq: int) -> KmsgRecord | None:
    """One ``journalctl -o json`` object (None: not one)."""
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    return journal_record(doc, seq) if isinstance(doc, dict) else None


def journal_record(doc: dict[str, object], seq: int) -> KmsgRecord | None:
    """The record of one journal entry (``journalctl -o json``'s object; None without a
    ``MESSAGE``): the kernel's own time of the record (``_SOURCE_MONOTONIC_TIMESTAMP``)
    where the journal kept it."""
    if "MESSAGE" not in doc:
        return None
    message = doc["MESSAGE"]
    if isinstance(message, list):  # journald's form of a message that is not UTF-8
        message = bytes(b for b in message if isinstance(b, int) and 0 <= b < 256).decode(
            "utf-8", errors="replace"
        )
    transport = doc.get("_TRANSPORT")
    kernel = transport in _KERNEL_TRANSPORTS or (
        transport is None and _int(doc.get("SYSLOG_FACILITY"), USER_FACILITY) == 0
    )
    fields: dict[str, str] = {k: str(doc[k]) for k in ("SUBSYSTEM", "DEVICE") if k in doc}
    if "_KERNEL_DEVICE" in doc and "DEVICE" not in fields:
        fields["DEVICE"] = str(doc["_KERNEL_DEVICE"])
    if "_KERNEL_SUBSYSTEM" in doc and "SUBSYSTEM" not in fields:
        fields["SUBSYSTEM"] = str(doc["_KERNEL_SUBSYSTEM"])
    return KmsgRecord(
        facility=0 if kernel else USER_FACILITY,
        level=_int(doc.get("PRIORITY"), 6) & 7,
        seq=seq,
        ts_us=_int(doc.get("_SOURCE_MONOTONIC_TIMESTAMP", doc.get("__MONOTONIC_TIMESTAMP")), 0),
        text=str(message).rstrip("\n"),
        fields=fields,
    )


def _int(value: object, default: int) -> int:
    try:
        return int(str(value))
    except ValueError:
        return default
