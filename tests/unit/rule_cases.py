"""The rule tables shared by the rule tests and the scorer's table (tests/unit/test_scoring.py,
where every rule fires and stays silent): ``GPU_CASES`` and ``NETWORK_CASES``, each case
``(id, steps, rule, severity or None)``, and the builders of their readings."""

from __future__ import annotations

import math
from typing import Any

from metalguard.controller.core.scoring.config import DEFAULT_SCORING, Severity
from metalguard.proto.telemetry import GpuDevice, NetInterface, NvLinkErrors, TcClassStats
from tests.unit.scoring_helpers import Step

# --- GPU (controller/core/rules/gpu.py) ---------------------------------------------------


def gpu(**fields: Any) -> GpuDevice:
    """GPU 0 of the node, with ``fields`` read."""
    return GpuDevice(index=0, uuid="GPU-0a1b", pci_address="0000:17:00.0", **fields)


def one(**fields: Any) -> list[Step]:
    """One batch with that GPU."""
    return [(0.0, {"gpu": (gpu(**fields),)})]


def grow(field_before: dict[str, Any], field_after: dict[str, Any]) -> list[Step]:
    """Two batches of that GPU, 30 minutes apart."""
    return [(0.0, {"gpu": (gpu(**field_before),)}), (1800.0, {"gpu": (gpu(**field_after),)})]


def links(n: int) -> tuple[NvLinkErrors, ...]:
    """One NVLink with ``n`` CRC flit errors."""
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
"""(id, steps, rule, severity or None), in the form of test_scoring.py's ``Case``."""


# --- network (controller/core/rules/network.py) -------------------------------------------

WINDOW = {
    "net_error_rate": 600.0,
    "net_drop_rate": 600.0,
    "net_pause_storm": 300.0,
    "tc_lossless_drops": 600.0,
}


def nic(name: str = "ens1f0", **fields: Any) -> NetInterface:
    """An interface with ``fields`` read."""
    return NetInterface(name=name, **fields)


def lossless(drops: int, name: str = "training", classid: str = "1:10") -> NetInterface:
    """An interface whose one lossless traffic class dropped ``drops`` packets."""
    tc = TcClassStats(classid=classid, name=name, lossless=True, drops=drops, packets=1000)
    return nic(tc_classes=(tc,))


def steps(first: NetInterface, second: NetInterface, after_s: float) -> list[Step]:
    """Two batches of one interface, ``after_s`` apart."""
    return [(0.0, {"net": (first,)}), (after_s, {"net": (second,)})]


def grown(rule: str, per_hour: float) -> int:
    """The least growth within the rule's window that makes ``per_hour``."""
    return math.ceil(per_hour * WINDOW[rule] / 3600)


def at(rule: str, level: str) -> float:
    """The default ``level`` (warning, severe) threshold of ``rule``."""
    settings = DEFAULT_SCORING.rules.get(rule)
    return float(getattr(settings, f"{level}_threshold"))


def _rate_cases(rule: str, build: Any) -> list[tuple[str, list[Step], str, Severity | None]]:
    """Warning at its threshold, severe at its threshold, silent just below warning."""
    warn, severe = grown(rule, at(rule, "warning")), grown(rule, at(rule, "severe"))
    after = WINDOW[rule] / 2
    return [
        (f"{rule} at warning", steps(build(0), build(warn), after), rule, "warning"),
        (f"{rule} at severe", steps(build(0), build(severe), after), rule, "severe"),
        (f"{rule} just below", steps(build(0), build(max(warn - 1, 0)), after), rule, None),
    ]


NETWORK_CASES: list[tuple[str, list[Step], str, Severity | None]] = [
    *_rate_cases("net_error_rate", lambda n: nic(rx_errors=n, tx_errors=0)),
    *_rate_cases("net_drop_rate", lambda n: nic(rx_dropped=n // 2, tx_dropped=n - n // 2)),
    *_rate_cases("net_pause_storm", lambda n: nic(rx_pause=n, tx_pause=0)),
    *_rate_cases("tc_lossless_drops", lossless),
]
"""(id, steps, rule, severity or None), in the form of test_scoring.py's ``Case``."""
