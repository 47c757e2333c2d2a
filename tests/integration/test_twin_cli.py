"""``metalguard twin run|compare`` as real processes (``python -m metalguard``): the
report's keys and bytes, the figure, the compare table, bad input and bad flags (exit 2
with file, row/key and problem), matplotlib missing, and the command staying cheap to
register. Small fleets and short horizons: a few seconds in all."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.twin_report_keys import REPORT_KEYS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL = ["--nodes", "16", "--days", "2", "--failure-rate", "0.05", "--gangs", "gangs.toml"]
"""16 nodes (128 GPUs) for 2 days, faults ~13x Llama 3's rate so that some happen, and
short gangs (:data:`GANGS`) so that dozens of jobs come and go."""
GANGS = """\
duration_median_days = 0.25
duration_min_days = 0.05
duration_max_days = 1.0
checkpoint_interval_s = 1800.0
[sizes]
8 = 3.0
16 = 2.0
32 = 1.0
64 = 0.5
"""

TRACE = """\
name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,\
deletion_time,scheduled_time
pod-a,8000,16384,8,1000,,LS,Succeeded,0,7200,0
pod-b,4000,8192,2,1000,,BE,Succeeded,600,4200,600
pod-c,4000,8192,1,500,,LS,Failed,1200,3000,1200
pod-d,16000,65536,8,1000,,LS,Running,1800,90000,1800
"""


def twin(*args: str, cwd: Path, check: bool = False) -> subprocess.CompletedProcess[str]:
    """One ``metalguard twin`` process (in ``cwd``, with :data:`GANGS` as gangs.toml)."""
    (cwd / "gangs.toml").write_text(GANGS)
    proc = subprocess.run(
        [sys.executable, "-m", "metalguard", "twin", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_run_writes_the_report_and_the_figure(tmp_path: Path) -> None:
    proc = twin(
        "run",
        *SMALL,
        "--seed",
        "3",
        "--policy",
        "reactive",
        "--report",
        "r.json",
        "--plot",
        "r.png",
        cwd=tmp_path,
        check=True,
    )
    report = json.loads((tmp_path / "r.json").read_text())
    assert set(report) == REPORT_KEYS
    assert (report["policy"], report["seed"], report["days"]) == ("reactive", 3, 2.0)
    assert (report["nodes"], report["gpus"]) == (16, 128)
    assert report["gpu_hours_available"] == pytest.approx(128 * 48, rel=0.01)
    assert 0 <= report["gpu_hours_busy"] <= report["gpu_hours_available"]
    assert report["utilisation"] == pytest.approx(
        report["gpu_hours_busy"] / report["gpu_hours_available"], abs=1e-5
    )
    assert report["goodput_gpu_hours"] <= report["gpu_hours_busy"]
    jobs = report["jobs"]
    assert jobs["submitted"] > 10
    assert jobs["finished"] > 0
    assert 0 < report["ettr"]["fleet"] <= 1
    assert jobs["submitted"] == sum(jobs[k] for k in ("finished", "failed", "running", "queued"))
    assert report["workload"]["gang_jobs"] == jobs["submitted"]  # no trace: gangs only
    assert report["workload"]["gang_generator"]["duration_median_days"] == 0.25
    assert report["policy_parameters"]["name"] == "reactive"
    assert report["failure_model"]
    assert report["events"] > 0
    assert (tmp_path / "r.json").read_text().endswith("}\n")
    assert (tmp_path / "r.png").read_bytes().startswith(PNG_MAGIC)
    assert proc.stdout.splitlines()[0].split() == ["reactive"]
    assert "utilisation" in proc.stdout
    assert "reactive: 16 nodes" in proc.stderr


def test_the_same_seed_gives_the_same_bytes(tmp_path: Path) -> None:
    first = twin("run", *SMALL, "--seed", "5", "--report", "-", cwd=tmp_path, check=True)
    again = twin("run", *SMALL, "--seed", "5", "--report", "-", cwd=tmp_path, check=True)
    other = twin("run", *SMALL, "--seed", "6", "--report", "-", cwd=tmp_path, check=True)
    assert first.stdout == again.stdout
    assert first.stdout != other.stdout
    assert json.loads(first.stdout)["seed"] == 5


def test_compare_runs_every_policy(tmp_path: Path) -> None:
    proc = twin(
        "compare",
        *SMALL,
        "--report-dir",
        "out/reports",
        "--plot",
        "c.png",
        cwd=tmp_path,
        check=True,
    )
    assert proc.stdout.splitlines()[0].split() == ["static", "reactive", "metalguard"]
    reports = {
        name: json.loads((tmp_path / "out" / "reports" / f"{name}.json").read_text())
        for name in ("static", "reactive", "metalguard")
    }
    assert {r["policy"] for r in reports.values()} == set(reports)
    # the same inputs for every policy: the same jobs submitted, the same fleet
    assert len({r["jobs"]["submitted"] for r in reports.values()}) == 1
    assert len({json.dumps(r["workload"], sort_keys=True) for r in reports.values()}) == 1
    assert (tmp_path / "c.png").read_bytes().startswith(PNG_MAGIC)
    assert proc.stderr.count(" events in ") == 3


def test_a_trace_alone(tmp_path: Path) -> None:
    (tmp_path / "pods.csv").write_text(TRACE)
    twin(
        "run",
        "--nodes",
        "4",
        "--days",
        "1",
        "--trace",
        "pods.csv",
        "--no-gangs",
        "--report",
        "r.json",
        cwd=tmp_path,
        check=True,
    )
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["jobs"]["submitted"] == 4
    assert report["workload"]["trace_jobs"] == 4
    assert report["workload"]["gang_jobs"] == 0
    assert report["ettr"]["gang_jobs_p50"] is None


@pytest.mark.parametrize(
    ("name", "text", "args", "expected"),
    [
        (
            "missing.csv",
            "name,num_gpu,creation_time\npod-a,1,0\n",
            ["--trace", "missing.csv"],
            ["missing.csv", "deletion_time"],
        ),
        (
            "negative.csv",
            "name,num_gpu,creation_time,deletion_time\npod-a,1,0,10\npod-b,1,-5,10\n",
            ["--trace", "negative.csv"],
            ["negative.csv", "row 3", "creation_time"],
        ),
        (
            "huge.csv",
            "name,num_gpu,creation_time,deletion_time\npod-a,1,0,10\npod-b,64,0,10\n",
            ["--trace", "huge.csv"],
            ["huge.csv", "row 3"],
        ),
    ],
)
def test_bad_input_exits_2_naming_file_row_and_problem(
    tmp_path: Path, name: str, text: str, args: list[str], expected: list[str]
) -> None:
    (tmp_path / name).write_text(text)
    proc = twin("run", "--nodes", "2", "--days", "1", "--no-gangs", *args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"metalguard twin: {name}: "), line
    for part in expected:
        assert part in line, line
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("name", "text", "key"),
    [
        (
            "negative.toml",
            '[causes.gpu]\nrate_per_node_day = -0.5\nkind = "hardware"\n',
            "key causes.gpu.rate_per_node_day",
        ),
        (
            "fraction.toml",
            '[causes.gpu]\nrate_per_node_day = 0.001\nsignal = "ecc"\nprecursor_fraction = 1.5\n',
            "key causes.gpu.precursor_fraction",
        ),
        (
            "planned.toml",
            "[planned]\nrate_per_node_day = -1\n",
            "key planned.rate_per_node_day",
        ),
    ],
)
def test_bad_failure_models_exit_2(tmp_path: Path, name: str, text: str, key: str) -> None:
    (tmp_path / name).write_text(text)
    proc = twin("run", "--nodes", "2", "--days", "1", "--failures", name, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"metalguard twin: {name}: {key}: "), line


def test_failure_rate_scales_a_file_model(tmp_path: Path) -> None:
    (tmp_path / "f.toml").write_text(
        "[causes.a]\nrate_per_node_day = 0.001\n"
        '[causes.b]\nrate_per_node_day = 0.003\nkind = "software"\n'
    )
    args = ["run", "--nodes", "2", "--days", "1", "--no-gangs", "--failures", "f.toml"]
    proc = twin(*args, "--failure-rate", "0.02", "--report", "-", cwd=tmp_path, check=True)
    model = json.loads(proc.stdout)["failure_model"]
    assert model["total_rate_per_node_day"] == pytest.approx(0.02)
    assert model["causes"]["a"]["rate_per_node_day"] == pytest.approx(0.005)
    assert model["source"] == "f.toml"


def test_bad_flags_and_missing_files_exit_2(tmp_path: Path) -> None:
    # argparse's own (the rest of the flags: tests/unit/test_twin_report.py)
    proc = twin("run", "--nodes", "8", "--days", "-1", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "usage:" in proc.stderr
    assert "--days: must be positive" in proc.stderr
    for args, problem in (
        (["run", "--nodes", "0"], "--nodes"),
        (["run", "--nodes", "8", "--trace", "nowhere.csv"], "nowhere.csv"),
        (["run", "--nodes", "8", "--gangs", "nowhere.toml"], "nowhere.toml"),
        (["run", "--nodes", "8", "--report", "no/such/dir/r.json"], "--report"),
    ):
        proc = twin(*args, "--days", "1", cwd=tmp_path)
        assert proc.returncode == 2, (args, proc.stderr)
        assert proc.stderr.startswith(f"metalguard twin: {problem}"), proc.stderr
        assert "Traceback" not in proc.stderr


def test_missing_matplotlib_exits_2_before_running(tmp_path: Path) -> None:
    script = (
        "import sys\n"
        "sys.modules['matplotlib'] = None\n"
        "from metalguard.cli import main\n"
        "sys.exit(main(['twin', 'run', '--nodes', '8', '--days', '1', '--plot', 'x.png']))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'metalguard[twin]'" in proc.stderr
    assert " events in " not in proc.stderr  # nothing was simulated
    assert not (tmp_path / "x.png").exists()


def test_registering_the_command_imports_nothing_heavy(tmp_path: Path) -> None:
    script = (
        "import sys\n"
        "from metalguard.cli import build_parser\n"
        "build_parser()\n"
        "print(sorted(m for m in sys.modules if m.startswith(('metalguard.twin', 'matplotlib'))))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['metalguard.twin', 'metalguard.twin.cli']"
