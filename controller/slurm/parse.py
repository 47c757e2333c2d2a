"""Pure parsers for what Slurm's own tools print (checked against Slurm 22.05).

Two forms per view: the ``--json`` output (``sinfo --json``, ``squeue --json``; the
OpenAPI v0.0.38 shapes of 22.05) and, for Slurm versions without ``--json`` (before
21.08), the text of ``scontrol show node -o`` and ``squeue -h -o '%i|%T|%N|%r'``.
Every parser takes text and returns frozen records; bad input raises :class:`SlurmParseError`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

SQUEUE_TEXT_FORMAT = "%i|%T|%N|%r"
"""The ``squeue -h -o`` format :func:`parse_squeue_text` reads."""

_DOWN_STATES = frozenset({"DOWN"})
_HOSTLIST_PART = re.compile(r"([^,\[]+)(?:\[([^\]]+)\])?([^,\[]*)")


class SlurmParseError(ValueError):
    """Slurm's output could not be read; the message says what was wrong."""


@dataclass(frozen=True, slots=True)
class SlurmNode:
    """One Slurm node as ``sinfo``/``scontrol`` report it.

    ``state`` is the base state in upper case (IDLE, MIXED, ALLOCATED, DOWN, ...);
    ``flags`` the state flags (DRAIN, NOT_RESPONDING, COMPLETING, ...)."""

    name: str
    state: str
    flags: frozenset[str] = frozenset()
    reason: str = ""

    @property
    def drained(self) -> bool:
        """Draining or drained: Slurm places no new work on it."""
        return "DRAIN" in self.flags

    @property
    def down(self) -> bool:
        """Slurm itself thinks the node is gone: DOWN or NOT_RESPONDING."""
        return self.state in _DOWN_STATES or "NOT_RESPONDING" in self.flags

    def describe(self) -> str:
        """``MIXED+DRAIN`` as scontrol writes it."""
        return "+".join([self.state, *sorted(self.flags)])


@dataclass(frozen=True, slots=True)
class SlurmJob:
    """One job as ``squeue`` reports it (``nodes`` expanded from the hostlist)."""

    job_id: str
    state: str
    nodes: tuple[str, ...] = ()
    requeue: bool = True
    batch: bool = True

    @property
    def active(self) -> bool:
        """It holds nodes: running, suspended or completing."""
        return self.state in ("RUNNING", "SUSPENDED", "COMPLETING", "CONFIGURING")


def _load(text: str, what: str) -> dict[str, Any]:
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SlurmParseError(f"{what}: not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise SlurmParseError(f"{what}: expected an object, got {type(body).__name__}")
    errors = body.get("errors") or []
    if errors:
        raise SlurmParseError(f"{what}: Slurm reports errors: {errors}")
    return body


def _state_word(value: Any) -> str:
    """22.05 gives a string; newer versions a list of words."""
    if isinstance(value, list):
        return str(value[0]).upper() if value else "UNKNOWN"
    return str(value or "UNKNOWN").upper()


def parse_sinfo_json(text: str) -> tuple[SlurmNode, ...]:
    """The nodes of ``sinfo --json``, by name, each once."""
    body = _load(text, "sinfo --json")
    nodes: dict[str, SlurmNode] = {}
    for raw in body.get("nodes") or []:
        if not isinstance(raw, dict) or not raw.get("name"):
            raise SlurmParseError(f"sinfo --json: a node without a name: {raw!r}")
        state_value = raw.get("state")
        flags = {str(f).upper() for f in raw.get("state_flags") or []}
        if isinstance(state_value, list):  # 23.02+: ["IDLE", "DRAIN"]
            flags |= {str(f).upper() for f in state_value[1:]}
        name = str(raw["name"])
        nodes[name] = SlurmNode(
            name=name,
            state=_state_word(state_value),
            flags=frozenset(flags),
            reason=str(raw.get("reason") or ""),
        )
    return tuple(nodes[n] for n in sorted(nodes))


def parse_squeue_json(text: str) -> tuple[SlurmJob, ...]:
    """The jobs of ``squeue --json`` (22.05 also lists finished jobs still kept for
    MinJobAge, e.g. COMPLETED: :attr:`SlurmJob.active` tells them apart)."""
    body = _load(text, "squeue --json")
    jobs = []
    for raw in body.get("jobs") or []:
        if not isinstance(raw, dict) or raw.get("job_id") is None:
            raise SlurmParseError(f"squeue --json: a job without job_id: {raw!r}")
        jobs.append(
            SlurmJob(
                job_id=str(raw["job_id"]),
                state=_state_word(raw.get("job_state")),
                nodes=expand_hostlist(str(raw.get("nodes") or "")),
                requeue=bool(raw.get("requeue", True)),
                batch=bool(raw.get("batch_flag", True)),
            )
        )
    return tuple(jobs)


_SCONTROL_KEY = re.compile(r"(?:^|\s)([A-Za-z_/:]+)=")


def _scontrol_fields(line: str) -> dict[str, str]:
    """``Key=value`` pairs of one ``scontrol show -o`` line; ``Reason`` runs to the end."""
    line = line.strip()
    reason = ""
    at = line.find(" Reason=")
    if at >= 0:
        reason, line = line[at + len(" Reason=") :], line[:at]
    keys = list(_SCONTROL_KEY.finditer(line))
    out: dict[str, str] = {}
    for i, match in enumerate(keys):
        end = keys[i + 1].start() if i + 1 < len(keys) else len(line)
        out[match.group(1)] = line[match.end() : end].strip()
    if at >= 0:
        out["Reason"] = re.sub(r"\s*\[[^\]]*@[^\]]*\]\s*$", "", reason).strip()
    return out


def parse_scontrol_nodes(text: str) -> tuple[SlurmNode, ...]:
    """The nodes of ``scontrol show node -o`` (one line per node)."""
    nodes = []
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = _scontrol_fields(line)
        if "NodeName" not in fields or "State" not in fields:
            raise SlurmParseError(f"scontrol show node: no NodeName/State in {line[:80]!r}")
        words = fields["State"].upper().split("+")
        base, flags = words[0].rstrip("*~#!%$@^-"), set(words[1:])
        if words[0].endswith("*"):
            flags.add("NOT_RESPONDING")
        nodes.append(
            SlurmNode(fields["NodeName"], base, frozenset(flags), fields.get("Reason", ""))
        )
    return tuple(sorted(nodes, key=lambda n: n.name))


def parse_squeue_text(text: str) -> tuple[SlurmJob, ...]:
    """The jobs of ``squeue -h -o '%i|%T|%N|%r'`` (requeue and batch are not shown:
    taken as true; ``scontrol requeue`` refuses a job that is not)."""
    jobs = []
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = line.split("|")
        if len(parts) != 4:
            raise SlurmParseError(f"squeue: expected 4 '|'-separated fields: {line!r}")
        jobs.append(SlurmJob(parts[0].strip(), parts[1].strip().upper(), expand_hostlist(parts[2])))
    return tuple(jobs)


def expand_hostlist(expr: str) -> tuple[str, ...]:
    """``gpu[01-03,7],login1`` -> ``gpu01 gpu02 gpu03 gpu7 login1`` (zero padding kept)."""
    out: list[str] = []
    for part in _split_top_level(expr.strip()):
        match = _HOSTLIST_PART.fullmatch(part)
        if match is None:
            raise SlurmParseError(f"hostlist: cannot read {part!r}")
        head, ranges, tail = match.groups()
        if ranges is None:
            out.append(part)
            continue
        for item in ranges.split(","):
            lo, _, hi = item.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise SlurmParseError(f"hostlist: bad range {item!r} in {part!r}")
            width = len(lo)
            out.extend(f"{head}{i:0{width}d}{tail}" for i in range(int(lo), int(hi or lo) + 1))
    return tuple(out)


def _split_top_level(expr: str) -> Iterable[str]:
    depth, start = 0, 0
    for i, ch in enumerate(expr):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            if expr[start:i]:
                yield expr[start:i]
            start = i + 1
    if expr[start:]:
        yield expr[start:]
