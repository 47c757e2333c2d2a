"""``metalguard agent kmsg scan`` and ``import-npd`` (docs/kmsg.md): classify records in
/dev/kmsg's format read from a file or standard input, one finding per line; convert
node-problem-detector's kernel-monitor.json into a rules file."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from metalguard.agent.kmsg.logline import parse_line
from metalguard.agent.kmsg.record import KmsgFormatError, KmsgRecord, parse_record, split_records
from metalguard.agent.kmsg.rules import (
    Finding,
    Ignored,
    Rule,
    RulesError,
    match,
    merged,
    npd_rules,
    parse_rules,
    rules_to_toml,
)


@dataclass(slots=True)
class ScanCounts:
    """What a scan saw besides its findings."""

    records: int = 0
    malformed: list[str] = field(default_factory=list)
    user_records: int = 0
    """Records not from the kernel (facility != 0), ignored unless trusted."""
    ignored: int = 0
    """Records a rule marks harmless."""


def load_rules_file(path: Path) -> list[Rule]:
    """A user's rules: TOML, or node-problem-detector's JSON (``.json``, or text that
    starts with ``{``); RulesError naming the file and problem."""
    try:
        text = path.read_text("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RulesError(f"{path}: {exc}") from None
    if path.suffix == ".json" or text.lstrip().startswith("{"):
        return npd_rules(text, str(path))
    return parse_rules(text, str(path))


def text_records(data: str) -> Iterator[KmsgRecord]:
    """The records of text in the formats of dmesg, syslog or the journal, one a line,
    numbered from 1 by line."""
    for number, line in enumerate(data.split("\n"), start=1):
        record = parse_line(line, number)
        if record is not None:
            yield record


def scan(
    texts: Iterable[str | KmsgRecord],
    rules: Sequence[Rule],
    counts: ScanCounts,
    *,
    trust_user: bool = False,
) -> Iterator[Finding]:
    """The findings of the records in ``texts`` (in /dev/kmsg's format, one record each,
    continuation lines included, or records already parsed), counting the malformed, the
    user-written and the ignored ones."""
    for raw in texts:
        try:
            record = raw if isinstance(raw, KmsgRecord) else parse_record(raw)
        except KmsgFormatError as exc:
            counts.malformed.append(str(exc))
            continue
        counts.records += 1
        found = classify_record(record, rules, counts, trust_user=trust_user)
        if found is not None:
            yield found


def classify_record(
    record: KmsgRecord, rules: Sequence[Rule], counts: ScanCounts, *, trust_user: bool
) -> Finding | None:
    """One record's finding (None: user-written and not trusted, ignored, or no match)."""
    if not record.from_kernel and not trust_user:
        counts.user_records += 1
        return None
    found = match(record, rules)
    if isinstance(found, Ignored):
        counts.ignored += 1
        return None
    return found


def format_text(f: Finding) -> str:
    """One finding as ``kmsg scan --format text`` prints it."""
    xid = f" xid={f.xid}" if f.xid is not None else ""
    device = f" {f.device}" if f.device else ""
    action = f" ({f.action})" if f.action else ""
    return f"{f.seq} {f.ts_us / 1e6:.6f} {f.severity} {f.kind}{device}{xid}{action}: {f.message}"


def main_scan(
    file: str,
    rules_path: Path | None,
    *,
    trust_user: bool,
    output_format: str,
    input_format: str = "kmsg",
    out: TextIO = sys.stdout,
    err: TextIO = sys.stderr,
) -> int:
    """Run ``kmsg scan``; the exit status (2: unreadable input or rules)."""
    try:
        user = load_rules_file(rules_path) if rules_path is not None else []
    except RulesError as exc:
        print(f"metalguard: {exc}", file=err)
        return 2
    try:
        source = sys.stdin if file == "-" else None
        data = source.read() if source else Path(file).read_text("utf-8", errors="replace")
    except OSError as exc:
        print(f"metalguard: {file}: {exc}", file=err)
        return 2
    counts = ScanCounts()
    records = split_records(data) if input_format == "kmsg" else text_records(data)
    for f in scan(records, merged(user), counts, trust_user=trust_user):
        line = json.dumps(f.to_json()) if output_format == "json" else format_text(f)
        print(line, file=out)
    for problem in counts.malformed[:20]:
        print(f"metalguard: malformed record: {problem}", file=err)
    if counts.malformed:
        print(
            f"metalguard: {len(counts.malformed)} malformed record(s) skipped "
            "(lines of dmesg, syslog or the journal? --input text reads them)",
            file=err,
        )
    if counts.user_records:
        print(
            f"metalguard: {counts.user_records} record(s) written from user space ignored "
            "(--trust-user-records takes them)",
            file=err,
        )
    return 0


def main_import_npd(path: Path, output: Path | None, *, out: TextIO = sys.stdout) -> int:
    """Run ``kmsg import-npd``: node-problem-detector's rules as a rules file."""
    try:
        rules = npd_rules(path.read_text("utf-8"), str(path))
    except (OSError, UnicodeDecodeError) as exc:
        print(f"metalguard: {path}: {exc}", file=sys.stderr)
        return 2
    except RulesError as exc:
        print(f"metalguard: {exc}", file=sys.stderr)
        return 2
    text = rules_to_toml(rules)
    if output is None:
        out.write(text)
    else:
        output.write_text(text, "utf-8")
    return 0
