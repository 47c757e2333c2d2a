"""The fleet twin's report (metalguard/twin/report.py) from hand-made results: every fixed
key, the ETTR and interruption arithmetic, percentiles, byte-stable JSON, the compare
table; and the CLI's parser."""

from __future__ import annotations

import json
import random
import statistics
from dataclasses import replace
from pathlib import Path

import pytest

from metalguard.cli import build_parser
from metalguard.twin import report as rep
from metalguard.twin.cli import POLICY_CHOICES
from metalguard.twin.model import (
    DAY_S,
    POLICY_NAMES,
)
from tests.support.twin_report_keys import REPORT_KEYS
from tests.support.twin_results import JOBS, POLICY, job, result


def test_the_report_has_exactly_the_fixed_keys() -> None:
    report = rep.build_report(result())
    assert set(report) == REPORT_KEYS
    assert set(report["ettr"]) == {
        "fleet",
        "jobs_p10",
        "jobs_p50",
        "jobs_p90",
        "gang_jobs_p50",
        "definition",
    }
    assert set(report["interruptions"]) == {
        "unplanned",
        "planned",
        "unplanned_per_1000_node_days",
        "planned_per_1000_node_days",
        "by_cause",
    }
    assert set(report["queue_wait_s"]) == {"p50", "p90", "p99"}
    assert set(report["jobs"]) == {"submitted", "finished", "failed", "running", "queued"}


def test_fleet_totals() -> None:
    report = rep.build_report(result())
    assert (report["policy"], report["seed"], report["days"]) == ("metalguard", 7, 2.0)
    assert (report["nodes"], report["gpus"]) == (4, 32)
    assert report["gpu_hours_available"] == 32 * 48
    assert report["gpu_hours_busy"] == 32 * 24 * 0.75
    assert report["gpu_hours_down"] == 8.0
    assert report["utilisation"] == 0.375
    redone_gpu_h = (50 * 16 + 3600 * 2048) / 3600
    assert report["goodput_gpu_hours"] == pytest.approx(32 * 24 * 0.75 - redone_gpu_h, abs=1e-6)
    assert report["events"] == 1234
    assert report["decisions"]["grade:HEALTHY->FAILING"] == 2


def test_ettr_per_job_and_gpu_weighted() -> None:
    ettr = rep.build_report(result())["ettr"]
    per_job = sorted([0.9, 43_000 / 43_200, 0.5, DAY_S / (2 * DAY_S)])  # t3 never started
    assert ettr["jobs_p50"] == pytest.approx(statistics.median(per_job), abs=1e-6)
    assert ettr["jobs_p10"] == pytest.approx(rep.percentile(per_job, 10), abs=1e-6)
    assert ettr["gang_jobs_p50"] == pytest.approx((0.9 + 0.5) / 2, abs=1e-6)
    done = 900 * 16 + 43_000 * 8 + 200 * 8 + DAY_S * 2048
    wall = 1000 * 16 + 43_200 * 8 + 400 * 8 + 2 * DAY_S * 2048
    assert ettr["fleet"] == pytest.approx(done / wall, abs=1e-6)
    assert "GPU-weighted" in ettr["definition"]


def test_ettr_is_null_with_no_started_job() -> None:
    ettr = rep.build_report(result(jobs=(job("q1"), job("q2"))))["ettr"]
    assert [ettr[k] for k in ("fleet", "jobs_p10", "jobs_p50", "jobs_p90", "gang_jobs_p50")] == [
        None
    ] * 5


def test_interruptions_counts_rates_and_causes() -> None:
    report = rep.build_report(result())
    inter = report["interruptions"]
    assert (inter["unplanned"], inter["planned"]) == (4, 3)
    assert inter["unplanned_per_1000_node_days"] == 500.0  # 4 in 8 node-days
    assert inter["planned_per_1000_node_days"] == 375.0
    assert inter["by_cause"] == {
        "unplanned": {"gpu_hbm3": 3, "software_bug": 1},
        "planned": {"preempted": 1, "precursor": 2},
    }
    assert report["interruptions_per_job_month"] == pytest.approx(6.0)


def test_interruptions_per_job_month_is_null_without_a_big_job() -> None:
    small = tuple(j for j in JOBS if j.gpus <= rep.BIG_JOB_GPUS)
    assert rep.build_report(result(jobs=small))["interruptions_per_job_month"] is None
    # exactly 1,000 GPUs is not "over 1,000"
    edge = (replace(JOBS[-1], gpus=1000),)
    assert rep.build_report(result(jobs=edge))["interruptions_per_job_month"] is None


def test_queue_waits_and_job_counts() -> None:
    report = rep.build_report(result())
    waits = sorted([100.0, 30.0, 10.0, 0.0, 0.0])
    assert report["queue_wait_s"]["p50"] == 10.0
    assert report["queue_wait_s"]["p90"] == pytest.approx(rep.percentile(waits, 90))
    assert report["queue_wait_s"]["p90"] == pytest.approx(30 + 0.6 * 70)
    assert report["jobs"] == {
        "submitted": 5,
        "finished": 1,
        "failed": 1,
        "running": 2,
        "queued": 1,
    }
    empty = rep.build_report(result(jobs=()))
    assert empty["queue_wait_s"] == {"p50": None, "p90": None, "p99": None}
    assert empty["jobs"]["submitted"] == 0


def test_percentile_matches_the_inclusive_method() -> None:
    rng = random.Random(3)
    values = sorted(rng.uniform(0, 100) for _ in range(57))
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    for q in (1, 10, 50, 90, 99):
        assert rep.percentile(values, q) == pytest.approx(cuts[q - 1])
    assert rep.percentile([4.0], 99) == 4.0
    assert rep.percentile([], 50) is None


def test_parameters_are_stated() -> None:
    report = rep.build_report(result())
    assert report["policy_parameters"]["name"] == "metalguard"
    assert report["policy_parameters"]["delivery_s"] == 720.0
    assert report["workload"] == {"trace": "t.csv", "gang_generator": {"sizes": [8, 16]}}
    assert isinstance(report["failure_model"], dict)
    assert "gpu_hbm3" in json.dumps(report["failure_model"])


def test_the_json_is_byte_stable_and_rounded(tmp_path: Path) -> None:
    noisy = result(gpu_seconds_busy=32 * DAY_S * 0.75 + 1e-9, decisions={"b": 1, "a": 2})
    first = rep.build_report(noisy)
    assert first["gpu_hours_busy"] == 576.0
    text = rep.dumps_report(first)
    assert text.endswith("}\n")
    assert text.index('"a"') < text.index('"b"')
    rep.dump_report(first, tmp_path / "r.json")
    assert (tmp_path / "r.json").read_text() == text
    # the same result gives the same bytes; a different one different bytes
    assert rep.dumps_report(rep.build_report(noisy)) == text
    assert rep.dumps_report(rep.build_report(result(events=1235))) != text
    assert json.loads(text) == first


def test_clean_rejects_what_json_cannot_hold() -> None:
    assert rep._clean({"x": float("nan"), "y": -0.0, "z": frozenset({"b", "a"})}) == {
        "x": None,
        "y": 0.0,
        "z": ["a", "b"],
    }
    with pytest.raises(TypeError, match="object"):
        rep._clean({"x": object()})


def test_compare_table_has_a_column_per_policy() -> None:
    reports = [
        rep.build_report(result(policy=replace(POLICY, name=name)))
        for name in ("static", "metalguard")
    ]
    reports[0]["utilisation"] = 0.35
    reports[0]["interruptions_per_job_month"] = None
    text = rep.compare_table(reports)
    lines = text.splitlines()
    assert lines[0].split() == ["static", "metalguard"]
    assert len(lines) == 1 + len(rep.ROWS)
    util = next(line for line in lines if line.startswith("utilisation"))
    assert util.split()[1:] == ["35.0", "%", "37.5", "%"]
    big = next(line for line in lines if line.startswith("per job-month"))
    assert big.split()[-2:] == ["-", "6"]
    nodes = next(line for line in lines if line.startswith("nodes"))
    assert nodes.split()[1:] == ["4", "4"]


def test_cli_policy_names_match_the_model() -> None:
    assert POLICY_CHOICES == POLICY_NAMES


def test_cli_parser_defaults_and_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    args = parser.parse_args(["twin", "run", "--nodes", "16"])
    assert (args.policy, args.days, args.seed, args.report, args.plot) == (
        "metalguard",
        30.0,
        0,
        None,
        None,
    )
    assert (args.trace, args.failures, args.failure_rate, args.gangs, args.no_gangs) == (
        None,
        None,
        None,
        None,
        False,
    )
    args = parser.parse_args(
        ["twin", "compare", "--nodes", "8", "--days", "2.5", "--report-dir", "out"]
    )
    assert (args.days, args.report_dir) == (2.5, Path("out"))
    for bad in (
        ["twin", "run"],  # --nodes is required
        ["twin", "run", "--nodes", "8", "--days", "0"],
        ["twin", "run", "--nodes", "8", "--days", "nan"],
        ["twin", "run", "--nodes", "8", "--failure-rate", "-1"],
        ["twin", "run", "--nodes", "8", "--policy", "magic"],
        ["twin", "run", "--nodes", "8", "--gangs", "g.toml", "--no-gangs"],
        ["twin", "compare", "--nodes", "8", "--policy", "static"],
    ):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args(bad)
        assert exc.value.code == 2, bad
    assert "must be positive" in capsys.readouterr().err
