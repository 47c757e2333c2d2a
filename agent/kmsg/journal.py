"""The previous boot's kernel log from the journal (docs/kmsg.md "Panics").

Where journald keeps a persistent journal, the kernel's records of the boot before this
one are there: ``journalctl -k -b -1 -o json``. The agent reads them once per boot, at its
start, for what it did not see while that boot ran: records after the cursor it left in
that boot (the time of the last record it handled), or all of them where it left none
(it was not running, or the cursor is of an older boot). A panic rarely reaches the
journal (pstore keeps those); the oops, lockup or hung task before it often does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from metalguard.agent.kmsg.logline import journal_record
from metalguard.agent.kmsg.reader import Cursor
from metalguard.agent.kmsg.record import KmsgRecord
from metalguard.agent.statefile import write_json

log = logging.getLogger(__name__)

JOURNAL_STATE: Final = "kmsg.journal.json"
"""The boot whose previous boot's journal was read, in the agent's spool directory."""
MAX_ENTRIES: Final = 5000
"""The newest entries of the previous boot read (the end of a boot is what explains it)."""
MAX_OUTPUT: Final = 32 << 20


@dataclass(frozen=True, slots=True)
class PreviousBoot:
    """The previous boot's kernel records, as the journal kept them."""

    boot_id: str
    """journald's form (32 hex digits, no dashes); "" when no entry named one."""
    records: tuple[KmsgRecord, ...]


def journal_command(journalctl: str, entries: int = MAX_ENTRIES) -> list[str]:
    """The command that prints the previous boot's kernel records as JSON, one a line."""
    return [journalctl, "-k", "-b", "-1", "-o", "json", "--no-pager", "-q", "-n", str(entries)]


def parse_journal(output: str) -> PreviousBoot:
    """``journalctl -o json``'s lines as records (pure); lines that are not an entry with a
    message are left out."""
    boot = ""
    records: list[KmsgRecord] = []
    for line in output.splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if not isinstance(doc, dict):
            continue
        record = journal_record(doc, len(records) + 1)
        if record is None:
            continue
        boot = boot or str(doc.get("_BOOT_ID", ""))
        records.append(record)
    return PreviousBoot(boot, tuple(records))


def same_boot(journal_boot: str, cursor_boot: str) -> bool:
    """Whether journald's boot id and /proc's (with dashes) name one boot."""
    return (
        bool(journal_boot)
        and journal_boot.replace("-", "").lower() == cursor_boot.replace("-", "").lower()
    )


def unseen(previous: PreviousBoot, cursor: Cursor | None) -> list[KmsgRecord]:
    """The kernel's records of the previous boot the agent did not handle while it ran
    (pure): after the cursor's time where the cursor is of that boot, else all."""
    kernel = [r for r in previous.records if r.from_kernel]
    if cursor is None or not same_boot(previous.boot_id, cursor.boot_id):
        return kernel
    return [r for r in kernel if r.ts_us > cursor.ts_us]


def read_done(path: Path | None, boot: str) -> bool:
    """Whether this boot already read its previous boot's journal."""
    if path is None or not boot:
        return False
    with contextlib.suppress(OSError, ValueError, AttributeError):
        return bool(json.loads(path.read_text()).get("boot_id") == boot)
    return False


def mark_done(path: Path | None, boot: str) -> None:
    """Remember that this boot read its previous boot's journal."""
    if path is not None and boot:
        write_json(path, {"boot_id": boot}, "kmsg journal state")


async def read_previous_boot(journalctl: str, timeout_s: float = 20.0) -> PreviousBoot | None:
    """Run journalctl (None: not installed, no journal of the previous boot, or it failed
    or took too long: logged)."""
    binary = shutil.which(journalctl)
    if binary is None:
        log.debug("kmsg: no %s: the previous boot's journal is not read", journalctl)
        return None
    try:
        proc = await asyncio.create_subprocess_exec(
            *journal_command(binary),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            stdin=asyncio.subprocess.DEVNULL,
        )
    except OSError as exc:
        log.warning("kmsg: cannot run %s: %s", binary, exc)
        return None
    try:
        async with asyncio.timeout(timeout_s):
            out, err = await proc.communicate()
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        log.warning("kmsg: %s took over %gs: the previous boot not read", binary, timeout_s)
        return None
    if proc.returncode != 0:
        # "Data from the specified boot (-1) is not available", no persistent journal, ...
        reason = err.decode(errors="replace").strip().splitlines()
        why = reason[-1] if reason else f"exit {proc.returncode}"
        log.info("kmsg: no previous boot in the journal (%s)", why)
        return None
    return parse_journal(out[-MAX_OUTPUT:].decode("utf-8", errors="replace"))
