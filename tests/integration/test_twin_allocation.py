"""``metalguard twin compare --allocation dedicated,pooled`` as a real process on a small
fleet: the report's ``allocation`` and ``tenants`` keys, the same jobs both ways, one
pool keeping the fleet at least as busy as dedicated partitions when a tenant asks more
than its contract while another leaves its own idle; and bad tenants files and flags
(exit 2 naming the file, the key and the problem). A few seconds in all."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.twin_report_keys import REPORT_KEYS

TENANTS = """\
# "busy" asks one and a half times its contract, "quiet" a tenth of its own
[[tenant]]
name = "busy"
share = 0.5
load = 1.5
[tenant.jobs]
sizes = {8 = 2, 16 = 2, 32 = 1}
duration_median_days = 0.1
duration_min_days = 0.02
duration_max_days = 0.5

[[tenant]]
name = "quiet"
share = 0.5
load = 0.1
burstiness = 0.5
cycle_days = 2
[tenant.jobs]
sizes = {8 = 1, 16 = 1}
duration_median_days = 0.1
duration_min_days = 0.02
duration_max_days = 0.5
"""
TENANT_KEYS = {
    "guarantee_gpus",
    "nodes",
    "guarantee_utilisation",
    "used_over_guarantee",
    "gpu_hours_asked",
    "gpu_hours_used",
    "gpu_hours_borrowed",
    "gpu_hours_lent",
    "queue_wait_s",
    "still_waiting",
    "reclaims",
    "jobs",
}
FLEET = ["--nodes", "32", "--days", "3", "--seed", "1"]


def twin(*args: str, cwd: Path, tenants: str = TENANTS) -> subprocess.CompletedProcess[str]:
    (cwd / "tenants.toml").write_text(tenants)
    return subprocess.run(
        [sys.executable, "-m", "metalguard", "twin", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_compare_dedicated_and_pooled(tmp_path: Path) -> None:
    proc = twin(
        "compare",
        *FLEET,
        "--allocation",
        "dedicated,pooled",
        "--tenants",
        "tenants.toml",
        "--report-dir",
        "out",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "dedicated (static)" in proc.stdout
    assert "pooled (metalguard)" in proc.stdout
    assert "busy: queue wait p90 (s)" in proc.stdout
    reports: dict[str, dict[str, Any]] = {
        mode: json.loads((tmp_path / "out" / f"{mode}.json").read_text())
        for mode in ("dedicated", "pooled")
    }
    dedicated, pooled = reports["dedicated"], reports["pooled"]
    for mode, report in reports.items():
        assert set(report) == REPORT_KEYS
        assert report["allocation"] == mode
        assert set(report["tenants"]) == {"busy", "quiet"}
        for tenant in report["tenants"].values():
            assert set(tenant) == TENANT_KEYS
            assert tenant["guarantee_gpus"] == 128  # 16 of the 32 nodes
        assert report["workload"]["tenants"]["busy"]["load"] == 1.5
        assert report["workload"]["gang_jobs"] > 0
    assert dedicated["policy"] == "static"
    assert pooled["policy"] == "metalguard"
    assert dedicated["jobs"]["submitted"] == pooled["jobs"]["submitted"]  # the same jobs
    for name in ("busy", "quiet"):
        assert (
            dedicated["tenants"][name]["gpu_hours_asked"]
            == pooled["tenants"][name]["gpu_hours_asked"]
        )
        assert dedicated["tenants"][name]["gpu_hours_borrowed"] == 0
        assert dedicated["tenants"][name]["gpu_hours_lent"] == 0
    assert pooled["tenants"]["busy"]["gpu_hours_borrowed"] > 0
    assert pooled["tenants"]["quiet"]["gpu_hours_lent"] > 0
    assert pooled["utilisation"] >= dedicated["utilisation"]
    busy = dedicated["tenants"]["busy"], pooled["tenants"]["busy"]
    assert busy[1]["queue_wait_s"]["p90"] <= busy[0]["queue_wait_s"]["p90"]


def test_run_takes_one_allocation_and_its_policy(tmp_path: Path) -> None:
    proc = twin("run", *FLEET, "--allocation", "pooled", "--report", "-", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["allocation"] == "pooled"
    assert report["policy"] == "metalguard"
    assert report["workload"]["tenants"]["source"].endswith("tenants.toml")  # the default
    proc = twin(
        "run", *FLEET, "--allocation", "dedicated", "--policy", "metalguard", "--report", "-",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert (report["allocation"], report["policy"]) == ("dedicated", "metalguard")


@pytest.mark.parametrize(
    ("change", "where", "problem"),
    [
        (("share = 0.5\nload = 0.1", "share = 0.7\nload = 0.1"), "key tenant.share",
         "the shares add up to 1.2, above 1"),
        (("share = 0.5\nload = 1.5", "share = -0.5\nload = 1.5"), "key tenant[0].share",
         "-0.5 is negative"),
        (('name = "busy"', 'name = "busy"\ncolour = "red"'), "key tenant[0].colour",
         "unknown key"),
    ],
)  # fmt: skip
def test_a_bad_tenants_file_exits_2_naming_file_key_and_problem(
    tmp_path: Path, change: tuple[str, str], where: str, problem: str
) -> None:
    bad = TENANTS.replace(*change)
    assert bad != TENANTS
    proc = twin(
        "compare", *FLEET, "--allocation", "dedicated,pooled", "--tenants", "tenants.toml",
        cwd=tmp_path, tenants=bad,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"metalguard twin: tenants.toml: {where}: {problem}")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("compare", "--tenants", "tenants.toml"), "--tenants needs --allocation"),
        (("run", "--allocation", "dedicated,pooled"), "run takes one"),
        (("run", "--allocation", "pooled", "--no-gangs"), "--no-gangs with --allocation"),
        (("compare", "--allocation", "shared"), "'shared' is not an allocation"),
        (("compare", "--allocation", "pooled,pooled"), "given twice"),
    ],
)
def test_bad_allocation_flags_exit_2(tmp_path: Path, args: tuple[str, ...], message: str) -> None:
    proc = twin(args[0], *FLEET, *args[1:], cwd=tmp_path)
    assert proc.returncode == 2
    assert message in proc.stderr
