"""The rule tables shared by the rule tests and the scorer's table (tests/unit/test_scoring.py,
where every rule fires and stays silent): ``GPU_CASES``, ``NETWORK_CASES`` and
``RDMA_CASES``, each case ``(id, steps, rule, severity or None)``, and the builders of their
readings."""

from __future__ import annotations

import math
from typing import Any

from metalguard.controller.core.scoring.config import DEFAULT_SCORING, Severity
from metalguard.proto.telemetry import (
    GpuDevice,
    KmsgCounts,
    NetInterface,
    NvLinkErrors,
    RdmaPort,
    TcClassStats,
)
from metalguard.proto.topology import NodeTopology
from tests.support.scoring_helpers import Step

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
    ("remap pending", one(row_remap_pending=True), "gpu_reset_pending", "severe"),
    # one XID of each of NVIDIA's classes (metalguard/proto/xid_catalog.toml)
    ("xid 48 reset_gpu", one(xid_errors=(48,)), "gpu_reset_pending", "severe"),
    ("xid 119 reset_gpu", one(xid_errors=(119,)), "gpu_reset_pending", "severe"),
    ("xid 74 decode", one(xid_errors=(74,)), "gpu_reset_pending", "severe"),
    ("xid 13 app", one(xid_errors=(13, 31, 43)), "gpu_reset_pending", None),
    ("xid 63 ignore", one(xid_errors=(63,)), "gpu_reset_pending", None),
    ("xid 79 reboot", one(xid_errors=(79,)), "gpu_xid_reboot", "fatal"),
    ("xid 13 not reboot", one(xid_errors=(13,)), "gpu_xid_reboot", None),
    ("xid 92 counted", one(xid_errors=(92, 92, 92)), "gpu_xid_attention", "warning"),
    ("xid unlisted", one(xid_errors=(9999,)), "gpu_xid_attention", "warning"),
    ("xid 13 no attention", one(xid_errors=(13,)), "gpu_xid_attention", None),
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
    ("hw slowdown", one(throttle_reasons=("hw_slowdown",)), "gpu_thermal_slowdown", "warning"),
    (
        "power brake",
        one(throttle_reasons=("hw_power_brake_slowdown",)),
        "gpu_thermal_slowdown",
        "warning",
    ),
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


# --- RDMA (controller/core/rules/rdma.py) -------------------------------------------------

RDMA_WINDOW = {
    "rdma_link_flap_rate": 3600.0,
    "rdma_phys_error_rate": 3600.0,
    "rdma_retransmit_rate": 600.0,
}


def hca(device: str = "mlx5_0", port: int = 1, **fields: Any) -> RdmaPort:
    """An ACTIVE, LinkUp 200 Gb/s RoCE port (``fields`` override)."""
    defaults: dict[str, Any] = {
        "state": "ACTIVE",
        "state_id": 4,
        "phys_state": "LinkUp",
        "phys_state_id": 5,
        "rate_gbps": 200.0,
        "link_layer": "Ethernet",
        "netdev": "ens1f0np0",
    }
    return RdmaPort(device=device, port=port, **{**defaults, **fields})


def down(**fields: Any) -> RdmaPort:
    """That port DOWN with no physical link."""
    return hca(
        **{"state": "DOWN", "state_id": 1, "phys_state": "Polling", "phys_state_id": 2, **fields}
    )


def cabled(*ports: str, rate: float = 0.0) -> NodeTopology:
    """A topology listing ``ports`` as cabled, expecting ``rate`` Gb/s."""
    return NodeTopology(rdma_ports=ports, rdma_rate_gbps=rate)


def rdma_steps(*batches: tuple[float, RdmaPort | tuple[RdmaPort, ...]], **more: Any) -> list[Step]:
    """One batch per (offset, port or ports), each with ``more`` readings."""
    return [
        (offset, {"rdma": ports if isinstance(ports, tuple) else (ports,), **more})
        for offset, ports in batches
    ]


def _pma(name: str) -> Any:
    return lambda n: hca(counters={name: n})


def _rdma_rate_cases(
    rule: str, name: str, build: Any
) -> list[tuple[str, list[Step], str, Severity | None]]:
    """Warning and severe at their thresholds, warning just below severe, silent just below
    warning (the growth within the window that makes each rate)."""
    window = RDMA_WINDOW[rule]
    warn = math.ceil(at(rule, "warning") * window / 3600)
    severe = math.ceil(at(rule, "severe") * window / 3600)
    after = window / 2

    def grow(n: int) -> list[Step]:
        return rdma_steps((0.0, build(0)), (after, build(n)))

    return [
        (f"{rule} {name} at warning", grow(warn), rule, "warning"),
        (f"{rule} {name} at severe", grow(severe), rule, "severe"),
        (f"{rule} {name} just below severe", grow(severe - 1), rule, "warning"),
        (f"{rule} {name} just below warning", grow(warn - 1), rule, None),
    ]


RDMA_CASES: list[tuple[str, list[Step], str, Severity | None]] = [
    (
        "rdma port ACTIVE then DOWN",
        rdma_steps((0.0, hca()), (5.0, down())),
        "rdma_port_down",
        "fatal",
    ),
    ("rdma port never ACTIVE", rdma_steps((0.0, down()), (5.0, down())), "rdma_port_down", None),
    (
        "rdma cabled port Polling",
        rdma_steps((0.0, down()), topology=cabled("mlx5_0/1")),
        "rdma_cabled_port_down",
        "fatal",
    ),
    (
        "rdma cabled port LinkUp",
        rdma_steps((0.0, hca()), topology=cabled("mlx5_0/1")),
        "rdma_cabled_port_down",
        None,
    ),
    *_rdma_rate_cases("rdma_link_flap_rate", "link_downed", _pma("link_downed")),
    *_rdma_rate_cases("rdma_phys_error_rate", "symbol_error", _pma("symbol_error")),
    *_rdma_rate_cases(
        "rdma_retransmit_rate", "out_of_sequence", lambda n: hca(hw_counters={"out_of_sequence": n})
    ),
    (
        "rdma rate below expected",
        rdma_steps((0.0, hca(rate_gbps=100.0)), topology=cabled(rate=200.0)),
        "rdma_rate_below_expected",
        "severe",
    ),
    (
        "rdma rate at expected",
        rdma_steps((0.0, hca(rate_gbps=200.0)), topology=cabled(rate=200.0)),
        "rdma_rate_below_expected",
        None,
    ),
    (
        "rdma symbol_error saturated",
        rdma_steps((0.0, hca(counters={"symbol_error": 65535}, saturated=("symbol_error",)))),
        "rdma_counter_saturated",
        "info",
    ),
    (
        "rdma symbol_error just below its maximum",
        rdma_steps((0.0, hca(counters={"symbol_error": 65534}))),
        "rdma_counter_saturated",
        None,
    ),
]
"""(id, steps, rule, severity or None), in the form of test_scoring.py's ``Case``."""


def kmsg(critical: dict[str, int] | None = None, **findings: int) -> KmsgCounts:
    """The kernel log monitor's counts: every kind at 0 but these (``critical``: how many
    of them were critical)."""
    zero = dict.fromkeys(("fs_readonly", "hung_task", "io_error", "oom_kill", "segfault"), 0)
    zero_critical = dict.fromkeys(("memory_uncorrected", "pcie_aer"), 0)
    return KmsgCounts(
        records=sum(findings.values()),
        findings=zero | findings,
        critical=zero_critical | (critical or {}),
    )


def kmsg_steps(before: KmsgCounts, after: KmsgCounts, after_s: float = 30.0) -> list[Step]:
    """Two batches of kernel log counts ``after_s`` apart."""
    return [(0.0, {"kmsg": before}), (after_s, {"kmsg": after})]


KMSG_CASES: list[tuple[str, list[Step], str, Severity | None]] = [
    ("kmsg read-only fs", kmsg_steps(kmsg(), kmsg(fs_readonly=1)), "kmsg_fatal", "fatal"),
    ("kmsg hung task", kmsg_steps(kmsg(), kmsg(hung_task=2)), "kmsg_severe", "severe"),
    ("kmsg I/O error", kmsg_steps(kmsg(), kmsg(io_error=5)), "kmsg_warning", "warning"),
    ("kmsg quiet", kmsg_steps(kmsg(hung_task=2), kmsg(hung_task=2)), "kmsg_severe", None),
    ("kmsg OOM kill is the job's", kmsg_steps(kmsg(), kmsg(oom_kill=3)), "kmsg_warning", None),
    ("kmsg no fatal kind", kmsg_steps(kmsg(), kmsg(segfault=4)), "kmsg_fatal", None),
    (
        "kmsg critical uncorrected memory error",
        kmsg_steps(kmsg(), kmsg({"memory_uncorrected": 1}, memory_uncorrected=1)),
        "kmsg_fatal",
        "fatal",
    ),
    (
        "kmsg fatal AER",
        kmsg_steps(kmsg(pcie_aer=5), kmsg({"pcie_aer": 1}, pcie_aer=6)),
        "kmsg_fatal",
        "fatal",
    ),
    (
        "kmsg corrected AERs are not fatal",
        kmsg_steps(kmsg(pcie_aer=5), kmsg(pcie_aer=50)),
        "kmsg_fatal",
        None,
    ),
    (
        "kmsg an hour later",
        [*kmsg_steps(kmsg(), kmsg(hung_task=1), 30.0), (3700.0, {"kmsg": kmsg(hung_task=1)})],
        "kmsg_severe",
        None,
    ),
]
