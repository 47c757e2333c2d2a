"""Synthesized telemetry: what metalguard's agent would send for one part as it degrades
(the precursor) and as it fails (the fault), per :data:`~metalguard.twin.model.Signal`.

Pure: no clock, no randomness. Every reading is a fixed physical value written here,
never derived from the scoring config, so the REAL rules (``controller.core.rules``)
decide what it is worth: change a threshold there and the twin's outcome changes.
Batches are minimal (only the sections the part's collector fills) so that thousands
score fast; equal readings are the same objects (cached), as ingest's decoder hands an
unchanged section back, so the scorer's memo reuses its work.

``generation`` counts repairs: a replaced GPU has a new UUID and a replaced disk a new
serial (the scorer keys their counters by them, so a new part starts a new history);
other counters restart from 0 after the repair's reboot (a reset, which costs nothing).

The readings:

============  =====================================================  =====================
signal        precursor (``PRECURSOR_STEPS`` batches, growing)        fault
============  =====================================================  =====================
``ecc``       GPU memory (HBM, SRAM) corrected ECC +500 per batch,    event gpu_ecc_dbe
              XID 92 (contact_support: counted) once per batch
``gpu``       XID 119 (GSP RPC timeout, NVIDIA's ``reset_gpu``        event gpu_xid 79
              class: "GPU reset when drained")                        (``reboot``: critical)
``pcie``      NIC link x16 -> x8, +3 link retrains per batch          event aer_fatal
``smart``     NVMe media errors +4 per batch, critical warning        event smart_failed
              0x04 (reliability degraded), spare 15 %
``thermal``   one of 4 fans stopped, CPU at 97 of 100 °C critical    batch: 101 °C
``network``   RDMA port: +1 link_downed, +2 link_error_recovery,      batch: the cabled
              +200 symbol errors per batch                           port DOWN, Disabled
``""``        none (``None``)                                        none: the node falls
                                                                     silent
============  =====================================================  =====================

The default scoring (docs/scoring.md) grades the precursors: ``ecc`` 60 (rate 30 + XID 92
10), ``gpu`` 70 (GPU reset needed 30), ``pcie`` 65 (downgrade 30 + retrains 5): SUB_HEALTHY;
``smart`` 30 (critical warning 30 + media-error growth 30 + spare 10), ``thermal`` 40
(fan 30 + near critical 30), ``network`` 40 (flaps 30 + physical errors 30): FAILING
(tests/unit/test_twin_health.py holds these and a changed rule's other outcome).

``ecc`` is the GPU's memory: in the default failure model (data/llama3.toml) it is the
signal of HBM3 (72 faults), GPU SRAM (19) and system memory (2); a host DIMM's EDAC
storm of the same size is graded the same by the default rules (``ecc_correctable_rate``
severe, 30 points: the GPU's and the DIMM's rules charge the same). XIDs come as the
agent sends them: a ``gpu_xid`` event at once (severity from NVIDIA's catalog,
``proto.xid``; only the ``reboot`` class is critical and acted on at once) and in the
GPU's ``xid_errors`` in every batch after it, which the rules grade.
"""

from __future__ import annotations

import functools
from typing import Any

from metalguard.proto.base import AttrValue, NodeIdentity
from metalguard.proto.events import NodeEvent
from metalguard.proto.telemetry import (
    Fan,
    GpuDevice,
    HwmonChip,
    PcieDevice,
    RdmaPort,
    SmartDevice,
    TelemetryBatch,
    Temperature,
)
from metalguard.proto.topology import NodeTopology
from metalguard.proto.xid import classify
from metalguard.twin.model import Signal

AGENT_BATCH_INTERVAL_S = 5.0
"""The agent's batch interval: ``collect.interval_s``'s default (agent/config.py
``CollectSection``, docs/agent.md)."""
PRECURSOR_STEPS = 2
"""Precursor batches sent, one interval apart: the part keeps degrading over more than
one collection cycle (the lifecycle's second sub-healthy batch is a step of its own)."""
SIGNALS: tuple[Signal, ...] = ("ecc", "gpu", "pcie", "smart", "thermal", "network")
"""The signals with telemetry ("" has none)."""

Sections = dict[str, Any]
"""TelemetryBatch keyword arguments: the sections one batch carries."""

# --- ecc and gpu: the accelerator and its memory (NVML) -------------------------------
GPU_PCI_ADDRESS = "0000:18:00.0"
GPU_SBE_STORM_PER_STEP = 500
"""Corrected (single-bit) ECC errors on the GPU per precursor batch (the default rule's
severe rate is 100 per hour)."""
ECC_PRECURSOR_XID = 92
"""Excessive single-bit ECC interrupts (``contact_support``: a warning, counted)."""
GPU_PRECURSOR_XID = 119
"""GSP RPC timeout (``reset_gpu``: the node is drained, then its GPU reset)."""
GPU_FAULT_XID = 79
"""GPU fallen off the bus (``reboot``: critical, acted on at once)."""

# --- pcie: the NIC's link -------------------------------------------------------------
NIC_ADDRESS = "0000:41:00.0"
NIC_CLASS = "0x020700"
"""An InfiniBand controller (PCI class 0x0207): an accelerator-or-NIC class."""
NIC_WIDTH = 16
NIC_DEGRADED_WIDTH = 8
NIC_SPEED_GTS = 32.0
RETRAINS_PER_STEP = 3

# --- smart: the NVMe disk -------------------------------------------------------------
DISK = "/dev/nvme0"
DISK_MODEL = "TWIN-NVME"
MEDIA_ERRORS_PER_STEP = 4
DEGRADED_CRITICAL_WARNING = 0x04
"""NVMe critical-warning bit 2: reliability degraded."""
DEGRADED_SPARE_PERCENT = 15
HEALTHY_SPARE_PERCENT = 100
WEAR_PERCENT = 5

# --- thermal: fans and temperatures (hwmon) -------------------------------------------
FAN_RPM = 9000.0
FANS = 4
CPU_CELSIUS = 55.0
CPU_MAX_CELSIUS = 90.0
CPU_CRIT_CELSIUS = 100.0
PRECURSOR_CELSIUS = 97.0
FAULT_CELSIUS = 101.0

# --- network: the RDMA port -----------------------------------------------------------
RDMA_DEVICE = "mlx5_0"
RDMA_PORT = 1
RDMA_RATE_GBPS = 400.0
FLAP_DOWNED_PER_STEP = 1
FLAP_RECOVERY_PER_STEP = 2
SYMBOL_ERRORS_PER_STEP = 200
RDMA_TOPOLOGY = NodeTopology(rdma_ports=(f"{RDMA_DEVICE}/{RDMA_PORT}",))
"""The node's resolved topology lists the port as cabled (the region controller hands
the scorer the resolved topology in ``batch.topology``)."""


def telemetry(node: NodeIdentity, seq: int, ts: float, sections: Sections) -> TelemetryBatch:
    """One batch of ``node`` carrying ``sections``, at the agent's interval."""
    return TelemetryBatch(node=node, seq=seq, ts=ts, interval_s=AGENT_BATCH_INTERVAL_S, **sections)


def baseline(
    signal: Signal, node: NodeIdentity, *, seq: int, ts: float, generation: int = 0
) -> TelemetryBatch:
    """The node's healthy batch for ``signal``'s part (empty for "")."""
    return telemetry(node, seq, ts, clean_sections(signal, generation))


def precursor(
    signal: Signal,
    node: NodeIdentity,
    *,
    seq: int,
    ts: float,
    step: int = 1,
    generation: int = 0,
) -> TelemetryBatch | None:
    """The ``step``-th batch (1-based) of the part degrading; None for ""."""
    sections = precursor_sections(signal, step, generation)
    return None if sections is None else telemetry(node, seq, ts, sections)


def precursor_events(
    signal: Signal, node: NodeIdentity, *, ts: float, event_id: str, step: int = 1
) -> tuple[NodeEvent, ...]:
    """Events the agent publishes at once during the precursor (a warning XID)."""
    if step != 1 or signal not in ("ecc", "gpu"):
        return ()
    xid = ECC_PRECURSOR_XID if signal == "ecc" else GPU_PRECURSOR_XID
    return (_gpu_xid(node, ts, event_id, xid),)


def fault_report(
    signal: Signal,
    node: NodeIdentity,
    *,
    seq: int,
    ts: float,
    event_id: str,
    step: int = 0,
    generation: int = 0,
) -> TelemetryBatch | NodeEvent | None:
    """How the agent reports the part's failure: a fatal NodeEvent (``decide.event_input``
    makes it a fatal assessment), or a batch the scorer grades fatal (a critical
    temperature, a cabled RDMA port down); None for "" (the node just falls silent).
    ``step``: the precursor batches sent before it (their counters stay)."""
    if signal == "ecc":
        attrs: dict[str, AttrValue] = {"index": 0, "new": 1, "ecc_dbe_volatile": 1}
        return _event(node, ts, event_id, "gpu_ecc_dbe", "gpu", "gpu0", attrs)
    if signal == "gpu":
        return _gpu_xid(node, ts, event_id, GPU_FAULT_XID)
    if signal == "pcie":
        attrs = {"new_TOTAL_ERR_FATAL": 1}
        return _event(node, ts, event_id, "aer_fatal", "pcie", NIC_ADDRESS, attrs)
    if signal == "smart":
        return _event(node, ts, event_id, "smart_failed", "smart", DISK, {})
    if signal in ("thermal", "network"):
        return telemetry(node, seq, ts, _fault_sections(signal, step, generation))
    return None


# --- sections (cached: equal readings are the same objects) ----------------------------


@functools.lru_cache(maxsize=256)
def clean_sections(signal: Signal, generation: int = 0) -> Sections:
    """The healthy readings of ``signal``'s part (``{}`` for "")."""
    if signal in ("ecc", "gpu"):
        return {"gpu": (_gpu(generation, 0),)}
    if signal == "pcie":
        return {"pcie": (_nic(NIC_WIDTH, 0),)}
    if signal == "smart":
        return {"smart": (_disk(generation, 0, 0, HEALTHY_SPARE_PERCENT),)}
    if signal == "thermal":
        return {"hwmon": _hwmon(stopped=False, celsius=CPU_CELSIUS)}
    if signal == "network":
        return {"rdma": (_rdma(0, "ACTIVE", "LinkUp"),), "topology": RDMA_TOPOLOGY}
    return {}


@functools.lru_cache(maxsize=1024)
def precursor_sections(signal: Signal, step: int = 1, generation: int = 0) -> Sections | None:
    """The readings of the ``step``-th precursor batch; None for "" (no precursor)."""
    if step < 1:
        raise ValueError(f"step must be >= 1, got {step}")
    if signal == "ecc":
        xids = (ECC_PRECURSOR_XID,) * step
        return {"gpu": (_gpu(generation, GPU_SBE_STORM_PER_STEP * step, xids=xids),)}
    if signal == "gpu":
        return {"gpu": (_gpu(generation, 0, xids=(GPU_PRECURSOR_XID,)),)}
    if signal == "pcie":
        return {"pcie": (_nic(NIC_DEGRADED_WIDTH, RETRAINS_PER_STEP * step),)}
    if signal == "smart":
        disk = _disk(
            generation,
            MEDIA_ERRORS_PER_STEP * step,
            DEGRADED_CRITICAL_WARNING,
            DEGRADED_SPARE_PERCENT,
        )
        return {"smart": (disk,)}
    if signal == "thermal":
        return {"hwmon": _hwmon(stopped=True, celsius=PRECURSOR_CELSIUS)}
    if signal == "network":
        return {"rdma": (_rdma(step, "ACTIVE", "LinkUp"),), "topology": RDMA_TOPOLOGY}
    return None


@functools.lru_cache(maxsize=256)
def _fault_sections(signal: Signal, step: int, generation: int) -> Sections:
    if signal == "thermal":
        return {"hwmon": _hwmon(stopped=True, celsius=FAULT_CELSIUS)}
    if signal == "network":
        return {"rdma": (_rdma(step, "DOWN", "Disabled"),), "topology": RDMA_TOPOLOGY}
    raise ValueError(f"signal {signal!r} reports its fault as an event")


def _gpu(generation: int, sbe: int, *, xids: tuple[int, ...] = ()) -> GpuDevice:
    return GpuDevice(
        index=0,
        uuid=f"GPU-twin-{generation}",
        pci_address=GPU_PCI_ADDRESS,
        ecc_sbe_volatile=sbe,
        ecc_dbe_volatile=0,
        retired_pages_pending=False,
        row_remap_pending=False,
        row_remap_failure=False,
        xid_errors=xids,
    )


def _nic(width: int, retrains: int) -> PcieDevice:
    return PcieDevice(
        address=NIC_ADDRESS,
        pci_class=NIC_CLASS,
        current_link_speed_gts=NIC_SPEED_GTS,
        max_link_speed_gts=NIC_SPEED_GTS,
        current_link_width=width,
        max_link_width=NIC_WIDTH,
        downgraded=width < NIC_WIDTH,
        retrains=retrains,
    )


def _disk(generation: int, media_errors: int, critical_warning: int, spare: int) -> SmartDevice:
    return SmartDevice(
        device=DISK,
        protocol="NVMe",
        model=DISK_MODEL,
        serial=f"TWIN{generation}",
        passed=True,
        critical_warning=critical_warning,
        media_errors=media_errors,
        percentage_used=WEAR_PERCENT,
        available_spare=spare,
    )


def _hwmon(*, stopped: bool, celsius: float) -> tuple[HwmonChip, ...]:
    fans = tuple(
        Fan(sensor=f"fan{i + 1}", rpm=0.0 if stopped and i == 0 else FAN_RPM) for i in range(FANS)
    )
    cpu = Temperature(
        sensor="temp1",
        label="Package id 0",
        celsius=celsius,
        crit_celsius=CPU_CRIT_CELSIUS,
        max_celsius=CPU_MAX_CELSIUS,
    )
    return (HwmonChip(chip="nct6779", fans=fans, temps=(cpu,)),)


def _rdma(step: int, state: str, phys_state: str) -> RdmaPort:
    counters = {
        "link_downed": FLAP_DOWNED_PER_STEP * step,
        "link_error_recovery": FLAP_RECOVERY_PER_STEP * step,
        "symbol_error": SYMBOL_ERRORS_PER_STEP * step,
        "port_rcv_errors": 0,
    }
    return RdmaPort(
        device=RDMA_DEVICE,
        port=RDMA_PORT,
        state=state,
        phys_state=phys_state,
        rate_gbps=RDMA_RATE_GBPS,
        link_layer="InfiniBand",
        counters=counters,
    )


def _event(
    node: NodeIdentity,
    ts: float,
    event_id: str,
    kind: str,
    source: str,
    device: str,
    attributes: dict[str, AttrValue],
    severity: str = "critical",
    message: str = "",
) -> NodeEvent:
    return NodeEvent(
        node=node,
        event_id=event_id,
        ts=ts,
        kind=kind,
        source=source,
        device=device,
        severity=severity,
        message=message,
        attributes=attributes,
    )


def _gpu_xid(node: NodeIdentity, ts: float, event_id: str, xid: int) -> NodeEvent:
    """A ``gpu_xid`` event as the agent's XidWatcher publishes it: graded by NVIDIA's
    catalog (``proto.xid``, which the agent's watcher uses too)."""
    entry = classify(xid)
    attrs: dict[str, AttrValue] = {
        "xid": xid,
        "name": entry.name,
        "action": entry.action,
        "class": entry.xid_class,
        "known": entry.listed,
        "index": 0,
    }
    message = f"XID {xid} on gpu0: {entry.name} ({entry.action})"
    return _event(node, ts, event_id, "gpu_xid", "gpu", "gpu0", attrs, entry.severity, message)
