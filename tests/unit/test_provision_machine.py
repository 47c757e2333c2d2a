"""The provisioning state machine (controller/provision/machine.py): transitions with
their reasons and events, the deploy deadline kept across a restart, retry or fail, the
node flagged after N failures, what a node's state is, and the orphan check."""

from __future__ import annotations

import msgspec
import pytest
from msgspec.structs import replace

from metalguard.controller.provision import machine
from metalguard.controller.provision.machine import NodeClaim, VolumeEntry
from metalguard.proto.provision import Instance, InstanceRequest, Volume

N1, N2, N3 = "r1.c1.n01", "r1.c1.n02", "r1.c1.n03"
EXPORT = "0123456789abcdef0123456789abcdef"
T0 = 1000.0


def deploying(node: str = "", *, at: float = T0, export: str = EXPORT) -> Instance:
    req = InstanceRequest(tenant="acme", image="base", node=node)
    return machine.new_instance(req, "i-1", "acme-i-1", export, node or N1, at).instance


def test_a_request_is_deploying_on_its_node_with_a_reason_and_an_event() -> None:
    req = InstanceRequest(tenant="acme", image="base", user_data="echo hi")
    step = machine.new_instance(req, "i-1", "acme-i-1", EXPORT, N1, T0)
    inst = step.instance
    assert (inst.state, inst.node, inst.volume, inst.attempts) == ("deploying", N1, "acme-i-1", 1)
    assert not inst.pinned
    assert inst.user_data == "echo hi"
    assert [(t.state, t.node) for t in inst.history] == [("deploying", N1)]
    assert "chosen" in inst.history[0].reason
    (event,) = step.emits
    assert event.kind == "instance.deploying"
    assert event.attributes == {
        "instance": "i-1",
        "tenant": "acme",
        "image": "base",
        "volume": "acme-i-1",
        "node": N1,
        "state": "deploying",
    }
    assert event.node == N1


def test_a_request_naming_its_node_is_pinned() -> None:
    inst = deploying(N2)
    assert inst.pinned
    assert inst.node == N2
    assert inst.history[0].reason == f"requested on {N2}"


def test_active_only_on_the_ready_report_with_what_it_said() -> None:
    inst = deploying()
    step = machine.activated(inst, {"boot_id": "b1", "kernel": "6.1"}, T0 + 7.5)
    active = step.instance
    assert active.state == "active"
    assert active.ready_ts == T0 + 7.5
    assert active.ready_report == {"boot_id": "b1", "kernel": "6.1"}
    (event,) = step.emits
    assert event.kind == "instance.active"
    assert event.attributes["boot_s"] == 7.5
    assert machine.deadline(active, 60) is None


def test_the_deadline_is_the_boot_start_plus_the_timeout_and_survives_a_restart() -> None:
    inst = deploying(at=T0)
    assert machine.deadline(inst, 60) == T0 + 60
    assert not machine.timed_out(inst, T0 + 59.9, 60)
    assert machine.timed_out(inst, T0 + 60, 60)
    # what a restarted controller reads back from KV: the same record, the same deadline
    stored = msgspec.msgpack.decode(msgspec.msgpack.encode(inst), type=Instance)
    assert machine.deadline(stored, 60) == T0 + 60


def test_a_retry_moves_the_deadline_to_the_new_boot() -> None:
    inst = deploying(at=T0)
    retry = machine.redeployed(inst, N2, "f" * 32, T0 + 60, "timed out; retrying").instance
    assert machine.deadline(retry, 60) == T0 + 120
    assert retry.attempts == 2
    assert retry.export == "f" * 32
    assert machine.tried_nodes(retry) == {N1, N2}


def test_timeout_retries_an_unpinned_deploy_while_attempts_remain() -> None:
    inst = deploying()
    assert machine.on_timeout(inst, 3) == "retry"
    assert machine.on_timeout(replace(inst, attempts=3), 3) == "fail"
    assert machine.on_timeout(deploying(N1), 3) == "fail"  # pinned
    active = machine.activated(inst, {}, T0 + 1).instance
    switching = machine.switching(active, "beta", "base", "beta-i-1", "e" * 32, "", T0 + 2)
    assert machine.on_timeout(switching.instance, 3) == "fail"  # a switch stays on its node


def test_deploy_failed_drops_the_export_and_keeps_the_reason() -> None:
    step = machine.deploy_failed(deploying(), T0 + 60, "no ready report from n01 within 60s")
    failed = step.instance
    assert (failed.state, failed.export) == ("deploy_failed", "")
    assert failed.error == "no ready report from n01 within 60s"
    assert failed.history[-1].reason == failed.error
    assert step.emits[0].kind == "instance.deploy_failed"


def test_a_switch_changes_tenant_volume_and_export_and_says_from_what() -> None:
    active = machine.activated(deploying(), {"boot_id": "a"}, T0 + 5).instance
    step = machine.switching(active, "beta", "base2", "beta-v", "e" * 32, "run-b", T0 + 10)
    sw = step.instance
    assert (sw.state, sw.tenant, sw.image, sw.volume) == ("switching", "beta", "base2", "beta-v")
    assert (sw.export, sw.user_data, sw.ready_ts, sw.ready_report) == ("e" * 32, "run-b", None, {})
    assert "acme (acme-i-1)" in sw.history[-1].reason
    assert step.emits[0].attributes["previous_tenant"] == "acme"
    assert machine.deadline(sw, 30) == T0 + 40


def test_a_rollback_restores_the_record_and_keeps_the_history() -> None:
    active = machine.activated(deploying(), {}, T0 + 5).instance
    sw = machine.switching(active, "beta", "base", "beta-v", "e" * 32, "", T0 + 10).instance
    back = machine.restored(sw, active, T0 + 11, "bmc_pxe_once: no answer")
    assert (back.state, back.tenant, back.volume, back.export) == (
        "active",
        "acme",
        "acme-i-1",
        EXPORT,
    )
    assert [t.state for t in back.history] == ["deploying", "active", "switching", "active"]
    assert back.history[-1].reason == "rolled back: bmc_pxe_once: no answer"


def test_a_replacement_announces_the_old_and_new_node() -> None:
    active = machine.activated(deploying(), {}, T0 + 5).instance
    step = machine.redeployed(active, N3, "d" * 32, T0 + 20, f"replacing {N1}", replacing=True)
    assert step.instance.state == "deploying"
    assert step.instance.ready_ts is None
    kinds = [e.kind for e in step.emits]
    assert kinds == ["instance.deploying", "instance.replaced"]
    assert step.emits[1].attributes["previous_node"] == N1
    assert step.emits[1].attributes["node"] == N3


def test_release_keeps_the_order_and_drops_the_export() -> None:
    active = machine.activated(deploying(), {}, T0 + 5).instance
    rel = machine.releasing(active, T0 + 30, keep_volume=False)
    assert rel.instance.state == "releasing"
    assert rel.emits[0].attributes["keep"] is False
    done = machine.released(rel.instance, T0 + 31, "powered off; volume deleted")
    assert (done.instance.state, done.instance.export) == ("released", "")
    assert [t.state for t in done.instance.history][-2:] == ["releasing", "released"]


def test_a_failing_node_marks_its_active_instance_once() -> None:
    active = machine.activated(deploying(), {}, T0 + 5).instance
    step = machine.node_failing(active, "FAILING", T0 + 40)
    assert step is not None
    marked = step.instance
    assert marked.state == "active"
    assert "replace" in marked.error
    assert step.emits[0].kind == "instance.node_failing"
    assert step.emits[0].attributes["grade"] == "FAILING"
    assert machine.node_failing(marked, "FAILING", T0 + 41) is None


def test_event_ids_are_deterministic_per_transition() -> None:
    a = machine.new_instance(InstanceRequest(tenant="t", image="i"), "x", "v", EXPORT, N1, T0)
    b = machine.new_instance(InstanceRequest(tenant="t", image="i"), "x", "v", EXPORT, N1, T0)
    assert a.emits[0].event_id == b.emits[0].event_id
    later = machine.activated(a.instance, {}, T0 + 1)
    assert later.emits[0].event_id != a.emits[0].event_id


def test_history_is_bounded() -> None:
    inst = deploying()
    for n in range(machine.HISTORY_MAX + 10):
        inst = machine.transition(inst, "active", T0 + n, f"step {n}")
    assert len(inst.history) == machine.HISTORY_MAX
    assert inst.history[-1].reason == f"step {machine.HISTORY_MAX + 9}"


def test_command_ids_are_per_boot_and_never_carry_the_secret() -> None:
    inst = deploying()
    first = machine.command_id(inst, "boot")
    assert first == machine.command_id(inst, "boot")  # a re-send: the BMC answers from memory
    assert EXPORT not in first
    assert EXPORT[:12] not in first
    assert first.startswith("i-1.")
    other = machine.command_id(replace(inst, export="f" * 32), "boot")
    assert other != first


@pytest.mark.parametrize(
    ("failures", "max_failures", "flagged", "announced"),
    [(0, 3, False, False), (1, 3, False, False), (2, 3, True, True), (0, 0, False, False)],
)
def test_a_failed_deploy_frees_the_node_and_flags_it_at_max_failures(
    failures: int, max_failures: int, flagged: bool, announced: bool
) -> None:
    claim = NodeClaim(node=N1, instance_id="i-1", failures=failures)
    new, event = machine.claim_failed(claim, max_failures, T0)
    assert new.instance_id == ""
    assert new.failures == failures + 1
    assert new.flagged is flagged
    assert (event is not None) is announced
    if event is not None:
        assert event.kind == "node.provision_flagged"
        assert event.attributes == {"node": N1, "failures": 3}


def test_a_flagged_node_is_announced_only_once() -> None:
    claim = NodeClaim(node=N1, instance_id="i-9", failures=3, flagged=True)
    new, event = machine.claim_failed(claim, 3, T0)
    assert new.flagged
    assert new.failures == 4
    assert event is None


@pytest.mark.parametrize(
    ("grade", "cordoned", "claim", "known", "why"),
    [
        ("HEALTHY", False, None, True, None),
        ("HEALTHY", False, NodeClaim(node=N1), True, None),
        ("HEALTHY", False, None, False, "not a provisioned node"),
        (None, False, None, True, "unknown to the controller"),
        ("FAILING", False, None, True, "FAILING, not HEALTHY"),
        ("SUB_HEALTHY", False, None, True, "SUB_HEALTHY, not HEALTHY"),
        ("UNREACHABLE", False, None, True, "UNREACHABLE, not HEALTHY"),
        ("HEALTHY", True, None, True, "cordoned"),
        ("HEALTHY", False, NodeClaim(node=N1, failures=3, flagged=True), True, "flagged"),
        ("HEALTHY", False, NodeClaim(node=N1, instance_id="i-7"), True, "instance i-7"),
    ],
)
def test_only_healthy_uncordoned_free_known_nodes_are_deployable(
    grade: str | None, cordoned: bool, claim: NodeClaim | None, known: bool, why: str | None
) -> None:
    got = machine.why_not_deployable(N1, grade, cordoned, claim, known)
    if why is None:
        assert got is None
    else:
        assert got is not None
        assert why in got


@pytest.mark.parametrize(
    ("posture", "sensitive", "deployable"),
    [
        ("isolated", True, True),
        ("shared", True, False),
        ("off", True, False),
        ("unknown", True, False),
        ("", True, False),  # never reported
        ("shared", False, True),  # only a sensitive instance minds
    ],
)
def test_a_sensitive_instance_needs_a_dma_isolated_node(
    posture: str, sensitive: bool, deployable: bool
) -> None:
    got = machine.why_not_deployable(
        N1, "HEALTHY", False, None, True, sensitive=sensitive, dma_posture=posture
    )
    assert (got is None) == deployable, got
    if not deployable:
        assert got is not None
        assert "a sensitive instance needs an isolated node" in got
        assert f"({posture or 'not reported'})" in got


def test_a_sensitive_request_makes_a_sensitive_instance() -> None:
    req = InstanceRequest(tenant="t1", image="img", sensitive=True)
    step = machine.new_instance(req, "i-1", "vol", "exp", N1, 10.0)
    assert step.instance.sensitive


def test_a_nodes_provision_state_follows_its_instance() -> None:
    inst = deploying()
    claim = NodeClaim(node=N1, instance_id="i-1")
    assert machine.node_state(None, None) == "available"
    assert machine.node_state(claim, inst) == "deploying"
    active = machine.activated(inst, {}, T0 + 1).instance
    assert machine.node_state(claim, active) == "active"
    sw = machine.switching(active, "b", "base", "b-v", "e" * 32, "", T0 + 2).instance
    assert machine.node_state(claim, sw) == "deploying"
    rel = machine.releasing(active, T0 + 3, True).instance
    assert machine.node_state(claim, rel) == "releasing"
    assert machine.node_state(NodeClaim(node=N1, flagged=True), None) == "deploy_failed"
    # a record of an instance that does not hold the node says nothing about it
    assert machine.node_state(NodeClaim(node=N1, instance_id="i-2"), inst) == "available"


def test_pick_node_is_sorted_without_the_excluded() -> None:
    assert machine.pick_node([N3, N1, N2], exclude=[N1]) == [N2, N3]


def _entry(created_by: str = "i-1", booted: bool = False, used_by: str = "") -> VolumeEntry:
    vol = Volume(name="acme-i-1", tenant="acme", image="base")
    return VolumeEntry(volume=vol, used_by=used_by, created_by=created_by, booted=booted)


def test_a_failed_deploy_deletes_only_the_fresh_volume_it_made() -> None:
    assert machine.delete_on_failure(_entry(), "i-1")
    assert not machine.delete_on_failure(_entry(booted=True), "i-1")  # the tenant's data
    assert not machine.delete_on_failure(_entry(created_by=""), "i-1")  # a given volume
    assert not machine.delete_on_failure(_entry(created_by="i-2"), "i-1")
    assert not machine.delete_on_failure(None, "i-1")


def test_orphans_none_when_everything_is_owned() -> None:
    inst = deploying()
    entries = {"acme-i-1": _entry(used_by="i-1")}
    claims = {N1: NodeClaim(node=N1, instance_id="i-1"), N2: NodeClaim(node=N2)}
    assert machine.orphans([inst], ["acme-i-1"], entries, [EXPORT], claims) == []


def test_orphans_name_each_leftover() -> None:
    gone = machine.deploy_failed(deploying(), T0 + 60, "timeout").instance
    entries = {"acme-i-1": _entry(used_by="i-1"), "lost": _entry(created_by="")}
    claims = {N1: NodeClaim(node=N1, instance_id="i-1")}
    found = machine.orphans([gone], ["acme-i-1", "stray"], entries, [EXPORT], claims)
    assert any(p.startswith("export 012345...") for p in found)
    assert "volume stray has no record" in found
    assert "volume record lost has no volume" in found
    assert "volume acme-i-1 used by i-1, which is not live" in found
    assert f"node {N1} claimed by i-1, which is not live" in found
    assert all(EXPORT not in p for p in found)  # the secret is not printed
