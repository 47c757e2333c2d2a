"""DCQCN checked against its counters (agent/qos/dcqcn_check.py): the pure judgement of
two readings, the watch that keeps readings and findings between cycles, and the fold of
the findings into the reconciler's verdicts; then the reconciler's ``qos_degraded``
reporting on a fake mlx5 sysfs tree."""

from __future__ import annotations

from pathlib import Path

import pytest

from metalguard.agent.qos.apply import QosTarget
from metalguard.agent.qos.dcqcn_check import (
    DcqcnWatch,
    PortCheck,
    check_port,
    counter,
    counters_cited,
    ecn_enabled,
    with_degraded,
)
from metalguard.agent.qos.plan import InterfaceInfo
from metalguard.agent.qos.reconciler import QosReconciler
from metalguard.proto.base import NodeIdentity
from metalguard.proto.events import NODE_EVENT_KINDS, NodeEvent
from metalguard.proto.qos import decode_profile
from metalguard.proto.telemetry import QosInterfaceStatus, RdmaPort

DCQCN = decode_profile("version = 5\n[dcqcn]\nnp = { cnp_dscp = 48 }\n", "toml")
ECN_CLASS = decode_profile(
    "version = 1\nlink_rate_mbit = 100\n[[traffic_class]]\nname = 'all'\npriorities = [0]\n"
    "bandwidth_percent = 100\necn = { min_kb = 10, max_kb = 20 }\n",
    "toml",
)
PLAIN = decode_profile(
    "version = 1\nlink_rate_mbit = 100\n[[traffic_class]]\nname = 'all'\npriorities = [0]\n"
    "bandwidth_percent = 100\n",
    "toml",
)


def port(
    marked: int = 0,
    sent: int = 0,
    handled: int = 0,
    ignored: int = 0,
    *,
    netdev: str = "eth2",
    device: str = "mlx5_0",
    at_device: bool = False,
) -> RdmaPort:
    """One RoCE port with its four congestion counters (port level, or device level)."""
    counters = {
        "np_ecn_marked_roce_packets": marked,
        "np_cnp_sent": sent,
        "rp_cnp_handled": handled,
        "rp_cnp_ignored": ignored,
    }
    return RdmaPort(
        device=device,
        port=1,
        state="ACTIVE",
        link_layer="Ethernet",
        netdev=netdev,
        hw_counters={} if at_device else counters,
        device_hw_counters=counters if at_device else {},
    )


# --- the profile --------------------------------------------------------------------------


def test_which_profiles_enable_ecn_or_dcqcn() -> None:
    assert ecn_enabled(DCQCN)
    assert ecn_enabled(ECN_CLASS)
    assert not ecn_enabled(PLAIN)
    assert not ecn_enabled(None)


# --- two readings -------------------------------------------------------------------------


def test_marks_without_cnps_is_a_finding_naming_the_counters() -> None:
    result = check_port(port(marked=100, sent=7), port(marked=1100, sent=7))
    assert [f.condition for f in result.problems] == ["np_no_cnp"]
    message = result.problems[0].message
    assert message.startswith("mlx5_0/1: np_ecn_marked_roce_packets +1000 but np_cnp_sent +0")
    assert "sends no CNPs" in message
    assert not result.reset


def test_marks_answered_by_cnps_are_healthy_dcqcn() -> None:
    result = check_port(port(marked=100, sent=7), port(marked=1100, sent=90))
    assert result == PortCheck(working=frozenset({"np_no_cnp"}))


def test_a_few_marks_below_the_threshold_prove_nothing() -> None:
    assert check_port(port(marked=100), port(marked=109), min_growth=10) == PortCheck()
    assert check_port(port(marked=100), port(marked=110), min_growth=10).problems


def test_cnps_ignored_and_never_handled_is_a_finding() -> None:
    result = check_port(port(handled=5, ignored=0), port(handled=5, ignored=40))
    assert [f.condition for f in result.problems] == ["rp_cnp_unhandled"]
    assert "rp_cnp_ignored +40 but rp_cnp_handled +0" in result.problems[0].message


def test_cnps_handled_are_healthy_even_with_some_ignored() -> None:
    result = check_port(port(handled=5, ignored=0), port(handled=50, ignored=40))
    assert result == PortCheck(working=frozenset({"rp_cnp_unhandled"}))


def test_both_conditions_at_once() -> None:
    before, after = port(), port(marked=500, ignored=500)
    assert [f.condition for f in check_port(before, after).problems] == [
        "np_no_cnp",
        "rp_cnp_unhandled",
    ]


def test_no_traffic_judges_nothing() -> None:
    assert check_port(port(1, 2, 3, 4), port(1, 2, 3, 4)) == PortCheck()


def test_a_counter_going_down_is_a_reset_not_a_finding() -> None:
    result = check_port(port(marked=5000, sent=10), port(marked=900, sent=0))
    assert result == PortCheck(reset=True)


def test_device_level_counters_count_when_the_port_has_none() -> None:
    before, after = port(at_device=True), port(marked=300, at_device=True)
    assert counter(after, "np_ecn_marked_roce_packets") == 300
    assert [f.condition for f in check_port(before, after).problems] == ["np_no_cnp"]


def test_a_port_without_congestion_counters_is_not_judged() -> None:
    bare = RdmaPort(device="rxe0", port=1, netdev="eth0", hw_counters={"sent_pkts": 9})
    more = RdmaPort(device="rxe0", port=1, netdev="eth0", hw_counters={"sent_pkts": 99})
    assert check_port(bare, more) == PortCheck()


# --- the watch: readings kept between cycles -----------------------------------------------


def test_the_first_reading_only_sets_the_baseline() -> None:
    watch = DcqcnWatch()
    watch.observe([port(marked=10**9)], enabled=True)
    assert watch.degraded() == {}
    watch.observe([port(marked=10**9 + 500)], enabled=True)
    assert list(watch.degraded()) == ["eth2"]


def test_a_finding_stands_through_idle_intervals_until_cnps_answer_marks() -> None:
    watch = DcqcnWatch()
    watch.observe([port()], enabled=True)
    watch.observe([port(marked=500)], enabled=True)
    (message,) = watch.degraded()["eth2"]
    assert "np_ecn_marked_roce_packets +500" in message
    watch.observe([port(marked=500)], enabled=True)  # no traffic: nothing to judge by
    assert watch.degraded() == {"eth2": (message,)}
    watch.observe([port(marked=900, sent=3)], enabled=True)  # marks answered
    assert watch.degraded() == {}


def test_a_reset_clears_the_finding_and_rebases() -> None:
    watch = DcqcnWatch()
    watch.observe([port()], enabled=True)
    watch.observe([port(ignored=800)], enabled=True)
    assert watch.findings() == {"eth2": {"mlx5_0/1:rp_cnp_unhandled": watch.degraded()["eth2"][0]}}
    watch.observe([port(ignored=3)], enabled=True)  # counters cleared
    assert watch.degraded() == {}
    watch.observe([port(ignored=5)], enabled=True)  # below the threshold since the reset
    assert watch.degraded() == {}


def test_nothing_is_flagged_when_the_profile_does_not_enable_ecn() -> None:
    watch = DcqcnWatch()
    watch.observe([port()], enabled=False)
    watch.observe([port(marked=500)], enabled=False)
    assert watch.degraded() == {}
    watch.observe([port(marked=500)], enabled=True)
    watch.observe([port(marked=1000)], enabled=True)  # the baseline was kept
    assert "np_ecn_marked_roce_packets +500" in watch.degraded()["eth2"][0]
    watch.observe([port(marked=1500)], enabled=False)  # profile changed: cleared
    assert watch.degraded() == {}


def test_a_port_that_disappears_is_forgotten_and_rebased_when_back() -> None:
    watch = DcqcnWatch()
    watch.observe([port()], enabled=True)
    watch.observe([port(marked=500)], enabled=True)
    assert watch.degraded()
    watch.observe([], enabled=True)
    assert watch.degraded() == {}
    watch.observe([port(marked=5000)], enabled=True)  # back: a first reading again
    assert watch.degraded() == {}


def test_a_port_bound_to_another_netdev_is_a_new_baseline() -> None:
    watch = DcqcnWatch()
    watch.observe([port(netdev="eth2")], enabled=True)
    watch.observe([port(marked=500, netdev="eth3")], enabled=True)
    assert watch.degraded() == {}


def test_findings_of_two_ports_of_one_interface_are_merged() -> None:
    watch = DcqcnWatch()
    watch.observe([port(device="mlx5_0"), port(device="mlx5_1")], enabled=True)
    watch.observe(
        [port(marked=100, device="mlx5_0"), port(ignored=100, device="mlx5_1")], enabled=True
    )
    found = watch.findings()["eth2"]
    assert list(found) == ["mlx5_0/1:np_no_cnp", "mlx5_1/1:rp_cnp_unhandled"]
    assert counters_cited(found) == [
        "np_ecn_marked_roce_packets",
        "np_cnp_sent",
        "rp_cnp_ignored",
        "rp_cnp_handled",
    ]


# --- folding the findings into the verdicts --------------------------------------------------


@pytest.mark.parametrize(
    ("status", "after"),
    [
        ("applied", "degraded"),
        ("partial", "degraded"),
        ("unsupported", "unsupported"),
        ("failed", "failed"),
        ("drift", "drift"),
    ],
)
def test_with_degraded(status: str, after: str) -> None:
    verdict = QosInterfaceStatus(interface="eth2", version=3, status=status, reasons=("r",))
    other = QosInterfaceStatus(interface="eth3", version=3, status="applied")
    folded = with_degraded([verdict, other], {"eth2": ("x: np_cnp_sent +0",), "eth9": ("y",)})
    assert folded == (
        QosInterfaceStatus(
            interface="eth2", version=3, status=after, reasons=("x: np_cnp_sent +0", "r")
        ),
        other,
    ), "findings first; an interface the reconciler does not manage is left out"


# --- the reconciler --------------------------------------------------------------------------


def mlx5_tree(root: Path, ifname: str) -> None:
    """The DCQCN knob of DCQCN's profile, as the mlx5 driver exposes it."""
    knob = root / "class" / "net" / ifname / "ecn" / "roce_np" / "cnp_dscp"
    knob.parent.mkdir(parents=True, exist_ok=True)
    knob.write_text("0\n")


async def test_the_reconciler_reports_degraded_and_recovery(tmp_path: Path) -> None:
    mlx5_tree(tmp_path, "eth2")
    events: list[NodeEvent] = []

    async def emit(event: NodeEvent) -> None:
        events.append(event)

    reconciler = QosReconciler(
        NodeIdentity(region="r1", cluster="c1", node="n1"),
        emit,
        target=QosTarget(sysfs=str(tmp_path)),
        interfaces=["eth2"],
        lister=lambda: [InterfaceInfo(name="eth2")],
    )
    await reconciler.set_profile(DCQCN, "c1")
    await reconciler.observe_rdma([port()])  # before any apply: eth2 is not managed yet
    (result,) = await reconciler.reconcile()
    assert result.status == "applied", result.reasons
    assert [e.kind for e in events] == ["qos_applied"]

    await reconciler.observe_rdma([port(marked=100)])  # the first reading of the port
    await reconciler.observe_rdma([port(marked=200)])
    (verdict,) = reconciler.verdicts()
    assert verdict.status == "degraded"
    assert "np_ecn_marked_roce_packets +100 but np_cnp_sent +0" in verdict.reasons[0]
    degraded = events[-1]
    assert degraded.kind == "qos_degraded"
    assert "qos_degraded" in NODE_EVENT_KINDS
    assert (degraded.device, degraded.severity) == ("eth2", "warning")
    assert degraded.attributes["counters"] == "np_ecn_marked_roce_packets np_cnp_sent"
    assert degraded.attributes["status"] == "degraded"
    assert degraded.attributes["profile_version"] == 5
    assert "np_cnp_sent +0" in degraded.message

    await reconciler.observe_rdma([port(marked=300)])  # the same finding: said once
    assert [e.kind for e in events] == ["qos_applied", "qos_degraded"]

    await reconciler.observe_rdma([port(marked=400, sent=9)])
    assert [v.status for v in reconciler.verdicts()] == ["applied"]
    assert events[-1].kind == "qos_applied"
    assert "working again" in events[-1].message
    assert len(events) == 3


async def test_ports_of_unmanaged_interfaces_are_not_judged(tmp_path: Path) -> None:
    mlx5_tree(tmp_path, "eth2")

    async def emit(event: NodeEvent) -> None:
        pass

    reconciler = QosReconciler(
        NodeIdentity(region="r1", cluster="c1", node="n1"),
        emit,
        target=QosTarget(sysfs=str(tmp_path)),
        interfaces=["eth2"],
        lister=lambda: [InterfaceInfo(name="eth2")],
    )
    await reconciler.set_profile(DCQCN, "c1")
    await reconciler.reconcile()
    await reconciler.observe_rdma([port(netdev="eth7")])
    await reconciler.observe_rdma([port(marked=900, netdev="eth7")])
    assert [v.status for v in reconciler.verdicts()] == ["applied"]
