"""Hardware faults written into a generated tree the way the kernel or smartctl would show
them (docs/simulation.md).

:func:`apply_fault` makes one change now.  Faults that unfold over time (a correctable-ECC
storm, a node heating up after a fan stops) also return a :class:`Process` whose
``step()`` the fleet runner calls on every tick until it reports done.  ``agent_kill`` is
not a file change: the fleet runner stops that node's agent.

Every write is atomic (a temporary file renamed over the attribute), so a collector
reading concurrently sees the old or the new contents, never a torn file.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from metalguard.demo.sim.tree import TEMP_CRIT_MILLI, NodeTree

KNOWN_KINDS: tuple[str, ...] = (
    "ecc_ue",
    "ecc_ce_storm",
    "aer_fatal",
    "pcie_downgrade",
    "smart_fail",
    "fan_stop",
    "agent_kill",
)
RUNNER_KINDS = frozenset({"agent_kill"})
"""Kinds the fleet runner handles itself (no file changes)."""

DEFAULT_STORM_PER_TICK = 20
"""Correctable errors a storm adds to its DIMM per tick: at one tick a second, far above
the scoring's severe threshold of 100/h within the first few seconds."""
DEFAULT_STORM_S = 60.0
HEAT_STEP_MILLI = 4000
"""How much every temperature rises per tick after a fan stops."""
HEAT_OVERSHOOT_MILLI = 2000
"""Temperatures stop rising this far above critical (the node would shut down)."""
AER_FATAL_ERROR = "MalfTLP"
DOWNGRADED_WIDTH = 8
SMART_FAIL_CRITICAL_WARNING = 4
"""NVMe critical-warning bit 2: reliability degraded."""
SMART_FAIL_EXIT_STATUS = 8
"""smartctl exit-status bit 3: SMART status says the disk is failing."""


class FaultError(ValueError):
    """A fault cannot be applied (unknown kind, or the tree lacks the device)."""


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path``'s contents in one rename (the temp name matches no collector glob)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def read_int(path: Path) -> int:
    """A counter or sensor file's integer value."""
    return int(path.read_text().strip() or 0)


def add_to_counter(path: Path, n: int) -> int:
    """Add ``n`` to a counter file; return the new value."""
    value = read_int(path) + n
    write_atomic(path, f"{value}\n")
    return value


def bump_aer(path: Path, name: str, total: str, n: int) -> None:
    """Add ``n`` to error ``name`` and to the ``total`` line of an ``aer_dev_*`` file."""
    lines = []
    for line in path.read_text().splitlines():
        key, _, count = line.rpartition(" ")
        if key in (name, total):
            line = f"{key} {int(count) + n}"
        lines.append(line)
    write_atomic(path, "\n".join(lines) + "\n")


class Process(Protocol):
    """A fault that unfolds over ticks."""

    def step(self, now: float) -> bool:
        """Advance one tick at monotonic time ``now``; True when the process is over."""
        ...


@dataclass(slots=True)
class CeStorm:
    """Correctable ECC errors piling up on one DIMM: ``per_tick`` more every tick until
    ``until`` (monotonic seconds)."""

    tree: NodeTree
    dimm: str
    per_tick: int
    until: float
    added: int = 0

    def step(self, now: float) -> bool:
        """Add one tick's errors unless the storm is over."""
        if now >= self.until:
            return True
        add_ce(self.tree, self.dimm, self.per_tick)
        self.added += self.per_tick
        return False


@dataclass(slots=True)
class Heat:
    """A stopped fan's node heating up: every temperature rises by ``step_milli`` a tick
    until it passes its critical limit by :data:`HEAT_OVERSHOOT_MILLI`."""

    tree: NodeTree
    step_milli: int = HEAT_STEP_MILLI
    ceiling_milli: int = TEMP_CRIT_MILLI + HEAT_OVERSHOOT_MILLI

    def step(self, now: float) -> bool:
        """Raise every temperature one step; True once all are at the ceiling."""
        hot = True
        for rel in self.tree.paths.temps:
            path = self.tree.sys_path(rel)
            value = min(read_int(path) + self.step_milli, self.ceiling_milli)
            write_atomic(path, f"{value}\n")
            hot = hot and value >= self.ceiling_milli
        return hot


@dataclass(frozen=True, slots=True)
class Applied:
    """What one fault application changed, and the process to keep ticking (if any)."""

    kind: str
    detail: str
    process: Process | None = None


def add_ce(tree: NodeTree, dimm: str, n: int) -> None:
    """``n`` correctable errors on one DIMM: its counter and its controller's."""
    add_to_counter(tree.sys_path(f"{dimm}/dimm_ce_count"), n)
    add_to_counter(tree.sys_path(f"{dimm.rsplit('/', 1)[0]}/ce_count"), n)


def _pick(items: tuple[str, ...], what: str, rng: random.Random) -> str:
    if not items:
        raise FaultError(f"the tree has no {what}")
    return rng.choice(items)


def _ecc_ue(tree: NodeTree, rng: random.Random, count: int) -> Applied:
    dimm = _pick(tree.paths.dimms, "DIMM", rng)
    add_to_counter(tree.sys_path(f"{dimm}/dimm_ue_count"), count)
    add_to_counter(tree.sys_path(f"{dimm.rsplit('/', 1)[0]}/ue_count"), count)
    return Applied("ecc_ue", f"{count} uncorrectable ECC error(s) on {dimm}")


def _aer_fatal(tree: NodeTree, rng: random.Random, count: int) -> Applied:
    nic = _pick(tree.paths.nics, "NIC", rng)
    bump_aer(tree.sys_path(f"{nic}/aer_dev_fatal"), AER_FATAL_ERROR, "TOTAL_ERR_FATAL", count)
    return Applied("aer_fatal", f"{count} fatal AER {AER_FATAL_ERROR} on {nic.rsplit('/', 1)[1]}")


def _pcie_downgrade(tree: NodeTree, rng: random.Random) -> Applied:
    gpu = _pick(tree.paths.gpus, "GPU", rng)
    write_atomic(tree.sys_path(f"{gpu}/current_link_width"), f"{DOWNGRADED_WIDTH}\n")
    return Applied("pcie_downgrade", f"{gpu.rsplit('/', 1)[1]} link trained down to x8")


def _smart_fail(tree: NodeTree, rng: random.Random) -> Applied:
    rel = _pick(tree.paths.disks, "disk", rng)
    path = tree.root / rel
    doc: dict[str, Any] = json.loads(path.read_text())
    doc["smart_status"]["passed"] = False
    doc["smart_status"]["nvme"]["value"] = SMART_FAIL_CRITICAL_WARNING
    doc["nvme_smart_health_information_log"]["critical_warning"] = SMART_FAIL_CRITICAL_WARNING
    doc["smartctl"]["exit_status"] = SMART_FAIL_EXIT_STATUS
    write_atomic(path, json.dumps(doc, indent=2) + "\n")
    return Applied("smart_fail", f"{doc['device']['name']} SMART overall-health FAILED")


def _fan_stop(tree: NodeTree, rng: random.Random) -> Applied:
    fan = _pick(tree.paths.fans, "fan", rng)
    write_atomic(tree.sys_path(fan), "0\n")
    write_atomic(tree.sys_path(fan.replace("_input", "_alarm")), "1\n")
    return Applied("fan_stop", f"{fan.rsplit('/', 1)[1]} stopped; heating up", Heat(tree))


def apply_fault(
    tree: NodeTree,
    kind: str,
    rng: random.Random,
    *,
    count: int | None = None,
    duration_s: float | None = None,
    now: float = 0.0,
) -> Applied:
    """Make one fault happen in ``tree`` now; the device is chosen with ``rng``.

    ``count`` is errors per application (``ecc_ue``, ``aer_fatal``) or per tick
    (``ecc_ce_storm``); ``duration_s`` is how long a storm lasts from ``now``.
    """
    n = 1 if count is None else count
    match kind:
        case "ecc_ue":
            return _ecc_ue(tree, rng, n)
        case "ecc_ce_storm":
            dimm = _pick(tree.paths.dimms, "DIMM", rng)
            storm = CeStorm(
                tree,
                dimm,
                DEFAULT_STORM_PER_TICK if count is None else count,
                now + (DEFAULT_STORM_S if duration_s is None else duration_s),
            )
            storm.step(now)
            return Applied(kind, f"correctable ECC storm on {dimm}", storm)
        case "aer_fatal":
            return _aer_fatal(tree, rng, n)
        case "pcie_downgrade":
            return _pcie_downgrade(tree, rng)
        case "smart_fail":
            return _smart_fail(tree, rng)
        case "fan_stop":
            return _fan_stop(tree, rng)
        case "agent_kill":
            raise FaultError("agent_kill changes no file: the fleet runner stops the agent")
        case _:
            raise FaultError(f"unknown fault kind {kind!r}; known: {', '.join(KNOWN_KINDS)}")
