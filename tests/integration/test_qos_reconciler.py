"""The reconciler in namespace A of a veth pair (root only), with a fake mlx5 sysfs tree:
a failed apply restores the last state that verified, and is not retried every pass."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec

from metalguard.agent.collectors.netdev import _LABELS, ClassLabel
from metalguard.agent.qos import tc_backend
from metalguard.agent.qos.apply import QosTarget
from metalguard.agent.qos.reconciler import QosReconciler
from metalguard.proto.base import NodeIdentity
from metalguard.proto.events import NodeEvent
from metalguard.proto.qos import QosProfile, decode_profile
from tests.support.clock import ManualClock
from tests.support.harness.qos_netns import (
    TRAINING_CLASS,
    VethPair,
    needs_root,
    profile_text,
)

pytestmark = needs_root
NODE = NodeIdentity(region="r1", cluster="c1", node="n1")


def with_dcqcn(version: int, cnp_dscp: int, training_share: int = 50) -> QosProfile:
    text = profile_text(version, default_share=90 - training_share, training_share=training_share)
    text = text.replace(
        "[[traffic_class]]", f"[dcqcn]\nnp = {{ cnp_dscp = {cnp_dscp} }}\n" + "[[traffic_class]]", 1
    )
    if version == 2:  # a knob the fake driver refuses (a directory where the file should be)
        text = text.replace("np = {", "rp = { rpg_time_reset = 5 }\nnp = {")
    return decode_profile(text, "toml")


def knob(sysfs: Path, ifname: str, side: str, name: str) -> str:
    return (sysfs / "class/net" / ifname / "ecn" / f"roce_{side}" / name).read_text().strip()


class Recorder:
    def __init__(self) -> None:
        self.events: list[NodeEvent] = []

    async def __call__(self, event: NodeEvent) -> None:
        self.events.append(event)

    def kinds(self) -> list[str]:
        return [e.kind for e in self.events]


async def rate(pair: VethPair) -> int:
    state = await asyncio.to_thread(tc_backend.read_state, pair.if_a, pair.ns_a)
    return state.classes[TRAINING_CLASS][0] if state.root == "htb 1:" else -1


async def test_failed_apply_restores_the_last_verified_state(
    pair: VethPair, tmp_path: Path
) -> None:
    ecn = tmp_path / "class/net" / pair.if_a / "ecn"
    (ecn / "roce_np").mkdir(parents=True)
    (ecn / "roce_np/cnp_dscp").write_text("0\n")
    (ecn / "roce_rp/rpg_time_reset").mkdir(parents=True)  # writing it fails
    recorder = Recorder()
    clock = ManualClock()
    reconciler = QosReconciler(
        NODE,
        recorder,
        target=QosTarget(netns=pair.ns_a, sysfs=str(tmp_path)),
        interfaces=[pair.if_a],
        wall_clock=clock,
    )
    # v1 applies (partial: dcb and ECN unsupported here) and verifies.
    await reconciler.set_profile(with_dcqcn(1, cnp_dscp=48), "c1")
    [first] = await reconciler.reconcile()
    assert first.status == "partial", first.reasons
    assert recorder.kinds() == ["qos_partial"]
    assert knob(tmp_path, pair.if_a, "np", "cnp_dscp") == "48"
    assert await rate(pair) == 500_000
    assert reconciler.class_labels() == {
        pair.if_a: {
            "1:10": ("default", False),
            "1:11": ("training", True),  # serves PFC priority 3
            "1:12": ("control", False),
        }
    }
    assert _LABELS[pair.if_a][TRAINING_CLASS] == ClassLabel("training", lossless=True)

    # v2 fails on the refused knob: reported, and v1 is restored (tc and knobs).
    await reconciler.set_profile(with_dcqcn(2, cnp_dscp=40, training_share=60), "c1")
    [second] = await reconciler.reconcile()
    assert second.status == "failed"
    assert recorder.kinds() == ["qos_partial", "qos_failed"]
    failed = recorder.events[1]
    assert failed.attributes["restored_version"] == 1
    assert failed.message.startswith(
        f"profile version 2 failed on {pair.if_a} (restored version 1)"
    )
    assert failed.severity == "critical"
    assert "cannot write roce_rp/rpg_time_reset" in str(failed.attributes["reasons"])
    assert failed.attributes["profile_version"] == 2
    assert knob(tmp_path, pair.if_a, "np", "cnp_dscp") == "48"
    assert await rate(pair) == 500_000
    assert reconciler.status()[pair.if_a].status == "failed"

    # The same failing plan is not re-applied every pass (no flapping), but the restored
    # state is still guarded against drift.
    count = len(recorder.events)
    await reconciler.reconcile()
    assert len(recorder.events) == count
    await asyncio.to_thread(tc_backend.clear, pair.if_a, pair.ns_a)
    await reconciler.reconcile()
    assert recorder.kinds()[count:] == ["qos_drift", "qos_partial"]
    assert await rate(pair) == 500_000

    # A fixed profile applies again.
    await reconciler.set_profile(with_dcqcn(3, cnp_dscp=40, training_share=60), "c1")
    [third] = await reconciler.reconcile()
    assert third.status == "partial", third.reasons
    assert knob(tmp_path, pair.if_a, "np", "cnp_dscp") == "40"
    assert await rate(pair) == 600_000
    assert reconciler.status()[pair.if_a].status == "partial"
    assert all(e.ts == clock.now for e in recorder.events)


async def test_failure_without_a_verified_state_leaves_the_kernel_default(
    pair: VethPair, tmp_path: Path
) -> None:
    (tmp_path / "class/net" / pair.if_a / "ecn/roce_rp/rpg_time_reset").mkdir(parents=True)
    (tmp_path / "class/net" / pair.if_a / "ecn/roce_np").mkdir(parents=True)
    (tmp_path / "class/net" / pair.if_a / "ecn/roce_np/cnp_dscp").write_text("0\n")
    recorder = Recorder()
    reconciler = QosReconciler(
        NODE,
        recorder,
        target=QosTarget(netns=pair.ns_a, sysfs=str(tmp_path)),
        interfaces=[pair.if_a],
    )
    await reconciler.set_profile(with_dcqcn(2, cnp_dscp=40), "c1")
    [result] = await reconciler.reconcile()
    assert result.status == "failed"
    assert recorder.kinds() == ["qos_failed"]
    assert recorder.events[0].attributes["restored_version"] is None
    assert "(back to the kernel's default)" in recorder.events[0].message
    assert await rate(pair) == -1  # the htb root is gone again
    assert pair.if_a not in _LABELS


async def test_invalid_profile_is_reported_and_nothing_changes(pair: VethPair) -> None:
    recorder = Recorder()
    reconciler = QosReconciler(
        NODE, recorder, target=QosTarget(netns=pair.ns_a), interfaces=[pair.if_a]
    )
    bad = decode_profile(profile_text(1), "toml")
    bad = msgspec.structs.replace(bad, pfc_priorities=(3, 3))
    await reconciler.set_profile(bad, "c1")
    assert await reconciler.reconcile() == []
    assert recorder.kinds() == ["qos_failed"]
    assert "pfc_priorities[1]: priority 3 is listed twice" in str(
        recorder.events[0].attributes["reasons"]
    )
    assert await rate(pair) == -1
