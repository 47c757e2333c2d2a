"""The checkpoint client a training script imports (docs/workloads.md): stable and short.

``from metalguard import checkpoint`` then ``checkpoint.report_progress(step)``,
``checkpoint.checkpoint_requested()`` and ``checkpoint.checkpoint_done(step, path)``, or
``checkpoint.connect()`` for a client object.  Step timing for the straggler detector
(docs/jobs.md "Stragglers"): ``with checkpoint.compute():`` and ``with
checkpoint.communicate():`` (or ``checkpoint.report_timing(compute_s, comm_s)``),
``checkpoint.set_role(stage, slot)``, ``checkpoint.mark_step("eval")``.  Standard library
only; without an agent (no ``MG_WORKLOAD_SOCKET``) every call is a cheap no-op.
"""

from metalguard.agent.workload.client import (
    SOCKET_ENV,
    JobEnv,
    WorkloadClient,
    checkpoint_done,
    checkpoint_requested,
    communicate,
    compute,
    connect,
    job_env,
    mark_step,
    report_progress,
    report_timing,
    set_role,
)

__all__ = [
    "SOCKET_ENV",
    "JobEnv",
    "WorkloadClient",
    "checkpoint_done",
    "checkpoint_requested",
    "communicate",
    "compute",
    "connect",
    "job_env",
    "mark_step",
    "report_progress",
    "report_timing",
    "set_role",
]
