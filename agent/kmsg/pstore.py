"""The previous boot's kernel log, from pstore (pure parsing; docs/kmsg.md "Panics").

A panic's records do not survive the reboot in the ring buffer; where the platform keeps
them (ramoops, EFI variables, ERST), the kernel exposes them after the boot as files under
/sys/fs/pstore (``dmesg-ramoops-0``, ``dmesg-efi-...``, ``dmesg-erst-...``; systemd-pstore may move
them to /var/lib/systemd/pstore): a header line
(``Panic#1 Part1``), then one ``<PRIORITY>[  SECONDS.MICROS] TEXT`` line per record.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Final

from metalguard.agent.kmsg.record import KmsgRecord, unescape

DUMP_GLOB: Final = "dmesg*"
"""``dmesg-<backend>-<id>`` under /sys/fs/pstore; ``<time>/<id>/dmesg.txt`` where
systemd-pstore moved them (/var/lib/systemd/pstore)."""
_LINE = re.compile(r"^<(?P<pri>\d+)>\[\s*(?P<sec>\d+)\.(?P<frac>\d{1,9})\] (?P<text>.*)$")


def dump_records(text: str) -> list[KmsgRecord]:
    """The records of one pstore dump, in order (lines not in the record form, the
    header among them, are left out); ``seq`` numbers them within the dump."""
    records: list[KmsgRecord] = []
    for line in text.splitlines():
        m = _LINE.match(line)
        if m is None:
            continue
        pri = int(m.group("pri"))
        frac = m.group("frac").ljust(6, "0")[:6]
        records.append(
            KmsgRecord(
                facility=pri >> 3,
                level=pri & 7,
                seq=len(records) + 1,
                ts_us=int(m.group("sec")) * 1_000_000 + int(frac),
                text=unescape(m.group("text")),
            )
        )
    return records


def dumps(directories: tuple[Path, ...]) -> list[Path]:
    """The dmesg dumps under these directories (none where one is absent or unreadable)."""
    found: list[Path] = []
    for directory in directories:
        try:
            found += sorted(p for p in directory.rglob(DUMP_GLOB) if p.is_file())
        except OSError:
            continue
    return found


def dump_key(path: Path) -> str:
    """What names one dump across agent restarts: its name, size and modification time."""
    st = path.stat()
    return f"{path.name}:{st.st_size}:{st.st_mtime_ns}"
