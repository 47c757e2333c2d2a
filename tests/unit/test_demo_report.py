"""The demo report's verdict judges what could finish within ``--duration`` (pure)."""

from __future__ import annotations

from typing import Any

from metalguard.demo.report import GRADE_GRACE_S, fault_pending, job_ok, report_ok


def _doc(faults: list[dict[str, Any]], jobs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "faults": faults,
        "jobs": jobs,
        "jobs_submitted": len(jobs),
        "expected_digests": {"a": "ab"},
    }


def test_a_fault_too_recent_to_grade_is_pending_not_wrong() -> None:
    assert fault_pending("FAILING", "HEALTHY", applied_t=19.0, end_t=20.0)
    assert not fault_pending("FAILING", "HEALTHY", applied_t=20.0 - GRADE_GRACE_S, end_t=20.0)
    assert not fault_pending("FAILING", "FAILING", applied_t=19.0, end_t=20.0)
    assert not fault_pending(None, "HEALTHY", applied_t=19.0, end_t=20.0)
    late = {"node": "n", "expected": "FAILING", "got": "HEALTHY", "pending": True}
    assert report_ok(_doc([late], []))
    assert not report_ok(_doc([late | {"pending": False}], []))


def test_a_job_still_running_at_the_end_is_ok_a_failed_one_is_not() -> None:
    assert job_ok({"state": "running", "digest": ""}, "ab")
    assert job_ok({"state": "queued", "digest": ""}, None)
    assert job_ok({"state": "succeeded", "digest": "ab"}, "ab")
    assert not job_ok({"state": "succeeded", "digest": "cd"}, "ab")
    assert not job_ok({"state": "succeeded", "digest": ""}, None)
    assert not job_ok({"state": "failed", "digest": ""}, None)
    assert not job_ok({"state": "cancelled", "digest": ""}, None)
    running = {"name": "a", "state": "running", "digest": ""}
    assert report_ok(_doc([], [running]))
    assert not report_ok(_doc([], [running | {"state": "failed"}]))
