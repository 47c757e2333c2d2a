"""Classify kernel log records by rules (pure; the shipped ``rules.toml`` beside this
module, a user's rules file, node-problem-detector's kernel-monitor.json; docs/kmsg.md).

A rule's pattern is searched in the record's text; the first rule that matches gives the
:class:`Finding`: its kind, severity (fixed, by its ``sev`` group, or from NVIDIA's XID
catalog), the device (the pattern's ``device`` group, else the record's ``DEVICE``), the
XID and what to do. A rule marked ``ignore`` (a known harmless flood) gives an
:class:`Ignored` instead.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any, Final

from metalguard.agent.kmsg.record import KmsgRecord
from metalguard.proto.xid import classify

KINDS: Final = (
    "gpu_xid",
    "gpu_sxid",
    "gpu_fallen_off_bus",
    "memory_corrected",
    "memory_uncorrected",
    "machine_check",
    "hardware_error",
    "pcie_aer",
    "pcie_link_down",
    "hung_task",
    "soft_lockup",
    "hard_lockup",
    "rcu_stall",
    "oom_kill",
    "fs_error",
    "fs_readonly",
    "io_error",
    "nvme_timeout",
    "nvme_down",
    "nic_fault",
    "kernel_panic",
    "kernel_oops",
    "segfault",
)
"""The kinds the shipped rules give (a user's rules may add their own)."""
SEVERITIES: Final = ("info", "warning", "critical")
XID_SEVERITY: Final = "xid"
_KIND = re.compile(r"^[a-z][a-z0-9_]{0,62}$")
_XID_154_ACTION = re.compile(r"to 0x[0-9a-fA-F]+ \((?P<action>[^)]+)\)")
REBOOT_WORDS: Final = ("reboot", "power cycle")


class RulesError(ValueError):
    """A rules file that cannot be used; the message names the file, rule and problem."""


@dataclass(frozen=True, slots=True)
class Rule:
    """One compiled rule."""

    name: str
    kind: str
    pattern: re.Pattern[str]
    severity: str
    severity_map: dict[str, str] = field(default_factory=dict)
    action: str = ""
    ignore: bool = False
    example: str = ""
    source: str = "shipped"


@dataclass(frozen=True, slots=True)
class Finding:
    """What one record says, by the rule that matched it."""

    seq: int
    ts_us: int
    kind: str
    severity: str
    device: str
    rule: str
    message: str
    xid: int | None = None
    action: str = ""
    xid_class: str = ""
    caused_by: int | None = None
    """An XID 45's earlier XID ("caused by previous Xid N")."""
    link: int | None = None
    """The NVLink (or NVSwitch link) the record names."""
    pid: int | None = None
    """The process the record names (an OOM kill's victim, a hung task, a segfault)."""

    def to_json(self) -> dict[str, Any]:
        """The finding as ``kmsg scan --format json`` prints it."""
        return {
            "seq": self.seq,
            "ts": self.ts_us / 1e6,
            "kind": self.kind,
            "severity": self.severity,
            "device": self.device,
            "xid": self.xid,
            "action": self.action,
            "rule": self.rule,
            "message": self.message,
        }


@dataclass(frozen=True, slots=True)
class Ignored:
    """A record a rule marks harmless (counted, not reported)."""

    rule: str


def parse_rules(text: str, source: str) -> list[Rule]:
    """The rules of a TOML rules document; RulesError naming the rule and problem."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RulesError(f"{source}: {exc}") from None
    entries = doc.get("rule", [])
    if not isinstance(entries, list):
        raise RulesError(f"{source}: `rule` must be an array of tables ([[rule]])")
    rules: list[Rule] = []
    names: set[str] = set()
    for i, entry in enumerate(entries):
        where = f"{source}: rule {i + 1}"
        if not isinstance(entry, dict):
            raise RulesError(f"{where}: not a table")
        rule = _rule(entry, where, source)
        if rule.name in names:
            raise RulesError(f"{where}: the name {rule.name!r} is used twice")
        names.add(rule.name)
        rules.append(rule)
    return rules


def _rule(entry: dict[str, Any], where: str, source: str) -> Rule:
    unknown = set(entry) - {
        "name",
        "kind",
        "pattern",
        "severity",
        "severity_map",
        "action",
        "ignore",
        "example",
    }
    if unknown:
        raise RulesError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
    name, kind, pattern = entry.get("name"), entry.get("kind"), entry.get("pattern")
    if not isinstance(name, str) or not name:
        raise RulesError(f"{where}: `name` (a non-empty string) is required")
    where = f"{where} ({name})"
    if not isinstance(kind, str) or not _KIND.match(kind):
        raise RulesError(f"{where}: `kind` must be a lowercase token like 'gpu_xid'")
    if not isinstance(pattern, str) or not pattern:
        raise RulesError(f"{where}: `pattern` (a regular expression) is required")
    try:
        compiled = re.compile(pattern)
    except re.error as exc:
        raise RulesError(f"{where}: bad pattern: {exc}") from None
    severity = entry.get("severity", "warning")
    allowed = (*SEVERITIES, XID_SEVERITY)
    if severity not in allowed:
        raise RulesError(f"{where}: `severity` must be one of {', '.join(allowed)}")
    raw_map = entry.get("severity_map", {})
    if not isinstance(raw_map, dict) or not all(v in SEVERITIES for v in raw_map.values()):
        raise RulesError(f"{where}: `severity_map` values must be one of {SEVERITIES}")
    if raw_map and "sev" not in compiled.groupindex:
        raise RulesError(f"{where}: `severity_map` needs a (?P<sev>...) group in the pattern")
    example = entry.get("example", "")
    rule = Rule(
        name=name,
        kind=kind,
        pattern=compiled,
        severity=severity,
        severity_map={str(k).lower(): str(v) for k, v in raw_map.items()},
        action=str(entry.get("action", "")),
        ignore=bool(entry.get("ignore", False)),
        example=str(example),
        source=source,
    )
    if rule.example and not rule.pattern.search(rule.example):
        raise RulesError(f"{where}: the pattern does not match its own example")
    return rule


@cache
def shipped_rules() -> tuple[Rule, ...]:
    """The rules metalguard ships (read once)."""
    text = resources.files("metalguard.agent.kmsg").joinpath("rules.toml").read_text("utf-8")
    return tuple(parse_rules(text, "rules.toml"))


def merged(user: Sequence[Rule], shipped: Sequence[Rule] | None = None) -> tuple[Rule, ...]:
    """A user's rules first, then the shipped ones they do not replace (same name)."""
    base = shipped_rules() if shipped is None else shipped
    names = {r.name for r in user}
    return (*user, *(r for r in base if r.name not in names))


NPD_KINDS: Final = {
    "OOMKilling": "oom_kill",
    "TaskHung": "hung_task",
    "DockerHung": "hung_task",
    "UnregisterNetDevice": "nic_fault",
    "KernelOops": "kernel_oops",
    "Ext4Error": "fs_error",
    "Ext4Warning": "fs_error",
    "IOError": "io_error",
    "XfsHasShutdown": "fs_readonly",
    "MemoryReadError": "memory_corrected",
    "FilesystemIsReadOnly": "fs_readonly",
    "CorruptDockerOverlay2": "fs_error",
    "AUFSUmountHung": "hung_task",
}
"""node-problem-detector's reasons (its config/kernel-monitor.json) -> our kinds; another
reason becomes ``npd_<reason in snake case>``."""


def npd_rules(text: str, source: str) -> list[Rule]:
    """node-problem-detector's kernel-monitor.json as rules: each ``rules`` entry's
    pattern (matched at the end of the message, as NPD does), kind from its reason,
    ``permanent`` critical and ``temporary`` warning; RulesError naming the problem."""
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise RulesError(f"{source}: not JSON: {exc}") from None
    entries = doc.get("rules") if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        raise RulesError(f"{source}: no `rules` list (node-problem-detector's format)")
    rules: list[Rule] = []
    for i, entry in enumerate(entries):
        where = f"{source}: rules[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("pattern"), str):
            raise RulesError(f"{where}: needs a `pattern`")
        reason = str(entry.get("reason") or f"rule{i}")
        kind = NPD_KINDS.get(reason) or "npd_" + re.sub(r"(?<!^)(?=[A-Z])", "_", reason).lower()
        if not _KIND.match(kind):
            kind = f"npd_rule{i}"
        try:
            pattern = re.compile(entry["pattern"] + r"\Z")
        except re.error as exc:
            raise RulesError(f"{where} ({reason}): bad pattern: {exc}") from None
        severity = "critical" if entry.get("type") == "permanent" else "warning"
        rules.append(
            Rule(
                name=f"npd_{i}_{reason}",
                kind=kind,
                pattern=pattern,
                severity=severity,
                action=str(entry.get("condition") or ""),
                source=source,
            )
        )
    return rules


def rules_to_toml(rules: Iterable[Rule]) -> str:
    """Rules written as a rules file (``kmsg import-npd``)."""
    out = ["# converted by metalguard agent kmsg import-npd\n"]
    for r in rules:
        out.append("[[rule]]")
        out.append(f"name = {json.dumps(r.name)}")
        out.append(f"kind = {json.dumps(r.kind)}")
        out.append(f"severity = {json.dumps(r.severity)}")
        if r.action:
            out.append(f"action = {json.dumps(r.action)}")
        out.append(f"pattern = {json.dumps(r.pattern.pattern)}")
        out.append("")
    return "\n".join(out)


def match(record: KmsgRecord, rules: Sequence[Rule]) -> Finding | Ignored | None:
    """What the first matching rule says of ``record`` (None: no rule matches)."""
    text = record.text
    for rule in rules:
        m = rule.pattern.search(text)
        if m is None:
            continue
        if rule.ignore:
            return Ignored(rule.name)
        return _finding(record, rule, m)
    return None


def _group(m: re.Match[str], name: str) -> str | None:
    return m.group(name) if name in m.re.groupindex else None


def _int(value: str | None) -> int | None:
    return int(value) if value is not None and value.isdigit() else None


def _finding(record: KmsgRecord, rule: Rule, m: re.Match[str]) -> Finding:
    device = _group(m, "device") or record.device
    severity = rule.severity
    sev = _group(m, "sev")
    if sev is not None and sev.lower() in rule.severity_map:
        severity = rule.severity_map[sev.lower()]
    xid = _int(_group(m, "xid"))
    action, xid_class = rule.action, ""
    if xid is not None:
        entry = classify(xid)
        xid_class, action = entry.xid_class, entry.action
        if severity == XID_SEVERITY:
            severity = entry.severity
        named = _XID_154_ACTION.search(record.text) if xid == 154 else None
        if named is not None:  # 154 names its action
            action = named.group("action")
            said = action.lower()
            severity = "critical" if any(w in said for w in REBOOT_WORDS) else "warning"
    elif severity == XID_SEVERITY:
        severity = "warning"
    return Finding(
        seq=record.seq,
        ts_us=record.ts_us,
        kind=rule.kind,
        severity=severity,
        device=device,
        rule=rule.name,
        message=record.text,
        xid=xid,
        action=action,
        xid_class=xid_class,
        caused_by=_int(_group(m, "prev")),
        link=_int(_group(m, "link")),
        pid=_int(_group(m, "pid") or _group(m, "oldpid")),
    )
