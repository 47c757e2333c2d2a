"""A bad file, one per kind a user writes, through the real ``metalguard`` command
(issue 16, item 5): exit status 2, ``file: key: problem`` on stderr, no traceback. The
loaders themselves are fuzzed in tests/unit/test_fuzz_files.py; this checks the commands
turn their errors into that line. Every run ends before it would connect anywhere."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.support.harness.agent_proc import METALGUARD

DEAD_API = "http://127.0.0.1:9"
"""Nothing listens there: a job file must be refused before any request."""

CASES = {
    "agent run": (
        {"agent.toml": '[collect]\ninterval_s = "fast"\n'},
        ["agent", "run", "--config", "agent.toml"],
        "agent.toml: collect.interval_s: Expected `float`, got `str`",
    ),
    "agent collect, nested too deeply": (
        {"agent.toml": "[collect]\noptions = " + "[" * 3000 + "]" * 3000 + "\n"},
        ["agent", "collect", "--config", "agent.toml"],
        "agent.toml: not valid TOML: nested too deeply",
    ),
    "controller run": (
        {"controller.toml": 'region = "r1"\n[ingest]\nfetch_batch = "many"\n'},
        ["controller", "run", "--config", "controller.toml"],
        "controller.toml: ingest.fetch_batch: Expected `int`, got `str`",
    ),
    "controller run, a 5,000-digit number": (
        {"controller.toml": 'region = "r1"\nsilence_check_s = ' + "9" * 5000 + "\n"},
        ["controller", "run", "--config", "controller.toml"],
        "controller.toml: not valid TOML: a number too long",
    ),
    "scoring": (
        {
            "controller.toml": 'region = "r1"\nscoring = "scoring.toml"\n',
            "scoring.toml": '[grades]\nhealthy_min = "high"\n',
        },
        ["controller", "run", "--config", "controller.toml"],
        "scoring.toml: grades.healthy_min: Expected `float`, got `str`",
    ),
    "slurm-bridge": (
        {"slurm.toml": 'region = "r1"\ncluster = "c1"\n[drain]\nmax_fraction = 2\n'},
        ["slurm-bridge", "--config", "slurm.toml"],
        "slurm.toml: drain.max_fraction: Expected `float` <= 1.0",
    ),
    "scenario": (
        {"scenario.toml": '[[fault]]\nat = "soon"\nnode = "n1"\nkind = "ecc_ue"\n'},
        ["demo", "--headless", "--duration", "1", "--scenario", "scenario.toml"],
        "scenario.toml: fault[0].at: Expected `float`, got `str`",
    ),
    "qos profile": (
        {"profile.toml": 'version = 1\ndscp_map = { "²" = 3 }\n'},
        ["agent", "qos", "apply", "--dry-run", "--profile", "profile.toml"],
        "profile.toml: dscp_map[²]: key: Expected `int`, got `str`",
    ),
    "job toml": (
        {"job.toml": 'name = "x"\nnodes = "many"\n'},
        ["jobs", "submit", "job.toml", "--api", DEAD_API],
        "job.toml: nodes: Expected `int`, got `str`",
    ),
    "job json": (
        {"job.json": '{"name": "x", "x": ' + "[" * 5000 + "]" * 5000 + "}"},
        ["jobs", "submit", "job.json", "--api", DEAD_API],
        "job.json: not valid JSON: nested too deeply",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_file_exits_2_naming_file_key_and_problem(case: str, tmp_path: Path) -> None:
    files, argv, expected = CASES[case]
    for name, text in files.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    result = subprocess.run(
        [METALGUARD, *argv], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert expected in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr


def test_a_job_file_lists_every_bad_key(tmp_path: Path) -> None:
    (tmp_path / "job.toml").write_text('name = 1\nnodes = "x"\nmaxrestarts = 2\n')
    result = subprocess.run(
        [METALGUARD, "jobs", "submit", "job.toml", "--api", DEAD_API],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert "metalguard: job.toml: maxrestarts: unknown key" in lines, lines
    assert "metalguard: job.toml: name: Expected `str`, got `int`" in lines, lines
    assert "metalguard: job.toml: nodes: Expected `int`, got `str`" in lines, lines
