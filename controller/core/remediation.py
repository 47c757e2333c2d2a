"""What the controller asks of a node's own hardware once the node is out of the way
(docs/decisions.md, "GPU"): pure, from the node records.

- **GPU reset when drained.** A node SUB_HEALTHY because GPUs wait for a reset (a pending
  row remap or page retirement, an XID of NVIDIA's ``reset_gpu``/``decode`` class: the
  findings with signal ``gpu.reset_required``, value the GPU's index) enters MAINTENANCE
  when its last job ends; then its agent is asked to reset those GPUs (``gpu_reset``). It
  returns to service through the lifecycle's clean re-check (``clean_cycles_to_recover``).
- **Reboot.** A node FAILING for a lost GPU (XID 79, rule ``gpu_xid_reboot``) is power
  cycled through its BMC (``bmc_power_cycle``, the bmc-proxy's verb) once no job of it is
  left on it.

Each remedy has a deterministic command id naming the node, the verb and when the node
entered its grade, so it is asked once per episode; a restarted controller asks again
with the same id and the executor answers from its memory.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Final, Literal

from metalguard.controller.core.lifecycle_model import unfinished_jobs
from metalguard.controller.core.rules.gpu import RESET_SIGNAL
from metalguard.proto.base import Reason
from metalguard.proto.nodes import Grade, NodeRecord

RemedyVerb = Literal["gpu_reset", "bmc_power_cycle"]
REBOOT_RULE: Final = "gpu_xid_reboot"
EVENT_KIND: Final[dict[RemedyVerb, str]] = {
    "gpu_reset": "node.gpu_reset",
    "bmc_power_cycle": "node.power_cycled",
}
"""The ControllerEvent kind announcing each remedy's outcome (``.failed`` appended when it
failed)."""


@dataclass(frozen=True, slots=True)
class Remedy:
    """One action to ask of one node."""

    handle: str
    verb: RemedyVerb
    command_id: str
    reasons: tuple[Reason, ...]
    """The findings that call for it."""
    gpus: tuple[int, ...] = ()
    """``gpu_reset``: the GPUs to reset."""


def gpus_to_reset(record: NodeRecord) -> tuple[int, ...]:
    """The GPUs whose findings ask for a reset (``gpu.reset_required``), in order."""
    found = {
        int(r.value)
        for r in record.reasons
        if r.signal == RESET_SIGNAL and isinstance(r.value, int | float) and r.value >= 0
    }
    return tuple(sorted(found))


ALL_VERBS: Final[frozenset[RemedyVerb]] = frozenset({"gpu_reset", "bmc_power_cycle"})


def remedies(
    records: Mapping[str, NodeRecord], verbs: frozenset[RemedyVerb] = ALL_VERBS
) -> Iterator[Remedy]:
    """Every remedy due whose verb is in ``verbs``, in handle order."""
    for _, record in sorted(records.items()):
        remedy = remedy_of(record)
        if remedy is not None and remedy.verb in verbs:
            yield remedy


def remedy_of(record: NodeRecord) -> Remedy | None:
    """The remedy ``record`` calls for now, or None.

    Never for a node an operator holds (maintenance, a repeat offender's hold), nor while
    a job is known to run on it."""
    if record.maintenance or record.held or (unfinished_jobs(record) or 0) > 0:
        return None
    handle = record.node.handle
    if record.grade == "MAINTENANCE" and unfinished_jobs(record) == 0:
        gpus = gpus_to_reset(record)
        if gpus:
            why = tuple(r for r in record.reasons if r.signal == RESET_SIGNAL)
            return Remedy(handle, "gpu_reset", _command_id(record, "gpu_reset"), why, gpus)
    if record.grade == "FAILING":
        why = tuple(r for r in record.reasons if r.rule == REBOOT_RULE)
        if why:
            return Remedy(handle, "bmc_power_cycle", _command_id(record, "bmc_power_cycle"), why)
    return None


def entered_ts(record: NodeRecord, grade: Grade) -> float:
    """When the node last entered ``grade`` (its record's time when its history says not)."""
    for change in reversed(record.history):
        if change.grade_to == grade:
            return change.ts
    return record.updated_ts or 0.0


def _command_id(record: NodeRecord, verb: RemedyVerb) -> str:
    return f"{record.node.handle}.{verb}.{round(entered_ts(record, record.grade) * 1000)}"
