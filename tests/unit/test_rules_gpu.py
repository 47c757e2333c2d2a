"""GPU rules (controller/rules/gpu.py) over NVML-shaped readings.

``GPU_CASES`` (tests/support/rule_cases.py) also feeds the table of tests/unit/test_scoring.py
(every rule fires and stays silent there).
"""

from __future__ import annotations

import pytest

from metalguard.controller.core.rules.gpu import counters
from metalguard.proto.telemetry import GpuDevice
from tests.support.rule_cases import GPU_CASES, gpu, links, one
from tests.support.scoring_helpers import Step, batch, by_rule, run


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
