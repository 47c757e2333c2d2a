"""The agent's kernel log monitor: records from the reader, classified by the rules, storms
coalesced, each finding of severity warning or above published at once as a NodeEvent,
and the counts per kind for every batch (docs/kmsg.md).

NodeEvents: an XID is ``gpu_xid`` (source ``kmsg``: the same kind as NVML's watcher's, so
the controller and the job manager's blame take it alike, even when NVML no longer
answers), every other kind ``kmsg_<kind>``; ``attributes``: ``kind``, ``rule``, ``seq``,
``count`` (records it stands for), ``repeats`` (the storm's later records, reported when
its window ended), ``xid``, ``class``, ``action``, ``link``, ``caused_by``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from metalguard.agent.kmsg.journal import mark_done, read_done, read_previous_boot, unseen
from metalguard.agent.kmsg.pstore import dump_key, dump_records, dumps
from metalguard.agent.kmsg.reader import KmsgReader
from metalguard.agent.kmsg.record import KmsgRecord
from metalguard.agent.kmsg.rules import Finding, Rule, merged
from metalguard.agent.kmsg.scan import ScanCounts, classify_record, load_rules_file
from metalguard.agent.kmsg.storm import Coalescer, Report, suppressed_callbacks
from metalguard.agent.statefile import write_json
from metalguard.proto.base import AttrValue, NodeIdentity
from metalguard.proto.events import NodeEvent
from metalguard.proto.telemetry import KmsgCounts

log = logging.getLogger(__name__)

EVENT_SEVERITIES = frozenset({"warning", "critical"})
CURSOR = "kmsg.cursor.json"
"""The reader's cursor, in the agent's spool directory."""

Emit = Callable[[NodeEvent], Awaitable[None]]


def event_of(report: Report, node: NodeIdentity, ts: float, event_id: str) -> NodeEvent:
    """The NodeEvent of one report (pure)."""
    f = report.finding
    kind = "gpu_xid" if f.kind == "gpu_xid" else f"kmsg_{f.kind}"
    attributes: dict[str, AttrValue] = {
        "kind": f.kind,
        "rule": f.rule,
        "seq": f.seq,
        "count": report.count,
        "repeats": report.repeats,
    }
    if f.xid is not None:
        attributes.update({"xid": f.xid, "class": f.xid_class, "action": f.action})
    elif f.action:
        attributes["action"] = f.action
    if f.link is not None:
        attributes["link"] = f.link
    if f.caused_by is not None:
        attributes["caused_by"] = f.caused_by
    if report.previous_boot:
        attributes["previous_boot"] = True
    said = f.message if not report.repeats else f"{report.count} more like: {f.message}"
    return NodeEvent(
        node=node,
        event_id=event_id,
        ts=ts,
        kind=kind,
        source="kmsg",
        device=f.device,
        severity=f.severity,
        message=said[:1000],
        attributes=attributes,
    )


class KmsgSource:
    """Reads the kernel log and publishes what it finds."""

    def __init__(
        self,
        identity: Callable[[], NodeIdentity],
        emit: Emit,
        path: Path,
        *,
        rules: Sequence[Rule] | None = None,
        cursor_path: Path | None = None,
        backfill_s: float = 300.0,
        storm_window_s: float = 60.0,
        trust_user: bool = False,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        boot: str | None = None,
        on_oom_kill: Callable[[int, float], None] = lambda _pid, _ts: None,
        on_xid: Callable[[str, int, float], None] = lambda _pci, _xid, _ts: None,
        pstore: tuple[Path, ...] = (),
        pstore_state: Path | None = None,
        journalctl: str = "",
        journal_state: Path | None = None,
    ) -> None:
        """``on_oom_kill``: told each process the OOM killer killed (pid, time): the
        workload runner makes it the member's exit cause."""
        self._on_oom_kill = on_oom_kill
        self._on_xid = on_xid
        """Told each XID of the kernel log (PCI address, XID, time): the agent's XID
        ledger takes it for the GPU's ``xid_errors``."""
        self._pstore = pstore
        self._pstore_state = pstore_state
        self._journalctl = journalctl
        """The previous boot's journal is read with this ("" : not read)."""
        self._journal_state = journal_state
        self._previous_boot_texts: set[str] = set()
        """What pstore reported of the previous boot: the journal does not again."""
        self._identity = identity
        self._emit = emit
        self.rules = tuple(rules) if rules is not None else merged([])
        self._trust_user = trust_user
        self._clock = clock
        self._mono = monotonic
        self._storms = Coalescer(storm_window_s)
        self._scan = ScanCounts()
        self._findings: Counter[str] = Counter()
        self._critical: Counter[str] = Counter()
        self._kinds = tuple(dict.fromkeys(r.kind for r in self.rules if not r.ignore))
        """Every kind the rules give, counted from 0: a first finding is growth."""
        self._suppressed = 0
        self._queue: asyncio.Queue[Report] = asyncio.Queue()
        self.reader = KmsgReader(
            path, self._on_records, cursor_path=cursor_path, backfill_s=backfill_s, boot=boot
        )

    def counts(self) -> KmsgCounts:
        """The counts for the next batch."""
        read = self.reader.counts
        return KmsgCounts(
            records=self._scan.records,
            findings={**dict.fromkeys(self._kinds, 0), **self._findings},
            critical={**dict.fromkeys(self._kinds, 0), **self._critical},
            lost=read.lost,
            suppressed=self._suppressed,
            user_records=self._scan.user_records,
            ignored=self._scan.ignored,
            malformed=read.malformed,
        )

    async def run(self) -> None:
        """Read, classify and publish until cancelled."""
        await asyncio.to_thread(self._read_pstore)
        await self._read_journal()
        publisher = asyncio.create_task(self._publish(), name="kmsg-publish")
        flusher = asyncio.create_task(self._flush_storms(), name="kmsg-storms")
        try:
            await self.reader.run()
        finally:
            self.reader.stop()
            for task in (publisher, flusher):
                task.cancel()
            for task in (publisher, flusher):
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    def _on_records(self, records: list[KmsgRecord]) -> None:
        now = self._mono()
        for record in records:
            self._suppressed += suppressed_callbacks(record.text) if record.from_kernel else 0
            self._scan.records += 1
            found = classify_record(record, self.rules, self._scan, trust_user=self._trust_user)
            if found is None:
                continue
            self._count(found)
            if found.kind == "oom_kill" and found.pid is not None:
                self._on_oom_kill(found.pid, self._clock())
            if found.xid is not None and found.device:
                self._on_xid(found.device, found.xid, self._clock())
            if found.severity in EVENT_SEVERITIES:
                for report in self._storms.feed(found, now):
                    self._queue.put_nowait(report)

    def _count(self, found: Finding) -> None:
        self._findings[found.kind] += 1
        if found.severity == "critical":
            self._critical[found.kind] += 1

    def _read_pstore(self) -> None:
        """The previous boot's dumps not handled yet (a panic's records survive only
        there): each finding counted and, warning or above, reported once, marked
        ``previous_boot``; the dumps handled are remembered in ``pstore_state``."""
        handled = load_handled(self._pstore_state)
        new: list[str] = []
        for path in dumps(self._pstore):
            try:
                key = dump_key(path)
                if key in handled:
                    continue
                records = dump_records(path.read_text(errors="replace"))
            except OSError as exc:
                log.warning("kmsg: pstore dump %s unreadable: %s", path, exc)
                continue
            new.append(key)
            for record in records:
                self._previous_boot(record)
        if new:
            save_handled(self._pstore_state, [*handled, *new])

    async def _read_journal(self) -> None:
        """The previous boot's kernel records in the journal that the agent did not handle
        while that boot ran (once per boot): counted, and reported like pstore's."""
        boot = self.reader.position.boot
        if not self._journalctl or read_done(self._journal_state, boot):
            return
        previous = await read_previous_boot(self._journalctl)
        if previous is not None:
            saved = self.reader.saved_at_start  # a cursor of this boot says nothing of the last
            records = unseen(previous, saved if saved and saved.boot_id != boot else None)
            for record in records:
                if record.text not in self._previous_boot_texts:
                    self._previous_boot(record)
            log.info(
                "kmsg: the previous boot's journal: %d kernel records not seen while it ran",
                len(records),
            )
        mark_done(self._journal_state, boot)

    def _previous_boot(self, record: KmsgRecord) -> None:
        """One record of the previous boot: counted; warning or above, reported once."""
        found = classify_record(record, self.rules, self._scan, trust_user=False)
        if found is None:
            return
        self._previous_boot_texts.add(record.text)
        self._count(found)
        if found.severity in EVENT_SEVERITIES:
            self._queue.put_nowait(Report(found, previous_boot=True))

    async def _flush_storms(self) -> None:
        """Report each ended storm window's repeats (a quarter window late at most)."""
        while True:
            await asyncio.sleep(self._storms.window_s / 4)
            for report in self._storms.flush(self._mono()):
                self._queue.put_nowait(report)

    async def _publish(self) -> None:
        while True:
            report = await self._queue.get()
            event = event_of(report, self._identity(), self._clock(), uuid.uuid4().hex)
            try:
                await self._emit(event)
            except Exception:  # the publisher spools; a bug here must not stop the log
                log.exception("kmsg: publishing %s failed", event.kind)


PSTORE_STATE = "kmsg.pstore.json"
"""The pstore dumps already handled, in the agent's spool directory."""
KEEP_HANDLED = 256


def load_handled(path: Path | None) -> list[str]:
    """The keys of the dumps handled before (none without a state file)."""
    if path is None:
        return []
    try:
        keys = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:
        log.warning("kmsg: %s unreadable (%s): reading the pstore dumps again", path, exc)
        return []
    return [str(k) for k in keys] if isinstance(keys, list) else []


def save_handled(path: Path | None, keys: list[str]) -> None:
    """Remember the handled dumps (the newest ``KEEP_HANDLED``), atomically."""
    if path is not None:
        write_json(path, keys[-KEEP_HANDLED:], "kmsg pstore state")


def load_user_rules(path: str) -> list[Rule]:
    """``[kmsg] rules`` (empty: none); RulesError naming the problem."""
    return load_rules_file(Path(path)) if path else []
