"""Network rules (controller/rules/network.py): rates at their thresholds, lossless classes,
resets, and the network component on the node page's reasons.

``NETWORK_CASES`` (tests/support/rule_cases.py) also feeds the table of
tests/unit/test_scoring.py (every rule fires and stays silent there).
"""

from __future__ import annotations

import pytest

from metalguard.controller.core.rules.network import counters
from metalguard.controller.core.scoring.config import parse_scoring_config
from metalguard.proto.telemetry import TcClassStats
from tests.support.rule_cases import NETWORK_CASES, lossless, nic, steps
from tests.support.scoring_helpers import Step, batch, by_rule, run


@pytest.mark.parametrize(
    ("steps_", "rule", "severity"),
    [(s, r, sev) for _id, s, r, sev in NETWORK_CASES],
    ids=[c[0] for c in NETWORK_CASES],
)
def test_rates_fire_at_their_thresholds(steps_: list[Step], rule: str, severity: str) -> None:
    _, assessment = run(steps_)
    found = [f for f in assessment.findings if f.reason.rule == rule]
    if severity is None:
        assert assessment.findings == ()
        return
    assert [f.severity for f in found] == [severity]
    assert {f.reason.rule for f in assessment.findings} == {rule}
    assert found[0].reason.signal.startswith("network.")


def test_counters_sum_directions_and_skip_unknowns() -> None:
    net = nic(
        rx_errors=2,
        tx_errors=None,
        rx_dropped=None,
        tx_dropped=None,
        rx_pause=10,
        tx_pause=5,
        tc_classes=(
            TcClassStats(classid="1:10", lossless=True, drops=4),
            TcClassStats(classid="1:20", lossless=False, drops=9),
        ),
    )
    assert dict(counters(batch(net=(net,)))) == {
        "net.ens1f0.errors": 2,
        "net.ens1f0.pause": 15,
        "net.ens1f0.tc.1:10.drops": 4,
    }


def test_drops_in_a_lossy_class_are_not_judged() -> None:
    lossy = [nic(tc_classes=(TcClassStats(classid="1:20", drops=d),)) for d in (0, 1_000_000)]
    _, assessment = run(steps(lossy[0], lossy[1], 60))
    assert assessment.findings == ()


def test_reason_names_interface_and_class_for_the_node_page() -> None:
    _, assessment = run(steps(lossless(0), lossless(30), 300))
    (reason,) = by_rule(assessment, "tc_lossless_drops")
    assert reason.signal == "network.lossless_drops"
    assert reason.message.startswith("lossless class training (1:10) on ens1f0: 30 drops")
    assert reason.value == 180.0  # 30 in a 600 s window = 180/h
    assert reason.threshold == 1


def test_a_counter_reset_is_not_a_storm() -> None:
    before = nic(rx_pause=50_000_000, tx_pause=0)
    after = nic(rx_pause=10, tx_pause=0)  # driver reload: counters start again
    _, assessment = run(steps(before, after, 60))
    assert by_rule(assessment, "net_pause_storm") == []
    assert {r.rule for r in assessment.notes} == {"counter_reset"}


def test_two_interfaces_are_judged_apart() -> None:
    first = (nic("a", rx_errors=0), nic("b", rx_errors=0))
    second = (nic("a", rx_errors=100), nic("b", rx_errors=0))
    _, assessment = run([(0.0, {"net": first}), (300.0, {"net": second})])
    (reason,) = by_rule(assessment, "net_error_rate")
    assert reason.message.startswith("interface a: 100 rx/tx errors in the last 600 s")


def test_thresholds_are_configurable_and_can_be_disabled() -> None:
    config = parse_scoring_config(
        "[rules.net_drop_rate]\nwarning_threshold = 1\nsevere_threshold = 2\nwindow_s = 60\n"
        "[rules.net_error_rate]\nenabled = false\n"
    )
    _, assessment = run(
        steps(nic(rx_dropped=0, rx_errors=0), nic(rx_dropped=1, rx_errors=10**6), 30), config
    )
    assert [(r.rule, r.value) for r in assessment.reasons] == [("net_drop_rate", 60.0)]
