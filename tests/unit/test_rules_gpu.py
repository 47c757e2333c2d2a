"""GPU rules (controller/rules/gpu.py) over NVML-shaped readings.

``GPU_CASES`` also feeds the table of tests/unit/test_scoring.py (every rule fires and
stays silent there).
"""

from __future__ import annotations

from typing import Any

import pytest

from metalguard.controller.core.rules.gpu import counters
from metalguard.controller.core.scoring.config import Severity
from metalguard.proto.telemetry import GpuDevice, NvLinkErrors
from tests.unit.scoring_helpers import Step, batch, by_rule, run


def gpu(**fields: Any) -> GpuDevice:
    return GpuDevice(index=0, uuid="GPU-0a1b", pci_address="0000:17:00.0", **fields)


def one(**fields: Any) -> list[Step]:
    return [(0.0, {"gpu": (gpu(**fields),)})]


def grow(field_before: dict[str, Any], field_after: dict[str, Any]) -> list[Step]:
    return [(0.0, {"gpu": (gpu(**field_before),)}), (1800.0, {"gpu": (gpu(**field_after),)})]


def links(n: int) -> tuple[NvLinkErrors, ...]:
    return (NvLinkErrors(link=0, crc_flit=n, crc_data=0, replay=0, recovery=0),)


GPU_CASES: list[tuple[str, list[Step], str, Severity | None]] = [
    ("dbe", one(ecc_dbe_volatile=2), "gpu_ecc_uncorrectable", "fatal"),
    ("no dbe", one(ecc_dbe_volatile=0, ecc_uncorrected=0), "gpu_ecc_uncorrectable", None),
    ("remap failed", one(row_remap_failure=True), "gpu_row_remap_failure", "fatal"),
    ("remap ok", one(row_remap_failure=False), "gpu_row_remap_failure", None),
    ("remap pending", one(row_remap_pending=True), "gpu_reset_pending", "warning"),
    ("nothing pending", one(row_remap_pending=False), "gpu_reset_pending", None),
    (
        "x8 of x16",
        one(pcie_downgraded=True, pcie_link_width=8, pcie_link_width_max=16),
        "gpu_pcie_downgrade",
        "severe",
    ),
    ("full link", one(pcie_downgraded=False), "gpu_pcie_downgrade", None),
    ("too hot", one(throttle_reasons=("hw_thermal_slowdown",)), "gpu_thermal_slowdown", "warning"),
    ("power cap", one(throttle_reasons=("sw_power_cap",)), "gpu_thermal_slowdown", None),
    (
        "sbe at severe",
        grow({"ecc_sbe_volatile": 0}, {"ecc_sbe_volatile": 100}),
        "gpu_ecc_correctable_rate",
        "severe",
    ),
    (
        "sbe just below",
        grow({"ecc_sbe_volatile": 0}, {"ecc_sbe_volatile": 9}),
        "gpu_ecc_correctable_rate",
        None,
    ),
    (
        "replays at warning",
        grow({"pcie_replay_count": 0}, {"pcie_replay_count": 100}),
        "gpu_pcie_replay_rate",
        "warning",
    ),
    (
        "replays below",
        grow({"pcie_replay_count": 0}, {"pcie_replay_count": 99}),
        "gpu_pcie_replay_rate",
        None,
    ),
    (
        "nvlink at severe",
        grow({"nvlinks": links(0)}, {"nvlinks": links(10_000)}),
        "gpu_nvlink_error_rate",
        "severe",
    ),
    (
        "nvlink quiet",
        grow({"nvlinks": links(5)}, {"nvlinks": links(5)}),
        "gpu_nvlink_error_rate",
        None,
    ),
]
"""(id, steps, rule, severity or None) in the form of test_scoring.py's ``Case``."""


@pytest.mark.parametrize(
    ("steps", "rule", "severity"),
    [(s, r, sev) for _id, s, r, sev in GPU_CASES],
    ids=[c[0] for c in GPU_CASES],
)
def test_gpu_rules(steps: list[Step], rule: str, severity: str | None) -> None:
    _, assessment = run(steps)
    found = [f.severity for f in assessment.findings if f.reason.rule == rule]
    assert found == ([] if severity is None else [severity])


def test_messages_name_the_gpu_and_the_values() -> None:
    _, a = run(one(ecc_dbe_volatile=2))
    (r,) = by_rule(a, "gpu_ecc_uncorrectable")
    assert r.message == "GPU 0 (0000:17:00.0) has 2 uncorrectable ECC errors"
    assert (r.signal, r.value) == ("gpu.ecc_dbe", 2)
    assert a.grade == "FAILING"
    _, a = run(
        one(
            pcie_downgraded=True,
            pcie_link_gen=4,
            pcie_link_gen_max=4,
            pcie_link_width=8,
            pcie_link_width_max=16,
        )
    )
    (r,) = by_rule(a, "gpu_pcie_downgrade")
    assert r.message == "GPU 0 (0000:17:00.0): PCIe link at gen4 x8, its maximum is gen4 x16"


def test_counters_are_per_gpu_and_skip_what_nvml_did_not_say() -> None:
    b = batch(
        gpu=(
            gpu(ecc_sbe_volatile=3, pcie_replay_count=7, nvlinks=links(4)),
            GpuDevice(index=1),
        )
    )
    assert dict(counters(b)) == {
        "gpu.GPU-0a1b.ecc_sbe": 3,
        "gpu.GPU-0a1b.pcie_replay": 7,
        "gpu.GPU-0a1b.nvlink_errors": 4,
    }
