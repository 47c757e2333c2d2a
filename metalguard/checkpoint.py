"""The checkpoint client a training script imports (docs/workloads.md): stable and short.

``from metalguard import checkpoint`` then ``checkpoint.report_progress(step)``,
``checkpoint.checkpoint_requested()`` and ``checkpoint.checkpoint_done(step, path)``, or
``checkpoint.connect()`` for a client object.  Standard library only; without an agent
(no ``MG_WORKLOAD_SOCKET``) every call is a cheap no-op.
"""

from metalguard.agent.workload.client import (
    SOCKET_ENV,
    JobEnv,
    WorkloadClient,
    checkpoint_done,
    checkpoint_requested,
    connect,
    job_env,
    report_progress,
)

__all__ = [
    "SOCKET_ENV",
    "JobEnv",
    "WorkloadClient",
    "checkpoint_done",
    "checkpoint_requested",
    "connect",
    "job_env",
    "report_progress",
]
