"""RDMA rules (controller/core/rules/rdma.py): ports that go down or were never up, cabled
ports, flaps, physical errors, RoCE retransmissions, rates, saturated counters and resets.

Time is injected through ``batch.ts`` (offsets from T0). ``RDMA_CASES``
(tests/support/rule_cases.py) also feeds the table of tests/unit/test_scoring.py.
"""

from __future__ import annotations

import msgspec
import pytest

from metalguard.controller.config import ConfigError, parse_config
from metalguard.controller.core.rules.rdma import counters
from metalguard.controller.core.scoring.config import (
    DEFAULT_SCORING,
    Severity,
    parse_scoring_config,
)
from metalguard.controller.core.scoring.engine import assess
from metalguard.controller.core.topology import (
    ClusterTopology,
    TopologySection,
    TopologyView,
    with_topology,
)
from metalguard.proto.telemetry import CollectorError, CollectorRun, RdmaPort
from metalguard.proto.topology import NodeTopology
from tests.support.rule_cases import RDMA_CASES, cabled, down, hca, rdma_steps
from tests.support.scoring_helpers import NODE, Step, batch, by_rule, run

PORT_DOWN = DEFAULT_SCORING.rules.rdma_port_down
RDMA_OK = CollectorRun(collector="rdma", duration_s=0.01, success=True)
RDMA_FAILED = CollectorRun(collector="rdma", duration_s=0.01, success=False)


@pytest.mark.parametrize(
    ("steps_", "rule", "severity"),
    [(s, r, sev) for _id, s, r, sev in RDMA_CASES],
    ids=[c[0] for c in RDMA_CASES],
)
def test_each_rule_at_and_below_its_thresholds(
    steps_: list[Step], rule: str, severity: Severity | None
) -> None:
    _, assessment = run(steps_)
    found = by_rule(assessment, rule)
    if severity is None:
        assert (assessment.findings, assessment.notes) == ((), ())
        return
    graded = [f.severity for f in assessment.findings if f.reason.rule == rule]
    assert graded == ([] if severity == "info" else [severity])
    assert len(found) == 1
    assert found[0].signal.startswith("rdma.")
    assert "mlx5_0/1" in found[0].message


# --- the counter keys -----------------------------------------------------------------------


def test_counter_keys_are_only_what_the_rules_read() -> None:
    pma = {name: 7 for name in ("symbol_error", "link_downed", "port_xmit_data", "VL15_dropped")}
    hw = {name: 3 for name in ("out_of_sequence", "np_cnp_sent", "rx_write_requests")}
    ports = (
        hca(counters=pma, hw_counters=hw),
        hca(port=2, state="DOWN", counters={"link_downed": 1}),
    )
    assert dict(counters(batch(rdma=ports))) == {
        "rdma.mlx5_0.1.symbol_error": 7,
        "rdma.mlx5_0.1.link_downed": 7,
        "rdma.mlx5_0.1.active": 1,
        "rdma.mlx5_0.1.out_of_sequence": 3,
        "rdma.mlx5_0.2.link_downed": 1,
    }


def test_device_level_retransmit_counters_are_one_key_per_device() -> None:
    shared = {"packet_seq_err": 4, "local_ack_timeout_err": 1}
    ports = (hca(device_hw_counters=shared), hca(port=2, device_hw_counters=shared))
    keys = dict(counters(batch(rdma=ports)))
    assert {k: v for k, v in keys.items() if not k.endswith(".active")} == {
        "rdma.mlx5_0.packet_seq_err": 4,
        "rdma.mlx5_0.local_ack_timeout_err": 1,
    }


def test_a_port_with_every_counter_keeps_at_most_ten_keys() -> None:
    every = {name: 1 for name in _KERNEL_PMA}
    port = hca(counters=every, hw_counters={n: 1 for n in _KERNEL_HW}, device_hw_counters=every)
    assert len(dict(counters(batch(rdma=(port,))))) == 10


_KERNEL_PMA = [
    "VL15_dropped",
    "excessive_buffer_overrun_errors",
    "link_downed",
    "link_error_recovery",
    "local_link_integrity_errors",
    "port_rcv_constraint_errors",
    "port_rcv_data",
    "port_rcv_errors",
    "port_rcv_packets",
    "port_rcv_remote_physical_errors",
    "port_rcv_switch_relay_errors",
    "port_xmit_constraint_errors",
    "port_xmit_data",
    "port_xmit_discards",
    "port_xmit_packets",
    "port_xmit_wait",
    "symbol_error",
    "unicast_rcv_packets",
    "unicast_xmit_packets",
]
_KERNEL_HW = [
    "duplicate_request",
    "implied_nak_seq_err",
    "lifespan",
    "local_ack_timeout_err",
    "np_cnp_sent",
    "np_ecn_marked_roce_packets",
    "out_of_buffer",
    "out_of_sequence",
    "packet_seq_err",
    "req_cqe_error",
    "rnr_nak_retry_err",
    "rp_cnp_handled",
    "rp_cnp_ignored",
    "rx_atomic_requests",
]


# --- a port that was ACTIVE and is not ------------------------------------------------------


def test_a_port_going_down_is_failing_with_device_and_port_named() -> None:
    _, assessment = run(rdma_steps((0.0, hca()), (5.0, hca()), (10.0, down())))
    assert (assessment.grade, assessment.fatal) == ("FAILING", True)
    (reason,) = assessment.reasons
    assert (reason.rule, reason.signal, reason.value, reason.threshold) == (
        "rdma_port_down",
        "rdma.port_state",
        "DOWN",
        "ACTIVE",
    )
    assert reason.message == (
        "RDMA port mlx5_0/1 (ens1f0np0) is DOWN (physical state Polling); last seen ACTIVE 5 s ago"
    )


def test_a_port_back_to_active_is_healthy_again() -> None:
    signals, failing = run(rdma_steps((0.0, hca()), (5.0, down())))
    assert failing.grade == "FAILING"
    _, back = assess(signals, batch(10.0, 3, rdma=(hca(),)))
    assert (back.grade, back.findings) == ("HEALTHY", ())


@pytest.mark.parametrize("state", ["INIT", "ARMED"])
def test_any_state_but_active_is_down(state: str) -> None:
    _, assessment = run(rdma_steps((0.0, hca()), (5.0, hca(state=state))))
    assert [r.value for r in by_rule(assessment, "rdma_port_down")] == [state]


def test_active_defer_is_up_and_an_unknown_state_is_not_judged() -> None:
    for later in (hca(state="ACTIVE_DEFER"), hca(state="", state_id=None)):
        _, assessment = run(rdma_steps((0.0, hca()), (5.0, later)))
        assert assessment.findings == (), later.state


def test_it_stays_failing_while_down_until_the_memory_ends() -> None:
    window = PORT_DOWN.window_s
    # seen ACTIVE at 0, down since 5: at exactly window_s after 0 it is still remembered ...
    _, at_window = run(rdma_steps((0.0, hca()), (5.0, down()), (window, down())))
    assert [r.rule for r in at_window.reasons] == ["rdma_port_down"]
    # ... a second later it is not (a long-dead, never-declared port is forgotten)
    _, past = run(rdma_steps((0.0, hca()), (5.0, down()), (window + 1.0, down())))
    assert past.findings == ()


def test_grace_lets_a_port_be_down_that_long() -> None:
    config = parse_scoring_config("[rules.rdma_port_down]\ngrace_s = 30\n")
    _, early = run(rdma_steps((0.0, hca()), (29.0, down())), config)
    assert early.findings == ()
    _, late = run(rdma_steps((0.0, hca()), (30.0, down())), config)
    assert [r.message.endswith("last seen ACTIVE 30 s ago") for r in late.reasons] == [True]


def test_a_vanished_port_is_down_when_the_collector_ran() -> None:
    two = (hca(), hca(device="mlx5_1", netdev="ens2f0np0"))
    steps = rdma_steps((0.0, two), (5.0, two[:1]))
    _, assessment = run(steps)
    (reason,) = assessment.reasons
    assert (reason.value, reason.message) == (
        "absent",
        "RDMA port mlx5_1/1 is no longer reported (device removed or driver unloaded?); "
        "last seen ACTIVE 5 s ago",
    )
    # the only HCA gone: this cycle's run succeeded and found no port
    gone: list[Step] = [
        (0.0, {"rdma": two[:1], "collectors": (RDMA_OK,)}),
        (5.0, {"collectors": (RDMA_OK,)}),
    ]
    _, assessment = run(gone)
    assert [r.value for r in by_rule(assessment, "rdma_port_down")] == ["absent"]


def test_a_failed_or_absent_collector_says_nothing_about_ports() -> None:
    failed = {
        "collectors": (RDMA_FAILED,),
        "errors": (CollectorError(collector="rdma", message="EIO"),),
    }
    _, assessment = run([(0.0, {"rdma": (hca(),)}), (5.0, failed)])
    assert [r.rule for r in assessment.reasons] == ["collector_failed"]
    _, assessment = run([(0.0, {"rdma": (hca(),)}), (5.0, {})])  # collector disabled
    assert assessment.findings == ()


# --- cabled ports (the topology's rdma_ports) -----------------------------------------------


def test_a_cabled_port_without_link_is_failing_even_if_never_active() -> None:
    topo = cabled("mlx5_0/1")
    _, assessment = run(rdma_steps((0.0, down(phys_state="Disabled")), topology=topo))
    (reason,) = assessment.reasons
    assert (reason.rule, reason.signal, reason.value, reason.threshold) == (
        "rdma_cabled_port_down",
        "rdma.cabled_port",
        "Disabled",
        "LinkUp",
    )
    assert reason.message == (
        "RDMA port mlx5_0/1 (ens1f0np0) is cabled (topology rdma_ports) but its physical "
        "state is Disabled, not LinkUp"
    )
    assert assessment.grade == "FAILING"


def test_a_missing_cabled_port_is_failing() -> None:
    topo = cabled("mlx5_0/1", "mlx5_1/1")
    _, assessment = run(rdma_steps((0.0, hca()), topology=topo))
    (reason,) = assessment.reasons
    assert (reason.value, reason.message) == (
        "absent",
        "RDMA port mlx5_1/1 is cabled (topology rdma_ports) but the node does not report it "
        "(device gone or driver not loaded?)",
    )
    # without word from the rdma collector (none ran, no ports) nothing is judged
    _, quiet = run([(0.0, {"topology": topo})])
    assert quiet.findings == ()
    _, none_found = run([(0.0, {"topology": topo, "collectors": (RDMA_OK,)})])
    assert [r.value for r in none_found.reasons] == ["absent", "absent"]


def test_a_cabled_port_that_goes_down_is_one_reason_not_two() -> None:
    steps = rdma_steps((0.0, hca()), (5.0, down()), topology=cabled("mlx5_0/1"))
    _, assessment = run(steps)
    assert [r.rule for r in assessment.reasons] == ["rdma_cabled_port_down"]
    config = parse_scoring_config("[rules.rdma_cabled_port_down]\nenabled = false\n")
    _, assessment = run(steps, config)
    assert [r.rule for r in assessment.reasons] == ["rdma_port_down"]


def test_a_cabled_port_linkup_but_not_active_is_left_to_port_down() -> None:
    steps = rdma_steps((0.0, hca()), (5.0, hca(state="INIT")), topology=cabled("mlx5_0/1"))
    _, assessment = run(steps)
    assert [(r.rule, r.value) for r in assessment.reasons] == [("rdma_port_down", "INIT")]


# --- rate below the expected one ------------------------------------------------------------


@pytest.mark.parametrize(
    ("rate", "expected", "fires"),
    [(100.0, 200.0, True), (199.0, 200.0, True), (200.0, 200.0, False), (400.0, 200.0, False)],
)
def test_rate_below_expected_both_sides(rate: float, expected: float, fires: bool) -> None:
    _, assessment = run(rdma_steps((0.0, hca(rate_gbps=rate)), topology=cabled(rate=expected)))
    found = by_rule(assessment, "rdma_rate_below_expected")
    assert bool(found) is fires
    if fires:
        (reason,) = found
        assert (reason.value, reason.threshold) == (rate, expected)
        assert reason.message == (
            f"RDMA port mlx5_0/1 (ens1f0np0) runs at {rate:g} Gb/s, below the expected "
            f"{expected:g} Gb/s (topology rdma_rate_gbps)"
        )
        assert assessment.grade == "SUB_HEALTHY"


def test_rate_is_unchecked_at_zero_for_inactive_ports_and_unlisted_ones() -> None:
    slow = hca(rate_gbps=25.0)
    for ports, topo in [
        ((slow,), cabled(rate=0.0)),
        ((hca(state="DOWN", rate_gbps=25.0),), cabled(rate=200.0)),
        ((hca(), hca(device="mlx5_9", rate_gbps=25.0)), cabled("mlx5_0/1", rate=200.0)),
        ((hca(rate_gbps=None),), cabled(rate=200.0)),
    ]:
        _, assessment = run(rdma_steps((0.0, ports), topology=topo))
        assert by_rule(assessment, "rdma_rate_below_expected") == [], ports


# --- rates: flaps, physical errors, retransmissions -----------------------------------------


def test_physical_errors_message_names_the_counters_that_grew() -> None:
    before = hca(counters={"symbol_error": 0, "port_rcv_errors": 5, "link_downed": 0})
    after = hca(counters={"symbol_error": 118, "port_rcv_errors": 7, "link_downed": 0})
    _, assessment = run(rdma_steps((0.0, before), (600.0, after)))
    (reason,) = assessment.reasons
    assert (reason.rule, reason.signal, reason.value, reason.threshold) == (
        "rdma_phys_error_rate",
        "rdma.phys_error_rate",
        120.0,
        100,
    )
    assert reason.message == (
        "RDMA port mlx5_0/1 (ens1f0np0): 120 physical errors (symbol_error +118, "
        "port_rcv_errors +2) in the last 3600 s (120.0/h, severe at 100/h)"
    )
    assert assessment.grade == "SUB_HEALTHY"


def test_flaps_sum_both_counters() -> None:
    before = hca(counters={"link_downed": 10, "link_error_recovery": 3})
    after = hca(counters={"link_downed": 11, "link_error_recovery": 5})
    _, assessment = run(rdma_steps((0.0, before), (60.0, after)))
    (reason,) = by_rule(assessment, "rdma_link_flap_rate")
    assert reason.message.startswith(
        "RDMA port mlx5_0/1 (ens1f0np0): 3 link flaps (link_downed +1, link_error_recovery +2)"
    )
    assert assessment.findings[0].severity == "severe"


def test_one_flap_is_a_warning_named_in_the_singular() -> None:
    steps = rdma_steps(
        (0.0, hca(counters={"link_downed": 0})), (60.0, hca(counters={"link_downed": 1}))
    )
    _, assessment = run(steps)
    (reason,) = assessment.reasons
    assert reason.message == (
        "RDMA port mlx5_0/1 (ens1f0np0): 1 link flap (link_downed +1) in the last 3600 s "
        "(1.0/h, warning at 1/h)"
    )
    assert assessment.grade == "HEALTHY"


def test_growth_older_than_the_window_no_longer_counts() -> None:
    window = DEFAULT_SCORING.rules.rdma_link_flap_rate.window_s
    flaps = [hca(counters={"link_downed": n}) for n in (0, 3, 3)]
    _, inside = run(rdma_steps((0.0, flaps[0]), (10.0, flaps[1]), (10.0 + window, flaps[2])))
    assert [f.severity for f in inside.findings] == ["severe"]
    _, past = run(rdma_steps((0.0, flaps[0]), (10.0, flaps[1]), (11.0 + window, flaps[2])))
    assert past.findings == ()


@pytest.mark.parametrize(
    ("grown", "severity"), [(599, None), (600, "warning"), (59_999, "warning"), (60_000, "severe")]
)
def test_retransmit_rate_both_sides(grown: int, severity: str | None) -> None:
    """600 s window: 600 in it is 3600/h (warning), 60000 is 360000/h (severe)."""
    first = hca(hw_counters={"out_of_sequence": 1000, "packet_seq_err": 0})
    second = hca(hw_counters={"out_of_sequence": 1000 + grown - 1, "packet_seq_err": 1})
    _, assessment = run(rdma_steps((0.0, first), (300.0, second)))
    assert [f.severity for f in assessment.findings] == ([severity] if severity else [])
    if severity == "severe":
        (reason,) = assessment.reasons
        assert reason.signal == "rdma.retransmit_rate"
        assert reason.message.startswith(
            f"RDMA port mlx5_0/1 (ens1f0np0): {grown} RoCE retransmissions "
            f"(out_of_sequence +{grown - 1}, packet_seq_err +1) in the last 600 s"
        )
        assert assessment.grade == "HEALTHY", "retransmissions alone never leave HEALTHY"


def test_device_level_retransmissions_are_judged_once_per_device() -> None:
    def ports(n: int) -> tuple[RdmaPort, ...]:
        shared = {"local_ack_timeout_err": n}
        return (hca(device_hw_counters=shared), hca(port=2, device_hw_counters=shared))

    _, assessment = run(rdma_steps((0.0, ports(0)), (60.0, ports(600))))
    (reason,) = assessment.reasons
    assert reason.message.startswith(
        "RDMA device mlx5_0: 600 RoCE retransmissions (local_ack_timeout_err +600)"
    )


def test_thresholds_are_configurable_and_can_be_disabled() -> None:
    config = parse_scoring_config(
        "[rules.rdma_phys_error_rate]\nwindow_s = 60\nwarning_threshold = 60\n"
        "severe_threshold = 120\n[rules.rdma_link_flap_rate]\nenabled = false\n"
    )
    before = hca(counters={"symbol_error": 0, "link_downed": 0})
    after = hca(counters={"symbol_error": 1, "link_downed": 50})
    _, assessment = run(rdma_steps((0.0, before), (30.0, after)), config)
    assert [(r.rule, r.value) for r in assessment.reasons] == [("rdma_phys_error_rate", 60.0)]


# --- saturated counters and resets -----------------------------------------------------------


def stuck(n: int = 65535) -> RdmaPort:
    """symbol_error at ``n``, listed as saturated when it is 65535."""
    saturated = ("symbol_error",) if n == 65535 else ()
    return hca(counters={"symbol_error": n, "port_rcv_errors": 0}, saturated=saturated)


def test_a_saturated_counter_is_not_a_rate_and_is_one_note() -> None:
    _, assessment = run(rdma_steps((0.0, stuck()), (600.0, stuck()), (1200.0, stuck())))
    assert assessment.findings == ()
    (note,) = assessment.notes
    assert (note.rule, note.signal, note.value) == (
        "rdma_counter_saturated",
        "rdma.counter_saturated",
        "symbol_error",
    )
    assert note.message == (
        "RDMA port mlx5_0/1 (ens1f0np0): counters stuck at their maximum, blind to new "
        "errors until cleared (perfquery -R): symbol_error (65535)"
    )
    assert assessment.score == 100.0


def test_the_note_names_only_counters_the_rules_read() -> None:
    port = hca(
        counters={"link_downed": 255, "port_xmit_data": 4294967295},
        saturated=("port_xmit_data", "link_downed", "VL15_dropped"),
    )
    _, assessment = run(rdma_steps((0.0, port)))
    assert [n.value for n in assessment.notes] == ["link_downed"]
    _, only_data = run(rdma_steps((0.0, hca(saturated=("port_xmit_data",)))))
    assert only_data.notes == ()


def test_growth_up_to_the_maximum_counts_and_then_stops() -> None:
    _, rising = run(rdma_steps((0.0, stuck(65000)), (60.0, stuck())))
    (reason,) = rising.reasons
    assert "symbol_error +535 (saturated)" in reason.message
    _, later = run(
        rdma_steps((0.0, stuck(65000)), (60.0, stuck()), (3661.0, stuck()), (7200.0, stuck()))
    )
    assert later.findings == ()
    assert [n.rule for n in later.notes] == ["rdma_counter_saturated"]


def test_clearing_a_saturated_counter_is_a_reset_then_it_counts_again() -> None:
    signals, cleared = run(rdma_steps((0.0, stuck()), (60.0, stuck(0))))
    assert cleared.findings == ()
    assert [n.rule for n in cleared.notes] == ["counter_reset"]
    assert "rdma.mlx5_0.1.symbol_error" in cleared.notes[0].message
    _, counting = assess(signals, batch(120.0, 3, rdma=(stuck(150),)))
    assert [r.rule for r in counting.reasons] == ["rdma_phys_error_rate"]
    assert counting.reasons[0].value == 150.0


def test_a_driver_reload_resets_every_counter_without_a_rate() -> None:
    loaded = hca(
        counters={"symbol_error": 5000, "link_downed": 40},
        hw_counters={"out_of_sequence": 10**6},
    )
    reloaded = hca(
        counters={"symbol_error": 1, "link_downed": 0}, hw_counters={"out_of_sequence": 2}
    )
    _, assessment = run(rdma_steps((0.0, loaded), (60.0, reloaded)))
    assert assessment.findings == ()
    (note,) = assessment.notes
    assert (note.rule, note.value) == ("counter_reset", 3)


# --- the node's topology: its report, or the controller's [topology] -------------------------


def test_the_controller_topology_overrides_the_report_for_the_rules() -> None:
    reported = NodeTopology(rack="k1")
    config = TopologySection(
        clusters={"c1": ClusterTopology(rdma_ports=("mlx5_0/1",), rdma_rate_gbps=400.0)}
    )
    view = TopologyView(config)
    b = batch(0.0, rdma=(hca(rate_gbps=200.0),), topology=reported)
    view.observe(NODE.handle, b)
    resolved = view.topology(NODE.handle, NODE)
    assert (resolved.rack, resolved.rdma_ports, resolved.rdma_rate_gbps) == (
        "k1",
        ("mlx5_0/1",),
        400.0,
    )
    assert view.topology(NODE.handle, NODE) is resolved, "the same object while unchanged"
    _, assessment = assess(None, with_topology(b, resolved))
    assert [r.rule for r in assessment.reasons] == ["rdma_rate_below_expected"]
    _, as_reported = assess(None, b)
    assert as_reported.findings == ()


def test_with_topology_keeps_the_batch_when_nothing_is_forced() -> None:
    b = batch(0.0, topology=NodeTopology(rack="k1"))
    assert with_topology(b, NodeTopology(rack="k1")) is b
    bare = batch(0.0)
    assert with_topology(bare, NodeTopology()) is bare
    forced = with_topology(bare, cabled("mlx5_0/1"))
    assert forced.topology == cabled("mlx5_0/1")
    assert msgspec.structs.replace(forced, topology=None) == bare


def test_the_controller_config_takes_the_rdma_topology_keys() -> None:
    cfg = parse_config(
        'region = "r1"\n[topology.clusters.c1.racks.k1]\nrdma_rate_gbps = 200.0\n'
        '[topology.clusters.c1.nodes.n1]\nrdma_ports = ["mlx5_0/1"]\n'
    )
    got = TopologyView(cfg.topology).topology(NODE.handle, NODE)
    assert (got.rdma_ports, got.rdma_rate_gbps) == (("mlx5_0/1",), 0.0), "n1 is not in k1"
    with pytest.raises(ConfigError, match=r"topology\.rdma_rate_gbps: Expected `float` >= 0"):
        parse_config('region = "r1"\n[topology]\nrdma_rate_gbps = -1\n', "controller.toml")
