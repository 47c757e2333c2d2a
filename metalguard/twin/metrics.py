"""What the twin measures: the fleet's GPU-seconds (busy, down) integrated over time, the
sampled timeline, and one outcome record per job.

Everything is piecewise constant between events, so the integrals are exact: each change
first brings the running sums to its time, then applies itself.
"""

from __future__ import annotations

from metalguard.proto.jobs import TERMINAL_JOB_STATES
from metalguard.twin.jobs import TwinJob, checkpoints_before, periodic_done
from metalguard.twin.model import JobOutcomeRecord, TimePoint


class FleetMeter:
    """Busy GPUs (held by placed jobs), down GPUs (nodes out of service), the jobs holding
    nodes and the nodes in service, integrated and sampled every ``sample_s``."""

    def __init__(self, *, end_s: float, sample_s: float, nodes: int) -> None:
        self.end_s = end_s
        self.sample_s = sample_s
        self.nodes = nodes
        self.t = 0.0
        self.busy_gpus = 0
        self.down_gpus = 0
        self.down_nodes = 0
        self.running_jobs = 0
        self.busy_s = 0.0
        self.down_s = 0.0
        self._k = 0
        self.samples: list[TimePoint] = []

    def _sample_until(self, t: float, *, inclusive: bool) -> None:
        while True:
            at = self._k * self.sample_s
            if at > self.end_s or at > t or (at == t and not inclusive):
                return
            self.samples.append(
                TimePoint(at, self.busy_gpus, self.running_jobs, self.nodes - self.down_nodes)
            )
            self._k += 1

    def at(self, now: float) -> None:
        """Bring the sums and samples to ``now`` (before a change at ``now``)."""
        if now <= self.t:
            return
        self._sample_until(now, inclusive=False)
        dt = now - self.t
        self.busy_s += self.busy_gpus * dt
        self.down_s += self.down_gpus * dt
        self.t = now

    def hold(self, now: float, gpus: int, jobs: int) -> None:
        """A job takes (positive) or releases (negative) GPUs."""
        self.at(now)
        self.busy_gpus += gpus
        self.running_jobs += jobs

    def down(self, now: float, gpus: int, nodes: int) -> None:
        """Nodes leave (positive) or return to (negative) service."""
        self.at(now)
        self.down_gpus += gpus
        self.down_nodes += nodes

    def close(self) -> tuple[TimePoint, ...]:
        """The run ends at ``end_s``: the last sums and samples."""
        self.at(self.end_s)
        self._sample_until(self.end_s, inclusive=True)
        return tuple(self.samples)


def kept_progress(tj: TwinJob, end_s: float) -> float:
    """The progress a job keeps at the end: all of it when it finished, the current
    progress of a generation still working (or checkpointing for a move), else the
    checkpoint it would resume from."""
    st = tj.status
    s = tj.spec
    g = tj.live_gen()
    if st.state == "succeeded" or (g is not None and g.finished):
        return s.work_s
    if g is not None and not g.closed and st.placement and st.state not in TERMINAL_JOB_STATES:
        if not (g.crashed or g.hung):
            return tj.progress(end_s)
        if s.checkpoint_interval_s > 0:  # the periodic one it had when it died
            t = g.frozen_at if g.frozen_at is not None else end_s
            rs, iv, cost = s.restart_cost_s, s.checkpoint_interval_s, s.checkpoint_cost_s
            done = periodic_done(g.clock(t), rs, iv, cost)
            k = min(done, checkpoints_before(s.work_s - g.s0, iv))
            best = st.last_checkpoint.step if st.last_checkpoint is not None else 0
            return float(max(best, int(g.s0 + k * iv)) if k >= 1 else best)
    ckpt = st.move.checkpoint if st.move is not None else st.last_checkpoint
    return float(ckpt.step) if ckpt is not None else 0.0


def end_state(tj: TwinJob) -> str:
    """``succeeded``, ``failed``, ``running`` (holding nodes) or ``queued`` at the end."""
    st = tj.status
    if st.state == "succeeded":
        return "succeeded"
    if st.state in TERMINAL_JOB_STATES:
        return "queued" if tj.resubmit_pending else "failed"
    return "running" if tj.held else "queued"


def outcome_record(tj: TwinJob, end_s: float, done: float) -> JobOutcomeRecord:
    """The job's record at the end of the run: ``done`` from :func:`kept_progress` taken
    before its open generation was settled (:meth:`TwinJob.settle`)."""
    now_s = end_s - tj.held_since if tj.held else 0.0
    held = tj.held_s + now_s
    s = tj.spec
    return JobOutcomeRecord(
        job_id=s.job_id,
        source=s.source,
        gpus=s.gpus if s.gpus > 0 else tj.gpus_most,
        submit_s=s.submit_s,
        first_start_s=tj.first_start_s,
        end_s=tj.end_s,
        state=end_state(tj),
        work_s=s.work_s,
        done_s=done,
        redone_s=max(0.0, tj.computed - done),
        held_s=held,
        unplanned=tj.unplanned,
        planned=tj.planned,
        queue_wait_s=tuple(tj.waits),
        slowed_s=tj.slowed_s,
        straggler_moves=tj.straggler_moves,
        straggler_move_s=tj.straggler_move_s,
        waiting_s=end_s - tj.queued_since if tj.queued_since is not None else None,
        held_gpu_s=tj.held_gpu_s + now_s * tj.gpus_held if s.elastic else None,
    )
