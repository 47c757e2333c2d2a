"""The one-node Slurm of tests/support/harness/slurm_cluster.py runs a batch job, and the
fallback parsers (no ``--json``) read this Slurm's text as its JSON."""

from __future__ import annotations

import time

import pytest

from metalguard.controller.slurm.parse import (
    SQUEUE_TEXT_FORMAT,
    parse_scontrol_nodes,
    parse_squeue_text,
)
from tests.support.harness.slurm_cluster import DEAD_NODE, NODE, START_DEADLINE_S, SlurmCluster

# One real Slurm (munged, slurmctld, slurmd) on the host at a time.
pytestmark = pytest.mark.xdist_group("slurm")


def test_the_one_node_cluster_runs_a_batch_job(slurm: SlurmCluster) -> None:
    out = slurm.root / "hello.out"
    slurm.run("sbatch", "-o", str(out), "--wrap", "echo hello from $SLURMD_NODENAME")
    deadline = time.monotonic() + START_DEADLINE_S
    while "hello" not in (out.read_text() if out.exists() else ""):
        assert time.monotonic() < deadline, f"the job never ran: {slurm.logs()}"
        time.sleep(0.1)
    assert out.read_text().strip() == f"hello from {NODE}"
    nodes = slurm.nodes()
    assert nodes[DEAD_NODE].down
    assert nodes[DEAD_NODE].reason == "no slurmd"

    # the fallback for Slurm without --json reads this version's text the same
    slurm.run("sbatch", "--hold", "--wrap", "true")  # a job to list
    text_nodes = parse_scontrol_nodes(slurm.run("scontrol", "show", "node", "-o"))
    assert {n.name: n for n in text_nodes} == slurm.nodes()
    text_jobs = parse_squeue_text(slurm.run("squeue", "-h", "-o", SQUEUE_TEXT_FORMAT))
    json_jobs = slurm.jobs()  # 22.05's --json also lists finished jobs (for MinJobAge)
    assert json_jobs["1"].state == "COMPLETED"
    assert not json_jobs["1"].active
    assert [(j.job_id, j.state, j.nodes) for j in text_jobs] == [
        (j.job_id, j.state, j.nodes) for j in json_jobs.values() if j.state != "COMPLETED"
    ]
    assert len(text_jobs) == 1
