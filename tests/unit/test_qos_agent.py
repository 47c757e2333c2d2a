"""The agent's QoS wiring that needs no root: ``[qos]`` config, a missing namespace."""

from __future__ import annotations

from pathlib import Path

import pytest

from metalguard.agent.config import ConfigError, parse_config
from metalguard.agent.qos.apply import QosTarget, apply_plan
from metalguard.agent.qos.plan import InterfaceInfo, plan_interface
from metalguard.agent.qos.reconciler import QosReconciler
from metalguard.agent.qos.tc_backend import NETNS_DIR
from metalguard.proto.base import NodeIdentity
from metalguard.proto.events import NODE_EVENT_KINDS, NodeEvent
from metalguard.proto.qos import decode_profile

PROFILE = decode_profile(
    "version = 4\nlink_rate_mbit = 100\n"
    "[[traffic_class]]\nname = 'all'\npriorities = [0]\nbandwidth_percent = 100",
    "toml",
)
MISSING_NS = "mgtq-never-created"


def test_qos_config_section() -> None:
    config = parse_config(
        "[qos]\nenabled = true\nreconcile_interval_s = 2.5\ninterfaces = ['eth2']\n"
        "netns = 'ns1'\nsysfs = '/tmp/sys'\n"
    )
    assert config.qos.enabled is True
    assert config.qos.reconcile_interval_s == 2.5
    assert config.qos.interfaces == ("eth2",)
    assert (config.qos.netns, config.qos.sysfs) == ("ns1", "/tmp/sys")
    assert parse_config("").qos.enabled is False
    with pytest.raises(ConfigError, match=r"agent.toml: qos.intervall: unknown key"):
        parse_config("[qos]\nintervall = 3", "agent.toml")
    with pytest.raises(ConfigError, match=r"qos.reconcile_interval_s: Expected `float` >= 0.1"):
        parse_config("[qos]\nreconcile_interval_s = 0")


def test_event_kinds_are_registered() -> None:
    assert {"qos_applied", "qos_partial", "qos_unsupported", "qos_failed", "qos_drift"} <= (
        NODE_EVENT_KINDS
    )


def test_a_missing_namespace_fails_and_is_not_created() -> None:
    result = apply_plan(
        plan_interface(PROFILE, InterfaceInfo(name="eth0")), QosTarget(netns=MISSING_NS)
    )
    assert result.status == "failed"
    assert result.reasons == [
        f"no network namespace '{MISSING_NS}' ({NETNS_DIR / MISSING_NS} is missing)"
    ]
    assert not (NETNS_DIR / MISSING_NS).exists()


async def test_reconciler_reports_a_missing_namespace_once(tmp_path: Path) -> None:
    events: list[NodeEvent] = []

    async def emit(event: NodeEvent) -> None:
        events.append(event)

    reconciler = QosReconciler(
        NodeIdentity(region="r1", cluster="c1", node="n1"),
        emit,
        target=QosTarget(netns=MISSING_NS, sysfs=str(tmp_path)),
    )
    await reconciler.set_profile(PROFILE, "c1")
    assert await reconciler.reconcile() == []
    assert await reconciler.reconcile() == []
    assert [e.kind for e in events] == ["qos_failed"]
    assert events[0].message.startswith("cannot list the interfaces: no network namespace")
    assert events[0].attributes["profile_version"] == 4
    assert reconciler.passes == 2
    assert not (NETNS_DIR / MISSING_NS).exists()
