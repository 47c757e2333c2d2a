"""What each of NVIDIA's XID classes does to a node's grade (docs/decisions.md, "GPU"):
the XID reported on a GPU (``GpuDevice.xid_errors``, the agent's ledger) through the
scorer, and the ``gpu_xid`` event through ``decide.is_fatal_event``. Also: a GPU's
correctable-error storm costs the same as a DIMM's."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metalguard.agent.collectors.gpu_parse import xid_event
from metalguard.controller.core.decide import is_fatal_event
from metalguard.controller.core.rules.gpu import RESET_SIGNAL
from metalguard.proto.telemetry import GpuDevice
from tests.support.scoring_helpers import NODE, by_rule, dimm_mc, run

GRADES: list[tuple[str, tuple[int, ...], str, float, bool]] = [
    # class, XIDs on GPU 0, grade, score, isolated at once by the event
    ("app", (13,), "HEALTHY", 100.0, False),
    ("app, many", (13, 31, 43, 45, 94), "HEALTHY", 100.0, False),
    ("ignore", (63,), "HEALTHY", 100.0, False),
    ("reset_gpu", (48,), "SUB_HEALTHY", 70.0, False),
    ("reset_gpu, two on one GPU", (119, 120), "SUB_HEALTHY", 70.0, False),
    ("decode (NVLink)", (74,), "SUB_HEALTHY", 70.0, False),
    ("reboot", (79,), "FAILING", 0.0, True),
    ("contact_support (92)", (92,), "HEALTHY", 90.0, False),
    ("contact_support (unlisted)", (4242,), "HEALTHY", 90.0, False),
]


def _gpu(**fields: Any) -> GpuDevice:
    return GpuDevice(index=0, uuid="GPU-0", pci_address="0000:41:00.0", **fields)


@pytest.mark.parametrize(
    ("what", "xids", "grade", "score", "isolated"), GRADES, ids=[g[0] for g in GRADES]
)
def test_the_grade_of_each_xid_class(
    what: str, xids: tuple[int, ...], grade: str, score: float, isolated: bool
) -> None:
    _, assessment = run([(0.0, {"gpu": (_gpu(xid_errors=xids),)})])
    assert (assessment.grade, assessment.score) == (grade, score), assessment.reasons
    events = [xid_event(x, node=NODE, ts=0.0, event_id=f"e{x}", gpu_index=0) for x in set(xids)]
    assert any(is_fatal_event(e) for e in events) is isolated


def test_xid_92_reaches_the_score_and_counts_its_reports() -> None:
    _, assessment = run([(0.0, {"gpu": (_gpu(xid_errors=(92, 13, 92, 92)),)})])
    (reason,) = by_rule(assessment, "gpu_xid_attention")
    assert reason.value == 3
    assert "XID 92 (excessive single-bit ECC error interrupts)" in reason.message
    assert assessment.score < 100


def test_xid_63_isolates_nothing_and_costs_nothing() -> None:
    _, assessment = run([(0.0, {"gpu": (_gpu(xid_errors=(63,)),)})])
    assert assessment.score == 100
    assert not assessment.fatal
    event = xid_event(63, node=NODE, ts=0.0, event_id="e", gpu_index=0)
    assert event.severity == "info"
    assert not is_fatal_event(event)


def test_a_reset_finding_names_its_gpu_and_the_action() -> None:
    gpus = (
        _gpu(),
        GpuDevice(index=3, row_remap_pending=True),
        GpuDevice(index=5, xid_errors=(48,)),
    )
    _, assessment = run([(0.0, {"gpu": gpus})])
    resets = [r for r in assessment.reasons if r.signal == RESET_SIGNAL]
    assert sorted((r.value, r.rule) for r in resets) == [
        (3, "gpu_reset_pending"),
        (5, "gpu_reset_pending"),
    ]
    assert all(r.message.endswith("GPU reset when drained") for r in resets)
    assert assessment.grade == "SUB_HEALTHY"


def test_a_pending_row_remap_makes_the_node_sub_healthy() -> None:
    _, assessment = run([(0.0, {"gpu": (_gpu(row_remap_pending=True),)})])
    assert assessment.grade == "SUB_HEALTHY"


@settings(max_examples=60, deadline=None)
@given(
    before=st.integers(0, 10_000),
    growth=st.integers(0, 5_000),
    after_s=st.floats(60.0, 3600.0),
)
def test_the_same_correctable_growth_costs_the_same_on_a_gpu_as_on_a_dimm(
    before: int, growth: int, after_s: float
) -> None:
    _, on_gpu = run(
        [
            (0.0, {"gpu": (_gpu(ecc_sbe_volatile=before),)}),
            (after_s, {"gpu": (_gpu(ecc_sbe_volatile=before + growth),)}),
        ]
    )
    _, on_dimm = run(
        [
            (0.0, {"edac": (dimm_mc(ce=before),)}),
            (after_s, {"edac": (dimm_mc(ce=before + growth),)}),
        ]
    )
    assert (on_gpu.score, on_gpu.grade) == (on_dimm.score, on_dimm.grade)
    gpu_levels = [r.threshold for r in by_rule(on_gpu, "gpu_ecc_correctable_rate")]
    dimm_levels = [r.threshold for r in by_rule(on_dimm, "ecc_correctable_rate")]
    assert gpu_levels == dimm_levels
