"""A job's ``dataset`` (docs/jobs.md): validated like a ``[[cache.datasets]]`` name, its
environment names reserved, a ``jobs submit`` flag, in the HTTP API's JobRequest schema,
and sent to the members in their ``start`` args (pure)."""

from __future__ import annotations

import argparse
import re

import msgspec
import pytest

from metalguard.agent.config import CacheDataset
from metalguard.agent.workload.commands import BadArgsError, parse_start
from metalguard.controller.api.openapi import document
from metalguard.controller.cli.jobs import add_jobs_parser, job_document
from metalguard.controller.jobs import machine as m
from metalguard.controller.jobs.spec import DATASET_PATTERN, JobRejectedError, parse_job
from metalguard.proto.jobs import Job
from tests.support.clock import T0

NAMES_OK = ["imagenet", "a", "ImageNet-1k_v2.train", "0", "x" * 64]
NAMES_BAD = [".hidden", "-x", "_x", "a b", "a/b", "x" * 65, "ü", "a\n", "a*"]
TIMINGS = m.Timings(checkpoint_deadline_s=10, stop_deadline_s=10)


def _job(**kw: object) -> dict[str, object]:
    return {"name": "t", "command": "python"} | kw


@pytest.mark.parametrize("name", ["", *NAMES_OK])
def test_a_dataset_name_or_none_is_accepted(name: str) -> None:
    assert parse_job(_job(dataset=name), T0).dataset == name


@pytest.mark.parametrize("name", NAMES_BAD)
def test_a_bad_dataset_name_is_rejected(name: str) -> None:
    with pytest.raises(JobRejectedError) as info:
        parse_job(_job(dataset=name), T0)
    assert [r.split(":")[0] for r in info.value.reasons] == ["dataset"]


@pytest.mark.parametrize("name", [*NAMES_OK, *NAMES_BAD])
def test_the_same_names_as_agent_toml(name: str) -> None:
    agent_ok = True
    try:
        msgspec.convert(
            {"name": name, "source": "/s", "cache_dir": "/c", "max_bytes": 1}, CacheDataset
        )
    except msgspec.ValidationError:
        agent_ok = False
    assert agent_ok is (name in NAMES_OK)


@pytest.mark.parametrize("name", [*NAMES_OK, *(n for n in NAMES_BAD if "\n" not in n)])
def test_the_same_names_as_the_openapi_pattern(name: str) -> None:
    """(A trailing newline aside: JSON Schema's ``$`` lets one through; the API's decoder
    refuses it with the job's own check.)"""
    assert (re.search(DATASET_PATTERN, name) is not None) is (name in NAMES_OK)


def test_the_openapi_job_request_lists_the_dataset() -> None:
    schemas = document()["components"]["schemas"]
    assert schemas["JobRequest"]["properties"]["dataset"]["pattern"] == DATASET_PATTERN
    assert "dataset" in schemas["Job"]["properties"]


@pytest.mark.parametrize("name", ["MG_DATASET", "MG_DATASET_DIR"])
def test_the_dataset_environment_is_reserved(name: str) -> None:
    with pytest.raises(JobRejectedError, match=f"env.{name}: set by the runner"):
        parse_job(_job(env={name: "/tmp"}), T0)


def test_jobs_submit_takes_dataset() -> None:
    root = argparse.ArgumentParser()
    add_jobs_parser(root.add_subparsers(dest="command"))
    args = root.parse_args(["jobs", "submit", "--name", "t", "--dataset", "imagenet"])
    assert job_document(args) == {"name": "t", "dataset": "imagenet"}


def _starts(job: Job) -> list[m.Send]:
    s = m.submitted(job, T0).status
    placed = m.placed(s, ("r.c.n1", "r.c.n2"), T0, "rack")
    world = m.World(now=T0, grades={"r.c.n1": "HEALTHY", "r.c.n2": "HEALTHY"}, timings=TIMINGS)
    return [send for send in m.advance(placed.status, world).sends if send.verb == "start"]


def test_start_args_carry_the_dataset_and_the_runner_reads_it() -> None:
    job = Job(job_id="j1", name="t", nodes=2, command="python", dataset="imagenet")
    starts = _starts(job)
    assert [s.args["dataset"] for s in starts] == ["imagenet", "imagenet"]
    spec = parse_start(starts[0].command_id, starts[0].args)
    assert spec.dataset == "imagenet"
    plain = _starts(Job(job_id="j1", name="t", nodes=2, command="python"))
    assert all("dataset" not in s.args for s in plain), "no key for a job without one"
    assert parse_start(plain[0].command_id, plain[0].args).dataset == ""
    with pytest.raises(BadArgsError, match=r"args\.dataset must be str"):
        parse_start("c", {"job_id": "j", "command": "x", "dataset": 3})
