"""What the controller asks of a node's hardware, from its record (controller/core/
remediation.py): a GPU reset once a node waiting for one is drained, a power cycle for a
lost GPU; never for a node an operator holds or while a job runs there. And the job
manager's blame of one GPU's application XID under different jobs (controller/jobs/
blame.py)."""

from __future__ import annotations

from typing import Any

import pytest
from msgspec.structs import replace

from metalguard.controller.core.remediation import gpus_to_reset, remedies, remedy_of
from metalguard.controller.jobs.blame import Failure, suspects, xid_failures
from metalguard.proto.base import AttrValue, NodeIdentity, Reason
from metalguard.proto.nodes import Grade, GradeChange, NodeRecord

NODE = NodeIdentity(region="r1", cluster="c1", node="n1")
RESET = Reason(signal="gpu.reset_required", value=3, rule="gpu_reset_pending", message="m")
RESET_5 = replace(RESET, value=5)
LOST = Reason(signal="gpu.lost", value=0, rule="gpu_xid_reboot", message="XID 79")
ENTERED = 1_800_000_000.0


def record(grade: Grade, reasons: tuple[Reason, ...], **fields: Any) -> NodeRecord:
    history = (GradeChange(ts=ENTERED, grade_from="SUB_HEALTHY", grade_to=grade),)
    defaults: dict[str, Any] = {"running_jobs": 0}
    return NodeRecord(
        node=NODE, grade=grade, reasons=reasons, history=history, **(defaults | fields)
    )


def test_a_drained_node_waiting_for_a_reset_gets_one_for_its_gpus() -> None:
    found = remedy_of(record("MAINTENANCE", (RESET_5, RESET, LOST)))
    assert found is not None
    assert (found.verb, found.gpus) == ("gpu_reset", (3, 5))
    assert found.command_id == f"r1.c1.n1.gpu_reset.{round(ENTERED * 1000)}"
    assert found.reasons == (RESET_5, RESET)


@pytest.mark.parametrize(
    ("why", "node"),
    [
        ("still sub-healthy: jobs may run", record("SUB_HEALTHY", (RESET,))),
        ("a job still counted", record("MAINTENANCE", (RESET,), running_jobs=1)),
        ("the job count not known", record("MAINTENANCE", (RESET,), running_jobs=None)),
        ("an operator's maintenance", record("MAINTENANCE", (RESET,), maintenance=True)),
        ("a held repeat offender", record("MAINTENANCE", (RESET,), held=True)),
        ("nothing waits for a reset", record("MAINTENANCE", ())),
        ("HEALTHY", record("HEALTHY", (RESET,))),
        ("FAILING for something else", record("FAILING", (RESET,))),
    ],
)
def test_no_remedy(why: str, node: NodeRecord) -> None:
    assert remedy_of(node) is None, why


def test_a_lost_gpu_is_power_cycled_once_its_jobs_are_off() -> None:
    found = remedy_of(record("FAILING", (LOST,), running_jobs=None))
    assert found is not None
    assert (found.verb, found.gpus, found.reasons) == ("bmc_power_cycle", (), (LOST,))
    assert remedy_of(record("FAILING", (LOST,), running_jobs=2)) is None


def test_one_id_per_episode_and_verbs_filter() -> None:
    first = record("MAINTENANCE", (RESET,))
    later = replace(
        first,
        history=(
            *first.history,
            GradeChange(ts=ENTERED + 60, grade_from="HEALTHY", grade_to="MAINTENANCE"),
        ),
    )
    a, b = remedy_of(first), remedy_of(later)
    assert a is not None
    assert b is not None
    assert a.command_id != b.command_id
    assert remedy_of(replace(first, score=55.0)) == a  # the same episode: the same id
    records = {"r1.c1.n1": first}
    assert [r.verb for r in remedies(records)] == ["gpu_reset"]
    assert list(remedies(records, frozenset({"bmc_power_cycle"}))) == []


def test_reset_values_must_be_gpu_indices() -> None:
    odd = (replace(RESET, value="x"), replace(RESET, value=-1), replace(RESET, value=2.0))
    assert gpus_to_reset(record("MAINTENANCE", odd)) == (2,)


def test_an_app_xid_blames_each_job_running_there_counted_per_gpu_and_xid() -> None:
    attrs: dict[str, AttrValue] = {"xid": 13, "index": 3, "class": "app"}
    found = xid_failures("n1", attrs, ["b", "a", "a"], 5.0)
    assert [(f.job_id, f.cause) for f in found] == [
        ("a", "XID 13 on gpu3"),
        ("b", "XID 13 on gpu3"),
    ]
    assert xid_failures("n1", {"xid": 48, "index": 3}, ["a"], 5.0) == []  # not app
    assert xid_failures("n1", {"xid": 13}, ["a"], 5.0) == []  # no GPU
    assert xid_failures("n1", {"xid": True, "index": 0}, ["a"], 5.0) == []
    # three jobs, but on three GPUs: no suspect; three on one GPU: one
    spread = [Failure("n1", j, 1.0, f"XID 13 on gpu{i}") for i, j in enumerate("abc")]
    assert suspects(spread, 2.0, 100.0, 3) == {}
    same = [Failure("n1", j, 1.0, "XID 13 on gpu3") for j in "abc"]
    assert suspects(same, 2.0, 100.0, 3) == {"n1": ("a", "b", "c")}
    # failed generations and an XID are counted apart
    mixed = [Failure("n1", "a", 1.0), Failure("n1", "b", 1.0), same[2]]
    assert suspects(mixed, 2.0, 100.0, 3) == {}
