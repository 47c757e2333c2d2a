"""Jobs across regions (docs/federation.md): a submitted job its home region cannot hold
is forwarded to the region that fits best (at submit, and later while it waits here
without ever having started); a job id resolves from any region.

:class:`FederatedJobs` stands where the HTTP API expects the job manager: it places each
submitted job with :func:`controller.forwarding.choose_region` over the federation's
view, forwards it (request/reply on ``<p>.fed.submit.<region>``) or queues it here, and
answers jobs forwarded to this region (the leader queues them).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from metalguard.controller.federation.forwarding import choose_region
from metalguard.controller.federation.service import Federation
from metalguard.controller.jobs.manager import JobManager, handed_over_ok
from metalguard.controller.jobs.spec import JobRejectedError, NotLeaderError, parse_job
from metalguard.controller.jobs.store import JobConflictError, JobExistsError
from metalguard.proto.federation import JobCancel, JobForward, JobForwardReply
from metalguard.proto.jobs import Job, JobStatus

log = logging.getLogger(__name__)


class FederatedJobs:
    """The job manager of this region, with forwarding and lookups across regions."""

    def __init__(
        self,
        manager: JobManager,
        federation: Federation,
        *,
        leading: Callable[[], bool] = lambda: True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.manager = manager
        self.federation = federation
        self._leading = leading
        self._clock = clock
        self.forwarded: dict[str, str] = {}
        """Job id -> region, for the jobs of other regions this controller forwarded or
        cancelled (this run): where the API says they are."""
        federation.job_of = lambda job_id: manager.jobs.get(job_id)
        federation.accept = self.accept
        federation.every_interval = self.retry_pass

    @property
    def region(self) -> str:
        """This controller's region."""
        return self.federation.region

    @property
    def jobs(self) -> Mapping[str, JobStatus]:
        """This region's jobs."""
        return self.manager.jobs

    async def submit(self, raw: Any) -> JobStatus:
        """Validate a job and queue it here, or forward it to the region that fits best;
        ``self.forwarded`` says where a forwarded one went."""
        job = parse_job(raw, self._clock())
        if not self._leading():
            raise NotLeaderError("this controller does not lead the region; ask the leader")
        choice = choose_region(job, self.region, self.federation.offers())
        if not choice.forward:
            reason = "submitted" if choice.reason.startswith("fits") else choice.reason
            return await self.manager.submit_job(job, reason)
        reply = await self.federation.forward(choice.region, job)
        if reply.ok and reply.status is not None:
            log.info("job %s forwarded to %s: %s", job.job_id, choice.region, choice.reason)
            self.forwarded[job.job_id] = choice.region
            return reply.status
        if reply.error == "exists":
            raise JobExistsError(job.job_id)
        if reply.error == "rejected":
            raise JobRejectedError([f"{choice.region}: {r}" for r in reply.reasons])
        why = f"{choice.reason}, but {choice.region} did not take it ({reply.error}): queued here"
        return await self.manager.submit_job(job, why)

    async def retry_pass(self) -> None:
        """Forward the queued, never-started jobs of this region that another region can
        now hold (one that was stale, or full of failing nodes, at submit); the leader
        only.  A forwarded job is forgotten here and resolves from its new region."""
        if not self._leading():
            return
        offers = self.federation.offers()
        for status in list(self.manager.jobs.values()):
            if status.job is None or not handed_over_ok(status):
                continue
            choice = choose_region(status.job, self.region, offers)
            if not choice.forward:
                continue
            region = choice.region

            async def send(job: Job, region: str = region) -> bool:
                reply = await self.federation.forward(region, job)
                return reply.ok

            try:
                moved = await self.manager.hand_over(status.job_id, send)
            except JobConflictError as exc:
                log.warning("job %s forwarded but not forgotten here: %s", status.job_id, exc)
                moved = True
            if moved:
                log.info("queued job %s forwarded to %s: %s", status.job_id, region, choice.reason)
                self.forwarded[status.job_id] = region

    async def cancel(self, job_id: str) -> JobStatus | None:
        """Cancel a job of this region, or ask the region that holds it (None: unknown,
        or that region does not answer)."""
        if job_id in self.manager.jobs:
            return await self.manager.cancel(job_id)
        if not self._leading():
            raise NotLeaderError("this controller does not lead the region; ask the leader")
        found = await self.federation.find_job(job_id)
        if not found.found or found.region == self.region:
            return None
        reply = await self.federation.cancel_remote(found.region, job_id)
        if reply.error == "not_leader":
            raise NotLeaderError(f"{found.region} has no leader right now; try again")
        if not reply.ok:
            return None
        self.forwarded[job_id] = found.region
        return reply.status

    async def find(self, job_id: str) -> tuple[str, JobStatus] | None:
        """(region, status) of job ``job_id`` from any region that answers; None: unknown."""
        reply = await self.federation.find_job(job_id)
        if not reply.found or reply.status is None:
            return None
        return reply.region, reply.status

    async def accept(self, forwarded: JobForward | JobCancel) -> JobForwardReply:
        """Queue a job another region forwarded here, or cancel one of this region's jobs
        for another region (the leader only)."""
        if not self._leading():
            return JobForwardReply(ok=False, region=self.region, error="not_leader")
        if isinstance(forwarded, JobCancel):
            try:
                status = await self.manager.cancel(forwarded.job_id)
            except NotLeaderError:
                return JobForwardReply(ok=False, region=self.region, error="not_leader")
            if status is None:
                return JobForwardReply(ok=False, region=self.region, error="not_found")
            log.info("job %s cancelled for %s", forwarded.job_id, forwarded.origin)
            return JobForwardReply(ok=True, region=self.region, status=status)
        reason = f"forwarded from {forwarded.origin}"
        try:
            status = await self.manager.submit_job(forwarded.job, reason)
        except NotLeaderError:
            return JobForwardReply(ok=False, region=self.region, error="not_leader")
        except JobExistsError:
            return JobForwardReply(ok=False, region=self.region, error="exists")
        except Exception as exc:  # a store failure: the origin queues the job at home
            log.warning("forwarded job %s not queued: %s", forwarded.job.job_id, exc)
            return JobForwardReply(
                ok=False, region=self.region, error="unavailable", reasons=(str(exc),)
            )
        log.info("job %s taken from %s", forwarded.job.job_id, forwarded.origin)
        return JobForwardReply(ok=True, region=self.region, status=status)
