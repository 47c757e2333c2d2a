"""The tc and dcb backends and ``agent qos apply`` in two network namespaces joined by a
veth pair the test creates (root only; removed afterwards even on failure)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from metalguard.agent.qos import tc_backend
from metalguard.agent.qos.apply import QosTarget, apply_plan, verify
from metalguard.agent.qos.plan import InterfaceInfo, plan_interface
from metalguard.proto.qos import QosProfile, decode_profile
from tests.support.harness.qos_netns import (
    DEFAULT_CLASS,
    TRAINING_CLASS,
    VethPair,
    needs_root,
    profile_text,
    send,
)

METALGUARD = str(Path(sys.executable).parent / "metalguard")
pytestmark = needs_root


def profile(version: int = 1, **shares: int) -> QosProfile:
    return decode_profile(profile_text(version, **shares), "toml")


def tc_text(pair: VethPair) -> str:
    """``tc qdisc/class/filter show`` of A's end, as iproute2 prints it."""
    out = []
    for what in ("qdisc", "class", "filter"):
        done = subprocess.run(
            ["tc", "-n", pair.ns_a, what, "show", "dev", pair.if_a],
            capture_output=True,
            text=True,
            check=True,
        )
        out.append(done.stdout)
    return "".join(out)


def red_missing(reasons: list[str]) -> bool:
    return any("RED qdisc unavailable" in r for r in reasons)


def test_tc_backend_classifies_dscp_into_classes(pair: VethPair) -> None:
    target = QosTarget(netns=pair.ns_a)
    plan = plan_interface(profile(), InterfaceInfo(name=pair.if_a))
    result = apply_plan(plan, target)
    # dcb on veth: unsupported. ECN: unsupported where the kernel lacks RED.
    assert result.status == "partial", result.reasons
    assert any("dcb: the driver has no DCB support" in r for r in result.reasons)
    assert result.expected.tc is not None
    if red_missing(result.reasons):
        assert result.expected.tc.leaves[TRAINING_CLASS] == "pfifo"
    else:  # a kernel with RED applies the ECN marking
        assert result.expected.tc.leaves[TRAINING_CLASS] == "red"
    assert result.differences == ()
    state = tc_backend.read_state(pair.if_a, pair.ns_a)
    assert state.root == "htb 1:"
    assert state.classes[TRAINING_CLASS][:2] == (500_000, 1_000_000)
    assert ("ip", 26, TRAINING_CLASS) in state.filters

    before = tc_backend.class_stats(pair.if_a, pair.ns_a)
    send(pair, 26, 40)
    send(pair, 0, 25)
    after = tc_backend.class_stats(pair.if_a, pair.ns_a)
    grew = {cid: after[cid].packets - before[cid].packets for cid in after}
    assert grew[TRAINING_CLASS] == 40, grew
    assert grew[DEFAULT_CLASS] >= 25, grew  # (+ IPv6 ND / MLD of the link, if any)
    assert grew["1:12"] == 0, grew

    # Read-back sees someone else's change.
    subprocess.run(
        ["tc", "-n", pair.ns_a, "class", "change", "dev", pair.if_a, "parent", "1:1",
         "classid", TRAINING_CLASS, "htb", "rate", "1mbit", "ceil", "1000mbit"],
        check=True,
    )  # fmt: skip
    assert verify(pair.if_a, result.expected, target) == [
        f"{pair.if_a}: class {TRAINING_CLASS}: expected rate 500000kbit ceil 1000000kbit "
        "prio 1, found rate 1000kbit ceil 1000000kbit prio 0"
    ]


def test_dcb_on_veth_is_unsupported_without_error(pair: VethPair) -> None:
    text = "version = 1\npfc_priorities = [3]\ndscp_map = { 26 = 3 }"
    result = apply_plan(
        plan_interface(decode_profile(text, "toml"), InterfaceInfo(name=pair.if_a)),
        QosTarget(netns=pair.ns_a),
    )
    assert result.status == "unsupported"
    [reason] = result.reasons
    assert reason.startswith(f"{pair.if_a}: dcb: the driver has no DCB support (")
    assert "Operation not supported" in reason


def test_missing_interface_fails_with_reason(pair: VethPair) -> None:
    result = apply_plan(
        plan_interface(profile(), InterfaceInfo(name="tqnope0")), QosTarget(netns=pair.ns_a)
    )
    assert result.status == "failed"
    assert "tqnope0: no such interface" in result.reasons


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [METALGUARD, "agent", "qos", "apply", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_dry_run_prints_the_plan_and_changes_nothing(pair: VethPair, tmp_path: Path) -> None:
    path = tmp_path / "profile.toml"
    path.write_text(profile_text(version=3))
    before_text = tc_text(pair)
    before = tc_backend.read_state(pair.if_a, pair.ns_a)
    args = ["--profile", str(path), "--netns", pair.ns_a, "--interface", pair.if_a]
    done = run_cli(*args, "--dry-run")
    assert done.returncode == 0, done.stderr
    assert f"interface {pair.if_a} (profile version 3)" in done.stdout
    assert f"tc: htb root 1: default {DEFAULT_CLASS}" in done.stdout
    assert f"filter u32 dscp 26 -> {TRAINING_CLASS}" in done.stdout
    assert tc_backend.read_state(pair.if_a, pair.ns_a) == before
    assert tc_text(pair) == before_text
    assert "htb" not in before_text

    # Without --dry-run the same command applies it and says how it went.
    done = run_cli(*args)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"{pair.if_a}: partial (profile version 3)")
    assert tc_backend.read_state(pair.if_a, pair.ns_a).root == "htb 1:"


def test_cli_rejects_an_invalid_profile(pair: VethPair, tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(profile_text(default_share=45))
    done = run_cli("--profile", str(path), "--netns", pair.ns_a, "--dry-run")
    assert done.returncode == 2
    assert f"{path}: traffic_class: bandwidth_percent shares sum to 105, must be 100" in done.stderr
