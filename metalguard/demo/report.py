"""The demo report's rows and verdict (``--report FILE``, docs/demo.md); pure."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from metalguard.controller.core.grades import worst_grade
from metalguard.proto.jobs import TERMINAL_JOB_STATES, JobStatus
from metalguard.proto.nodes import NodeRecord
from metalguard.proto.provision import Instance

GRADE_GRACE_S = 5.0
"""A fault applied this close to the end of the run whose node has not yet taken the
expected grade is reported ``pending`` rather than wrong (ingest, scoring and the
lifecycle take a few agent intervals)."""

INSTANCE_GRACE_S = 10.0
"""An instance whose last ``[[provision]]`` step was taken this close to the end of the
run and that is not yet in its expected state is reported ``pending`` (a simulated boot
takes a moment, a replacement a deploy)."""


def worst_grade_since(record: NodeRecord | None, since_ts: float) -> str | None:
    """The most severe grade ``record`` took at or after ``since_ts`` (its grade history
    and its current grade), or None without a record."""
    if record is None:
        return None
    seen = [c.grade_to for c in record.history if c.ts >= since_ts]
    seen.append(record.grade)
    return worst_grade(seen)  # controller.core.grades: MAINTENANCE ranks with HEALTHY


def job_rows(jobs: Iterable[JobStatus]) -> list[dict[str, Any]]:
    """The report's ``jobs`` list (docs/jobs.md), in submission order."""
    rows = []
    for s in sorted(jobs, key=lambda s: (s.job.submitted_ts if s.job else 0.0, s.job_id)):
        rows.append(
            {
                "id": s.job_id,
                "name": s.job.name if s.job else "",
                "state": s.state,
                "placement": list(s.placement),
                "restarts": s.restarts,
                "resumed_from_step": s.resumed_from_step,
                "steps_redone": s.steps_redone,
                "downtime_s": round(s.downtime_s, 3),
                "digest": s.digest,
                "reason": s.reason,
            }
        )
    return rows


def instance_rows(
    instances: Iterable[Instance],
    expected: Mapping[str, str | None],
    last_step_t: Mapping[str, float],
    end_t: float,
) -> list[dict[str, Any]]:
    """The report's ``instances`` (docs/demo.md "Provisioning"), oldest first: each with
    the state the scenario ``expected`` at the end and whether it is still ``pending``;
    an expected instance the service does not have is a row with ``state`` null."""
    rows = []
    seen = set()
    for i in sorted(instances, key=lambda i: (i.created_ts, i.instance_id)):
        seen.add(i.instance_id)
        want = expected.get(i.instance_id)
        recent = end_t - last_step_t.get(i.instance_id, 0.0) < INSTANCE_GRACE_S
        rows.append(
            {
                "id": i.instance_id,
                "tenant": i.tenant,
                "image": i.image,
                "node": i.node,
                "volume": i.volume,
                "state": i.state,
                "attempts": i.attempts,
                "error": i.error,
                "expected": want,
                "pending": want is not None and i.state != want and recent,
            }
        )
    for instance_id, want in expected.items():
        if instance_id not in seen and want is not None:
            rows.append({"id": instance_id, "state": None, "expected": want, "pending": False})
    return rows


def fault_pending(expected: str | None, got: str | None, applied_t: float, end_t: float) -> bool:
    """Whether a fault is too recent to judge: applied within :data:`GRADE_GRACE_S` of
    the end and its node not yet at the expected grade."""
    return expected is not None and got != expected and end_t - applied_t < GRADE_GRACE_S


def job_ok(job: dict[str, Any], expected_digest: str | None) -> bool:
    """A job that succeeded with a digest (the expected one, when known), or one still
    under way when the run ended; a failed or cancelled job is not ok."""
    if job["state"] == "succeeded":
        return bool(job["digest"]) and expected_digest in (None, job["digest"])
    return job["state"] not in TERMINAL_JOB_STATES


def report_ok(doc: dict[str, Any]) -> bool:
    """Every fault with an ``expected`` grade got it (those still ``pending`` at the end
    are not judged), every job succeeded with its ``expected_digests`` entry (when known)
    or was still under way when the run ended, every submitted job is in the report, and
    every instance with an ``expected`` state is in it (or still ``pending``)."""
    faults_ok = all(
        f["expected"] is None or f["got"] == f["expected"] or f.get("pending", False)
        for f in doc["faults"]
    )
    jobs = doc.get("jobs", [])
    expected = doc.get("expected_digests", {})
    jobs_ok = all(job_ok(j, expected.get(j["name"])) for j in jobs)
    instances_ok = all(
        i["expected"] is None or i["state"] == i["expected"] or i["pending"]
        for i in doc.get("instances", [])
    )
    return faults_ok and jobs_ok and instances_ok and len(jobs) == doc.get("jobs_submitted", 0)
