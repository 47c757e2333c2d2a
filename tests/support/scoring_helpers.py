"""Builders for scoring tests: batches at injected times and tiny readings."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from metalguard.controller.core.scoring.config import DEFAULT_SCORING, ScoringConfig
from metalguard.controller.core.scoring.engine import Assessment, NodeSignals, assess
from metalguard.proto.base import NodeIdentity, Reason
from metalguard.proto.telemetry import (
    AerCounters,
    BmcReading,
    BmcSensor,
    EdacController,
    EdacDimm,
    Fan,
    HwmonChip,
    PcieDevice,
    SmartDevice,
    TelemetryBatch,
    Temperature,
)

NODE = NodeIdentity(region="r1", cluster="c1", node="n1")
T0 = 1_800_000_000.0
DIMM_LABEL = "CPU_SrcID#0_Ha#0_Chan#0_DIMM#0"

Step = tuple[float, Mapping[str, Any]]
"""(seconds after T0, TelemetryBatch readings)"""


def batch(offset_s: float = 0.0, seq: int = 1, **readings: Any) -> TelemetryBatch:
    """A batch of node n1 at ``T0 + offset_s``."""
    return TelemetryBatch(node=NODE, seq=seq, ts=T0 + offset_s, **readings)


def run(
    steps: Iterable[Step],
    config: ScoringConfig = DEFAULT_SCORING,
    signals: NodeSignals | None = None,
) -> tuple[NodeSignals, Assessment]:
    """Assess the steps in order; the history and the last assessment."""
    assessment: Assessment | None = None
    for seq, (offset, readings) in enumerate(steps, start=1):
        signals, assessment = assess(signals, batch(offset, seq, **readings), config)
    assert signals is not None
    assert assessment is not None
    return signals, assessment


def by_rule(assessment: Assessment, rule: str) -> list[Reason]:
    """The reasons and notes of ``rule``."""
    return [r for r in (*assessment.reasons, *assessment.notes) if r.rule == rule]


def dimm_mc(ce: int | None = 0, ue: int | None = 0, label: str = DIMM_LABEL) -> EdacController:
    """mc0 with one DIMM."""
    dimm = EdacDimm(name="dimm0", label=label, ce_count=ce, ue_count=ue)
    return EdacController(mc=0, ce_count=ce, ue_count=ue, dimms=(dimm,))


def pci(
    cls: str = "0x020000",
    *,
    width: int = 16,
    max_width: int = 16,
    speed: float = 32.0,
    max_speed: float = 32.0,
    retrains: int = 0,
    cor: Mapping[str, int] | None = None,
    fatal: Mapping[str, int] | None = None,
    nonfatal: Mapping[str, int] | None = None,
) -> PcieDevice:
    """One PCI function at 0000:41:00.0 (a NIC unless ``cls`` says otherwise)."""
    aer = AerCounters(
        correctable=dict(cor or {}), fatal=dict(fatal or {}), nonfatal=dict(nonfatal or {})
    )
    return PcieDevice(
        address="0000:41:00.0",
        pci_class=cls,
        current_link_speed_gts=speed,
        max_link_speed_gts=max_speed,
        current_link_width=width,
        max_link_width=max_width,
        downgraded=width < max_width or speed < max_speed,
        retrains=retrains,
        aer=aer,
    )


def disk(**fields: Any) -> SmartDevice:
    """One disk /dev/nvme0, healthy unless ``fields`` say otherwise."""
    defaults: dict[str, Any] = {"device": "/dev/nvme0", "model": "M", "serial": "S1"}
    return SmartDevice(**{**defaults, **fields})


def fans(*rpms: float | None, min_rpm: float | None = None, alarm: bool | None = None) -> Any:
    """One hwmon chip with a fan per rpm; ``min_rpm`` and ``alarm`` apply to the first."""
    chip = HwmonChip(
        chip="nct6779",
        fans=tuple(
            Fan(
                sensor=f"fan{i + 1}",
                rpm=rpm,
                min_rpm=min_rpm if i == 0 else None,
                alarm=alarm if i == 0 else None,
            )
            for i, rpm in enumerate(rpms)
        ),
    )
    return (chip,)


def temp(celsius: float, crit: float | None = None, high: float | None = None) -> Any:
    """One hwmon chip with one temperature sensor."""
    sensor = Temperature(
        sensor="temp1", label="Package id 0", celsius=celsius, crit_celsius=crit, max_celsius=high
    )
    return (HwmonChip(chip="coretemp", temps=(sensor,)),)


def bmc(
    health: str = "OK", sensor_status: str = "ok", reachable: bool = True
) -> tuple[BmcReading, ...]:
    """One redfish BMC reading with one fan sensor."""
    sensor = BmcSensor(
        name="FAN1", kind="fan", value=300.0, unit="RPM", status=sensor_status, lower_critical=500
    )
    return (BmcReading(source="redfish", reachable=reachable, health=health, sensors=(sensor,)),)
