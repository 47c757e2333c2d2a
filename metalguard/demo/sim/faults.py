"""Hardware faults written into a generated tree the way the kernel or smartctl would show
them (docs/simulation.md).

:func:`apply_fault` makes one change now.  Faults that unfold over time (a correctable-ECC
storm, a node heating up after a fan stops, a flapping RDMA link) also return a
:class:`Process` whose ``step()`` the fleet runner calls on every tick until it reports
done.  ``agent_kill`` is not a file change: the fleet runner stops that node's agent.

Every write is atomic (a temporary file renamed over the attribute), so a collector
reading concurrently sees the old or the new contents, never a torn file.
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from metalguard.agent.kmsg.reader import uptime_us
from metalguard.demo.sim import gpus
from metalguard.demo.sim.tree import (
    LINK_LAYER_ETH,
    PHYS_DISABLED,
    PHYS_LINK_UP,
    PHYS_POLLING,
    STATE_ACTIVE,
    STATE_DOWN,
    TEMP_CRIT_MILLI,
    NodeTree,
    port_name,
)

KNOWN_KINDS: tuple[str, ...] = (
    "ecc_ue",
    "ecc_ce_storm",
    "aer_fatal",
    "pcie_downgrade",
    "smart_fail",
    "fan_stop",
    "agent_kill",
    "rdma_port_down",
    "rdma_link_flap",
    "rdma_symbol_errors",
    "dcqcn_no_cnp",
    *(f"gpu_xid_{c}" for c in ("app", "ignore", "reset", "decode", "reboot", "attention")),
    "gpu_remap_pending",
    "kmsg",
    "iommu_shared",
    "straggler",
)
GPU_XIDS: dict[str, int] = {
    "gpu_xid_app": 13,
    "gpu_xid_ignore": 63,
    "gpu_xid_reset": 119,
    "gpu_xid_decode": 74,
    "gpu_xid_reboot": 79,
    "gpu_xid_attention": 92,
}
"""The XID each GPU fault kind reports: one of each of NVIDIA's classes (graphics engine
exception, row remap recorded, GSP RPC timeout, NVLink error, fallen off the bus,
excessive single-bit ECC interrupts); they need a fleet with simulated NVML."""
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
DEFAULT_FLAPS = 3
"""Link flaps of an ``rdma_link_flap``, one a tick."""
DEFAULT_SYMBOL_ERRORS_PER_TICK = 10
DEFAULT_ECN_MARKS_PER_TICK = 500
DEFAULT_RDMA_S = 60.0
"""How long symbol errors and ECN marks without CNPs go on (like a storm)."""
PMA_MAX = {
    "symbol_error": 0xFFFF,
    "port_rcv_errors": 0xFFFF,
    "link_downed": 0xFF,
    "link_error_recovery": 0xFF,
}
"""The maxima of the PMA counters the faults move (IBA PortCounters widths, kept here
as the simulated kernel's own, not taken from the agent): they stop there, they do not
wrap (hw_counters are 64-bit)."""


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


def add_capped(path: Path, n: int, cap: int | None = None) -> int:
    """Add ``n`` to a counter file, stopping at ``cap`` like a PMA counter; the new value."""
    value = read_int(path) + n
    value = value if cap is None else min(value, cap)
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


def set_port_state(tree: NodeTree, port: str, state: str, phys_state: str) -> None:
    """Write an RDMA port's ``state`` and ``phys_state`` (``4: ACTIVE``, ``5: LinkUp``)."""
    write_atomic(tree.sys_path(f"{port}/state"), state + "\n")
    write_atomic(tree.sys_path(f"{port}/phys_state"), phys_state + "\n")


def add_port_counter(tree: NodeTree, port: str, counter: str, n: int) -> int:
    """Add ``n`` to ``counters/<counter>`` (or ``hw_counters/<counter>``) of ``port``,
    stopped at the counter's PMA width; the new value."""
    path = tree.sys_path(f"{port}/counters/{counter}")
    if not path.exists():
        path = tree.sys_path(f"{port}/hw_counters/{counter}")
    return add_capped(path, n, PMA_MAX.get(counter))


def flap_once(tree: NodeTree, port: str) -> None:
    """One flap, as short as the kernel's: the link drops and retrains between two reads
    of a polling agent, so what it sees is ``link_downed`` and ``link_error_recovery``
    one higher (the state files go DOWN/Polling and back to ACTIVE/LinkUp at once)."""
    add_port_counter(tree, port, "link_error_recovery", 1)
    add_port_counter(tree, port, "link_downed", 1)
    set_port_state(tree, port, STATE_DOWN, PHYS_POLLING)
    set_port_state(tree, port, STATE_ACTIVE, PHYS_LINK_UP)


@dataclass(slots=True)
class PortDown:
    """A downed RDMA port that comes back (ACTIVE, LinkUp) at ``until``."""

    tree: NodeTree
    port: str
    until: float

    def step(self, now: float) -> bool:
        """Bring the port back once ``until`` has come; True then."""
        if now < self.until:
            return False
        set_port_state(self.tree, self.port, STATE_ACTIVE, PHYS_LINK_UP)
        return True


@dataclass(slots=True)
class LinkFlap:
    """An RDMA link flapping: one flap a tick (:func:`flap_once`), ``left`` more."""

    tree: NodeTree
    port: str
    left: int
    flaps: int = 0

    def step(self, now: float) -> bool:
        """Flap once unless done; True after the last flap."""
        if self.left > 0:
            flap_once(self.tree, self.port)
            self.left -= 1
            self.flaps += 1
        return self.left <= 0


@dataclass(slots=True)
class CounterGrowth:
    """Counters of one RDMA port growing every tick (``per_tick`` by counter name) until
    ``until`` (monotonic seconds); PMA counters stop at their width."""

    tree: NodeTree
    port: str
    per_tick: dict[str, int]
    until: float

    def step(self, now: float) -> bool:
        """Add one tick's counts unless the time is over."""
        if now >= self.until:
            return True
        for counter, n in self.per_tick.items():
            add_port_counter(self.tree, self.port, counter, n)
        return False


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


STRAGGLER_FILE = "straggler"
"""A simulated node's hardware slowdown: the factor its training processes compute at
(examples/trainer.py ``--slow-file``; the demo's trainer jobs read it)."""
DEFAULT_SLOWDOWN = 0.3


@dataclass(slots=True)
class Slowdown:
    """A node computing slower until ``until`` (None: to the end), then not."""

    path: Path
    until: float | None

    def step(self, now: float) -> bool:
        """True once it is over (the file removed)."""
        if self.until is None or now < self.until:
            return False
        self.path.unlink(missing_ok=True)
        return True


def _straggler(tree: NodeTree, slowdown: float, until: float | None) -> Applied:
    """The node slows its workload by ``slowdown`` without any error (a NIC at half its
    rate, a GPU in a slowdown the telemetry does not show)."""
    path = tree.root / STRAGGLER_FILE
    write_atomic(path, f"{1.0 + slowdown:g}\n")
    lasts = "" if until is None else f" until t={until:.0f}"
    return Applied("straggler", f"its workload computes {slowdown:.0%} slower{lasts}",
                   Slowdown(path, until))  # fmt: skip


KMSG_FILE = "kmsg"
"""A simulated node's kernel log, in /dev/kmsg's record format (its agent's
``[kmsg] path``)."""
KMSG_LEVEL = 3
"""The records' priority: the kernel's facility 0, level err."""


def _kmsg(tree: NodeTree, line: str, count: int) -> Applied:
    """The node's kernel logs ``line`` ``count`` times (one record each, written whole)."""
    if not line.strip():
        raise FaultError("a kmsg fault needs the line to log")
    path = tree.root / KMSG_FILE
    text = path.read_text() if path.exists() else ""
    rows = [row for row in text.splitlines() if row and not row.startswith(" ")]
    seq = len(rows)
    last_us = int(rows[-1].split(",", 3)[2]) + 1 if rows else 0
    # the clock /dev/kmsg stamps with (10 ms steps in /proc/uptime): never backwards
    ts_us = max(uptime_us() or int(time.monotonic() * 1e6), last_us)
    body = "".join(f"{KMSG_LEVEL},{seq + i + 1},{ts_us + i},-;{line}\n" for i in range(count))
    with path.open("a") as f:
        f.write(body)
    return Applied("kmsg", f"kernel log: {line}" + (f" ({count} times)" if count > 1 else ""))


def _gpu_index(tree: NodeTree, rng: random.Random) -> int:
    """A simulated GPU of the node, chosen with ``rng``."""
    found = gpus.read_state(gpus.state_dir(tree.root))
    if not found:
        raise FaultError("the node has no simulated NVIDIA GPUs (a fleet with nvml=True)")
    return int(rng.choice(found)["index"])


def _gpu_xid(tree: NodeTree, kind: str, rng: random.Random, count: int) -> Applied:
    index = _gpu_index(tree, rng)
    xid = GPU_XIDS[kind]
    for _ in range(count):
        gpus.raise_xid(gpus.state_dir(tree.root), index, xid)
    return Applied(kind, f"XID {xid} on gpu{index}" + (f" ({count} times)" if count > 1 else ""))


def _ecc_ue(tree: NodeTree, rng: random.Random, count: int) -> Applied:
    dimm = _pick(tree.paths.dimms, "DIMM", rng)
    add_to_counter(tree.sys_path(f"{dimm}/dimm_ue_count"), count)
    add_to_counter(tree.sys_path(f"{dimm.rsplit('/', 1)[0]}/ue_count"), count)
    return Applied("ecc_ue", f"{count} uncorrectable ECC error(s) on {dimm}")


def _aer_fatal(tree: NodeTree, rng: random.Random, count: int) -> Applied:
    nic = _pick(tree.paths.nics, "NIC", rng)
    bump_aer(tree.sys_path(f"{nic}/aer_dev_fatal"), AER_FATAL_ERROR, "TOTAL_ERR_FATAL", count)
    return Applied("aer_fatal", f"{count} fatal AER {AER_FATAL_ERROR} on {nic.rsplit('/', 1)[1]}")


def _iommu_shared(tree: NodeTree, rng: random.Random) -> Applied:
    """A NIC falls into a GPU's IOMMU group (as after a firmware update that dropped ACS
    from their root ports): the node's DMA isolation posture becomes ``shared``."""
    if not tree.iommu:
        raise FaultError("iommu_shared needs a tree with an IOMMU (NodeSpec.iommu)")
    gpu = _pick(tree.paths.gpus, "GPU", rng)
    nic = _pick(tree.paths.nics, "NIC", rng)
    nic_dir = tree.sys_path(nic)
    gpu_group = os.path.realpath(tree.sys_path(f"{gpu}/iommu_group"))
    old_group = os.path.realpath(nic_dir / "iommu_group")
    address = nic_dir.name
    os.unlink(os.path.join(old_group, "devices", address))
    member = os.path.join(gpu_group, "devices", address)
    os.symlink(os.path.relpath(nic_dir, os.path.dirname(member)), member)
    os.unlink(nic_dir / "iommu_group")
    os.symlink(os.path.relpath(gpu_group, nic_dir), nic_dir / "iommu_group")
    return Applied(
        "iommu_shared",
        f"{address} now in the IOMMU group of {gpu.rsplit('/', 1)[1]} (ACS lost)",
    )


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


def _rdma_port(tree: NodeTree, rng: random.Random, *, roce: bool = False) -> str:
    """An ACTIVE RDMA port of the tree (a RoCE one when ``roce``), chosen with ``rng``."""
    what = "active RoCE port" if roce else "active RDMA port"
    ports = tuple(
        p
        for p in tree.paths.rdma_ports
        if tree.sys_path(f"{p}/state").read_text().strip() == STATE_ACTIVE
        and (not roce or tree.sys_path(f"{p}/link_layer").read_text().strip() == LINK_LAYER_ETH)
    )
    return _pick(ports, what, rng)


def _rdma_port_down(tree: NodeTree, rng: random.Random, until: float | None) -> Applied:
    port = _rdma_port(tree, rng)
    add_port_counter(tree, port, "link_downed", 1)
    set_port_state(tree, port, STATE_DOWN, PHYS_DISABLED)
    back = "" if until is None else "; back up after its duration"
    process = None if until is None else PortDown(tree, port, until)
    return Applied(
        "rdma_port_down", f"RDMA port {port_name(port)} DOWN (phys Disabled){back}", process
    )


def _rdma_link_flap(tree: NodeTree, rng: random.Random, flaps: int) -> Applied:
    flap = LinkFlap(tree, _rdma_port(tree, rng), flaps)
    flap.step(0.0)
    return Applied(
        "rdma_link_flap", f"RDMA port {port_name(flap.port)} flapping ({flaps} link downs)", flap
    )


def _rdma_growth(
    tree: NodeTree,
    kind: str,
    port: str,
    per_tick: dict[str, int],
    span: tuple[float, float],
    what: str,
) -> Applied:
    now, until = span
    growth = CounterGrowth(tree, port, per_tick, until)
    growth.step(now)
    return Applied(kind, f"{what} on RDMA port {port_name(port)}", growth)


def apply_fault(
    tree: NodeTree,
    kind: str,
    rng: random.Random,
    *,
    count: int | None = None,
    duration_s: float | None = None,
    now: float = 0.0,
    line: str = "",
    slowdown: float | None = None,
) -> Applied:
    """Make one fault happen in ``tree`` now; the device is chosen with ``rng``.

    ``count`` is errors per application (``ecc_ue``, ``aer_fatal``), per tick
    (``ecc_ce_storm``, ``rdma_symbol_errors``, ``dcqcn_no_cnp``) or flaps
    (``rdma_link_flap``); ``duration_s`` is how long a storm (or symbol errors, ECN marks
    without CNPs, a downed port) lasts from ``now``.
    """
    n = 1 if count is None else count
    lasts = (now, now + (DEFAULT_RDMA_S if duration_s is None else duration_s))
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
        case "rdma_port_down":
            return _rdma_port_down(tree, rng, None if duration_s is None else now + duration_s)
        case "rdma_link_flap":
            return _rdma_link_flap(tree, rng, DEFAULT_FLAPS if count is None else count)
        case "rdma_symbol_errors":
            per = DEFAULT_SYMBOL_ERRORS_PER_TICK if count is None else count
            errors = {"symbol_error": per, "port_rcv_errors": max(1, per // 2)}
            return _rdma_growth(
                tree, kind, _rdma_port(tree, rng), errors, lasts, f"{per} symbol errors a tick"
            )
        case "dcqcn_no_cnp":
            per = DEFAULT_ECN_MARKS_PER_TICK if count is None else count
            return _rdma_growth(
                tree,
                kind,
                _rdma_port(tree, rng, roce=True),
                {"np_ecn_marked_roce_packets": per},
                lasts,
                f"{per} ECN-marked packets a tick and no CNP sent",
            )
        case "agent_kill":
            raise FaultError("agent_kill changes no file: the fleet runner stops the agent")
        case _ if kind in GPU_XIDS:
            return _gpu_xid(tree, kind, rng, n)
        case "kmsg":
            return _kmsg(tree, line, n)
        case "iommu_shared":
            return _iommu_shared(tree, rng)
        case "straggler":
            until = None if duration_s is None else now + duration_s
            return _straggler(tree, DEFAULT_SLOWDOWN if slowdown is None else slowdown, until)
        case "gpu_remap_pending":
            index = _gpu_index(tree, rng)
            gpus.change(gpus.state_dir(tree.root), index, remap_pending=1)
            gpus.raise_xid(gpus.state_dir(tree.root), index, GPU_XIDS["gpu_xid_ignore"])
            return Applied(kind, f"gpu{index}: a row remap waits for a GPU reset (XID 63)")
        case _:
            raise FaultError(f"unknown fault kind {kind!r}; known: {', '.join(KNOWN_KINDS)}")
