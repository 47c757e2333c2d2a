"""Every file a user writes, fuzzed (issue 16, item 5): agent and controller configs,
scoring.toml, the Slurm bridge's config, scenario files, QoS profiles, job files (TOML
and JSON). Junk text, binary garbage, non-UTF-8, empty files, deep nesting, huge values,
and the shipped examples with a wrong-typed value, an unknown key or a key removed.

The property: the loader returns, or raises only the project's error (a DocumentError;
for QoS profiles a ProfileError, whose reasons the CLI prefixes with the file), with a
message that names the file and, for a mutated key, the key — never another exception.
Bounded: fixed example counts, derandomized, no deadline.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metalguard.agent.config import load_config as load_agent_config
from metalguard.controller.config import load_config as load_controller_config
from metalguard.controller.core.scoring.config import load_scoring_config
from metalguard.controller.jobs.spec import JobFileError, parse_job_file
from metalguard.controller.slurm.config import load_bridge_config
from metalguard.demo.sim.scenario import load_scenario
from metalguard.proto.documents import DocumentError, read_text
from metalguard.proto.qos import ProfileError, decode_profile
from tests.support.document_fuzz import Mutation, example, junk, mutated, toml_text

FUZZ = settings(
    max_examples=60,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

RICH_AGENT = {
    **example("systemd/agent.toml"),
    "node": {
        **example("systemd/agent.toml")["node"],
        "rdma_ports": ["mlx5_0/1", "mlx5_1/1"],
        "rdma_rate_gbps": 200.0,
    },
    "bmc": [
        {"node": "r1.c1.n1", "address": "10.0.0.1:443", "protocol": "redfish"},
        {"node": "r1.c1.n2", "address": "10.0.0.2", "protocol": "snmp", "community": "public"},
    ],
    "bmc_proxy": {"interval_s": 30.0, "concurrency": 8},
    "events": {"udev": True, "udev_subsystems": ["pci"], "gpu_xid": False},
    "qos": {"enabled": True, "interfaces": ["eth0"], "reconcile_interval_s": 5.0},
    "workload": {"enabled": True, "work_dir": "/tmp/w", "stop_grace_s": 3.0},
}
RICH_CONTROLLER = {
    **example("systemd/controller.toml"),
    "http": {"listen": "127.0.0.1:8480", "admin_tokens_file": "/etc/t"},
    "ha": {"instance": "c-1", "renew_s": 3.0},
    "ingest": {"clusters": ["c1"], "shard_index": 0, "shard_count": 2, "fetch_batch": 64},
    "federation": {"enabled": True, "latency_ms": {"r2": 10.0}},
    "topology": {"clusters": {"c1": {"racks": {"k1": {"zone": "z1"}}}}},
}
JOB = {
    "name": "llm-a",
    "nodes": 4,
    "gpus_per_node": 8,
    "gpu_type": "h100",
    "max_spread": "rack",
    "allowed_regions": ["r1"],
    "priority": 5,
    "command": "python",
    "args": ["train.py", "--steps", "100"],
    "env": {"LR": "0.1"},
    "checkpoint_every": 60.0,
    "max_restarts": 2,
}


def _profile(path: Path) -> object:
    return decode_profile(read_text(path), "json" if path.suffix == ".json" else "toml")


def _job(path: Path) -> object:
    return parse_job_file(read_text(path), str(path), 0.0)


@dataclass(frozen=True)
class Kind:
    """One kind of file: its name on disk, the examples mutated, its loader."""

    file: str
    examples: tuple[dict[str, Any], ...]
    load: Callable[[Path], object]
    json: bool = False


KINDS = {
    "agent": Kind("agent.toml", (example("systemd/agent.toml"), RICH_AGENT), load_agent_config),
    "controller": Kind(
        "controller.toml",
        (example("systemd/controller.toml"), RICH_CONTROLLER),
        load_controller_config,
    ),
    "slurm-bridge": Kind(
        "slurm-bridge.toml", (example("systemd/slurm-bridge.toml"),), load_bridge_config
    ),
    "scoring": Kind("scoring.toml", (example("examples/scoring.toml"),), load_scoring_config),
    "scenario": Kind(
        "scenario.toml",
        (example("scenarios/default.toml"), example("metalguard/demo/data/default-scenario.toml")),
        load_scenario,
    ),
    "qos-toml": Kind("profile.toml", (example("examples/qos-profile.toml"),), _profile),
    "qos-json": Kind("profile.json", (example("examples/qos-profile.toml"),), _profile, True),
    "job-toml": Kind("job.toml", (JOB,), _job),
    "job-json": Kind("job.json", (JOB,), _job, True),
}


def _as_json(mutation: Mutation, kind: Kind) -> Mutation:
    """A TOML mutation rewritten as the JSON the JSON kinds read (junk stays junk)."""
    if not kind.json or mutation.how in ("junk text", "binary") or not mutation.key:
        return mutation
    try:
        doc = tomllib.loads(str(mutation.text))
    except (ValueError, RecursionError):
        return mutation
    try:
        return Mutation(json.dumps(doc, allow_nan=False), mutation.key, mutation.how)
    except ValueError:  # nan and inf are no JSON: the file is junk, naming no key
        return Mutation(json.dumps(doc), "", "not JSON")


def messages(exc: Exception, path: Path) -> list[str]:
    """The error's lines as ``file: rest`` (a ProfileError's reasons get the file, as the
    CLI prints them)."""
    if isinstance(exc, ProfileError):
        return [f"{path}: {reason}" for reason in exc.reasons]
    if isinstance(exc, JobFileError):
        return [f"{exc.source}: {reason}" for reason in exc.reasons]
    return [str(exc)]


def check(kind: Kind, mutation: Mutation, path: Path) -> None:
    """Load the mutated file: a result, or only the project's error, naming file and key."""
    mutation = _as_json(mutation, kind)
    data = mutation.text if isinstance(mutation.text, bytes) else mutation.text.encode()
    path.write_bytes(data)
    try:
        kind.load(path)
    except (DocumentError, ProfileError) as exc:
        lines = messages(exc, path)
        assert lines, exc  # noqa: PT017 (a property over many inputs: no pytest.raises)
        for line in lines:
            assert line.startswith(f"{path}: "), line
            assert line.removeprefix(f"{path}: ").strip(), line
            assert "Traceback" not in line
        if mutation.key and mutation.how in ("unknown", "wrong"):
            top = mutation.key.split(".")[0].split("[")[0]
            assert any(top in line for line in lines), (mutation, lines)


@pytest.mark.parametrize("name", sorted(KINDS))
@FUZZ
@given(data=st.data())
def test_mutated_examples_fail_only_with_file_key_and_problem(
    name: str, data: st.DataObject, tmp_path: Path
) -> None:
    kind = KINDS[name]
    doc = data.draw(st.sampled_from(kind.examples))
    check(kind, data.draw(mutated(doc)), tmp_path / kind.file)


@pytest.mark.parametrize("name", sorted(KINDS))
@settings(FUZZ, max_examples=40)
@given(mutation=junk)
def test_junk_fails_only_with_the_file_named(name: str, mutation: Mutation, tmp_path: Path) -> None:
    check(KINDS[name], mutation, tmp_path / KINDS[name].file)


@pytest.mark.parametrize("name", sorted(KINDS))
def test_shipped_examples_load(name: str, tmp_path: Path) -> None:
    """The unmutated examples are valid: the fuzzing starts from good documents."""
    kind = KINDS[name]
    for doc in kind.examples:
        path = tmp_path / kind.file
        path.write_text(json.dumps(doc) if kind.json else toml_text(doc), encoding="utf-8")
        kind.load(path)


@pytest.mark.parametrize("name", sorted(KINDS))
def test_unreadable_paths_name_the_file(name: str, tmp_path: Path) -> None:
    """A missing file, a directory: the project's error naming the path."""
    kind = KINDS[name]
    for path in (tmp_path / "absent" / kind.file, tmp_path):
        with pytest.raises((DocumentError, ProfileError)) as info:
            kind.load(path)
        assert str(path) in str(info.value)


def test_a_nul_in_the_scoring_path_names_the_file(tmp_path: Path) -> None:
    """``scoring = "a\\u0000b"``: was a bare ValueError ("embedded null byte")."""
    path = tmp_path / "controller.toml"
    path.write_text('region = "r1"\nscoring = "a\\u0000b"\n', encoding="utf-8")
    with pytest.raises(DocumentError, match="cannot read"):
        load_controller_config(path).scoring_config(tmp_path)
