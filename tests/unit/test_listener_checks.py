"""The pure checks behind the listeners' answers to bad messages (issue 16, item 5): the
bmc-proxy refuses a command without an id, the job manager takes a node's job event only
on that node's subject, and NodeLookupReply's ``error``/``reasons`` stay compatible with
controllers that predate them."""

from __future__ import annotations

import msgspec

from metalguard.agent.bmc.commands import check_command
from metalguard.agent.bmc.targets import BmcTarget
from metalguard.controller.jobs.manager import on_its_subject
from metalguard.proto.base import Message, NodeIdentity
from metalguard.proto.codec import decode, encode
from metalguard.proto.events import Command, NodeEvent
from metalguard.proto.federation import NodeLookupReply
from metalguard.proto.nodes import NodeRecord
from metalguard.proto.subjects import Subjects

S = Subjects("mg")
N0 = NodeIdentity(region="r1", cluster="c1", node="n0")


def test_a_bmc_command_without_an_id_is_refused() -> None:
    target = BmcTarget(node="r1.c1.n0", address="10.0.0.1", protocol="redfish", credentials="c")

    def why(command_id: str) -> str | None:
        cmd = Command(command_id=command_id, ts=0.0, node=N0, verb="bmc_pxe_once")
        return check_command(cmd, "bmc_pxe_once", target, now=1.0)

    assert why("ops-1") is None
    for empty in ("", "   "):
        assert "command_id is empty" in (why(empty) or "")


def test_a_job_event_counts_only_on_its_own_nodes_subject() -> None:
    event = NodeEvent(node=N0, event_id="e", ts=0.0, kind="job_progress")
    assert on_its_subject(S, S.node_event("r1", "c1", "n0", "job_progress"), event)
    for subject in (
        S.node_event("r1", "c1", "n1", "job_progress"),  # another node's
        S.node_event("r1", "c2", "n0", "job_progress"),
        S.node_event("r2", "c1", "n0", "job_progress"),
        S.telemetry("r1", "c1", "n0"),  # not an event subject
        "not..a subject",
    ):
        assert not on_its_subject(S, subject, event), subject


class OldNodeLookupReply(Message, frozen=True, tag="node_lookup_reply"):
    """NodeLookupReply as controllers before ``error`` and ``reasons`` had it."""

    uuid: str
    found: bool
    region: str = ""
    handle: str = ""
    record: NodeRecord | None = None


def test_an_older_controller_reads_a_rejected_lookup_as_not_found() -> None:
    new = NodeLookupReply(uuid="", found=False, region="r1", error="rejected", reasons=("x",))
    old = msgspec.msgpack.decode(encode(new), type=OldNodeLookupReply)
    assert (old.found, old.region) == (False, "r1")


def test_an_older_controllers_answer_reads_as_no_error() -> None:
    old = OldNodeLookupReply(uuid="u", found=True, region="r2", handle="r2.c1.n0")
    new = decode(msgspec.msgpack.encode(old), NodeLookupReply)
    assert (new.found, new.handle, new.error, new.reasons) == (True, "r2.c1.n0", "", ())
