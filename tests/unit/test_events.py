"""Immediate NodeEvents: counters on growth, states on becoming true."""

from __future__ import annotations

from typing import Any

from metalguard.agent.events import detect_events
from metalguard.proto.base import NodeIdentity
from metalguard.proto.telemetry import (
    AerCounters,
    EdacController,
    EdacDimm,
    PcieDevice,
    SmartDevice,
    TelemetryBatch,
)

NODE = NodeIdentity(region="r1", cluster="c1", node="n1")


def batch(seq: int, **readings: Any) -> TelemetryBatch:
    return TelemetryBatch(node=NODE, seq=seq, ts=1000.0 + seq, **readings)


def mc(ue: int, dimm_ue: int = 0) -> EdacController:
    dimm = EdacDimm(name="dimm0", label="CPU_SrcID#0_Ha#0_Chan#0_DIMM#0", ue_count=dimm_ue)
    return EdacController(mc=0, ce_count=3, ue_count=ue, dimms=(dimm,))


def nic(fatal: int = 0, nonfatal: int = 0, width: int = 16) -> PcieDevice:
    return PcieDevice(
        address="0000:41:00.0",
        pci_class="0x020000",
        current_link_speed_gts=16.0,
        max_link_speed_gts=16.0,
        current_link_width=width,
        max_link_width=16,
        downgraded=width < 16,
        aer=AerCounters(
            correctable={"RxErr": 5, "TOTAL_ERR_COR": 5},
            fatal={"DLP": fatal, "TOTAL_ERR_FATAL": fatal},
            nonfatal={"CmpltTO": nonfatal, "TOTAL_ERR_NONFATAL": nonfatal},
        ),
    )


def test_first_batch_is_a_baseline_for_counters() -> None:
    assert detect_events(None, batch(1, edac=(mc(ue=4, dimm_ue=4),), pcie=(nic(fatal=2),))) == []


def test_new_uncorrectable_ecc_names_the_dimm() -> None:
    events = detect_events(batch(1, edac=(mc(0),)), batch(2, edac=(mc(1, dimm_ue=1),)))
    assert [(e.kind, e.device) for e in events] == [
        ("ecc_uncorrectable", "CPU_SrcID#0_Ha#0_Chan#0_DIMM#0")
    ]
    assert events[0].attributes["new"] == 1
    assert events[0].node == NODE


def test_controller_level_ue_without_dimm_detail() -> None:
    events = detect_events(batch(1, edac=(mc(2),)), batch(2, edac=(mc(5),)))
    assert [(e.kind, e.device, e.attributes["new"]) for e in events] == [
        ("ecc_uncorrectable", "mc0", 3)
    ]


def test_counter_reset_is_not_an_event() -> None:
    assert detect_events(batch(1, edac=(mc(5, 5),)), batch(2, edac=(mc(0, 0),))) == []


def test_new_fatal_and_nonfatal_aer() -> None:
    events = detect_events(batch(1, pcie=(nic(),)), batch(2, pcie=(nic(fatal=1, nonfatal=2),)))
    assert sorted(e.kind for e in events) == ["aer_fatal", "aer_nonfatal"]
    fatal = next(e for e in events if e.kind == "aer_fatal")
    assert "DLP" in fatal.message
    assert fatal.attributes == {"new_DLP": 1, "new_TOTAL_ERR_FATAL": 1}


def test_link_downgrade_once_then_quiet_until_recovered() -> None:
    down = batch(2, pcie=(nic(width=8),))
    first = detect_events(batch(1, pcie=(nic(),)), down)
    assert [e.kind for e in first] == ["link_downgrade"]
    assert detect_events(down, batch(3, pcie=(nic(width=8),))) == []
    assert detect_events(None, batch(1, pcie=(nic(width=4),)))[0].kind == "link_downgrade"


def test_smart_turning_failed() -> None:
    ok = SmartDevice(device="/dev/nvme0", model="X", passed=True)
    bad = SmartDevice(device="/dev/nvme0", model="X", passed=False, critical_warning=16)
    assert [e.kind for e in detect_events(batch(1, smart=(ok,)), batch(2, smart=(bad,)))] == [
        "smart_failed"
    ]
    assert detect_events(batch(2, smart=(bad,)), batch(3, smart=(bad,))) == []


def test_event_ids_unique_and_injectable() -> None:
    prev, cur = batch(1, pcie=(nic(),)), batch(2, pcie=(nic(fatal=1, nonfatal=1, width=8),))
    default_ids = [e.event_id for e in detect_events(prev, cur)]
    assert len(set(default_ids)) == len(default_ids) == 3
    counter = iter(range(100))
    ids = [e.event_id for e in detect_events(prev, cur, new_id=lambda: f"x{next(counter)}")]
    assert ids == ["x0", "x1", "x2"]


def test_a_dma_isolation_posture_change_is_one_warning_event() -> None:
    from metalguard.proto.iommu import IommuPosture

    isolated = IommuPosture(posture="isolated", mode="dma-fq")
    shared = IommuPosture(
        posture="shared",
        mode="dma-fq",
        reasons=("NIC 0000:03:00.0: ACS redirect off on switch port 0000:02:00.0 above it (RR-)",),
    )
    assert detect_events(None, batch(1, iommu=isolated)) == []  # the batch carries it
    assert detect_events(batch(1, iommu=isolated), batch(2, iommu=isolated)) == []
    (event,) = detect_events(batch(2, iommu=isolated), batch(3, iommu=shared))
    assert (event.kind, event.source, event.severity) == ("iommu_posture", "iommu", "warning")
    assert event.attributes == {"from": "isolated", "to": "shared", "mode": "dma-fq"}
    assert "ACS redirect off on switch port 0000:02:00.0" in event.message
    back = detect_events(batch(3, iommu=shared), batch(4, iommu=isolated))
    assert [e.attributes["to"] for e in back] == ["isolated"]
