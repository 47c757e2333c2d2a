"""Parsing what Slurm 22.05's own tools print (tests/fixtures/slurm, captured from the
real one-node cluster of tests/support/harness/slurm_cluster.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from metalguard.controller.slurm.parse import (
    SlurmJob,
    SlurmNode,
    SlurmParseError,
    expand_hostlist,
    parse_scontrol_nodes,
    parse_sinfo_json,
    parse_squeue_json,
    parse_squeue_text,
)

FIXTURES = Path(__file__).parents[1] / "fixtures" / "slurm"
REASON = "metalguard: node.isolated: ecc_uncorrectable on DIMM_A1"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def test_sinfo_json_gives_state_flags_and_reason() -> None:
    nodes = {n.name: n for n in parse_sinfo_json(fixture("sinfo.json"))}
    assert nodes["mgnode1"] == SlurmNode("mgnode1", "MIXED", frozenset({"DRAIN"}), REASON)
    assert nodes["mgnode1"].drained
    assert not nodes["mgnode1"].down
    down = nodes["mgnode2"]
    assert down == SlurmNode("mgnode2", "DOWN", frozenset({"NOT_RESPONDING"}), "operator: psu swap")
    assert down.down
    assert down.describe() == "DOWN+NOT_RESPONDING"


def test_sinfo_json_not_responding_alone_counts_as_down() -> None:
    nodes = {n.name: n for n in parse_sinfo_json(fixture("sinfo_not_responding.json"))}
    assert nodes["mgnode2"].state == "IDLE"
    assert nodes["mgnode2"].down
    assert not nodes["mgnode1"].down
    assert not nodes["mgnode1"].drained


def test_sinfo_json_of_newer_slurm_lists_flags_in_state() -> None:
    text = '{"nodes": [{"name": "g1", "state": ["IDLE", "DRAIN"], "reason": "x"}]}'
    assert parse_sinfo_json(text) == (SlurmNode("g1", "IDLE", frozenset({"DRAIN"}), "x"),)


def test_squeue_json_gives_jobs_with_their_nodes() -> None:
    jobs = {j.job_id: j for j in parse_squeue_json(fixture("squeue.json"))}
    assert jobs["4"] == SlurmJob("4", "RUNNING", ("mgnode1",), requeue=True, batch=True)
    assert jobs["4"].active
    assert jobs["5"] == SlurmJob("5", "PENDING", (), requeue=True, batch=True)
    assert not jobs["5"].active


def test_scontrol_text_matches_the_json_view() -> None:
    text_nodes = parse_scontrol_nodes(fixture("scontrol_show_node.txt"))
    assert text_nodes == parse_sinfo_json(fixture("sinfo.json"))


def test_squeue_text_matches_the_json_view() -> None:
    assert parse_squeue_text(fixture("squeue.txt")) == (
        SlurmJob("5", "PENDING", ()),
        SlurmJob("4", "RUNNING", ("mgnode1",)),
    )


def test_scontrol_star_suffix_means_not_responding() -> None:
    (node,) = parse_scontrol_nodes("NodeName=g7 Arch=x86_64 State=IDLE* Weight=1\n")
    assert node == SlurmNode("g7", "IDLE", frozenset({"NOT_RESPONDING"}), "")


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("", ()),
        ("mgnode1", ("mgnode1",)),
        ("gpu[01-03,7]", ("gpu01", "gpu02", "gpu03", "gpu7")),
        ("a[1-2],b3,c[9-10]-ib", ("a1", "a2", "b3", "c9-ib", "c10-ib")),
    ],
)
def test_hostlists_expand(expr: str, names: tuple[str, ...]) -> None:
    assert expand_hostlist(expr) == names


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("not json", "not JSON"),
        ('{"errors": [{"error": "boom"}], "nodes": []}', "Slurm reports errors"),
        ('{"nodes": [{"state": "idle"}]}', "without a name"),
        ("[]", "expected an object"),
    ],
)
def test_bad_sinfo_output_is_a_parse_error(text: str, problem: str) -> None:
    with pytest.raises(SlurmParseError, match=problem):
        parse_sinfo_json(text)


def test_bad_text_is_a_parse_error() -> None:
    with pytest.raises(SlurmParseError, match=r"4 '\|'-separated"):
        parse_squeue_text("12|RUNNING\n")
    with pytest.raises(SlurmParseError, match="no NodeName"):
        parse_scontrol_nodes("Arch=x86_64\n")
    with pytest.raises(SlurmParseError, match="bad range"):
        expand_hostlist("g[a-b]")
