"""The three ways of running a fleet the twin compares (issue 19, item 3).

Each value is stated with its reason; the report prints every parameter, so a reader can
weigh the comparison against them.  ``static`` is traditional bare metal, ``reactive``
automatic isolation and rescheduling only, ``metalguard`` everything the project does.
"""

from __future__ import annotations

from typing import Final

from metalguard.twin.model import DAY_S, Policy, PolicyName

HOUR_S: Final = 3600.0
MINUTE_S: Final = 60.0

STATIC: Final = Policy(
    name="static",
    # no health system: a broken node stays in service until a person notices it, and
    # a fault kills its job (the job machine gets max_restarts 0: it fails the job)
    auto_isolation=False,
    precursors=False,
    # a traditional FIFO batch queue: no preemption, no backfill, no priorities
    preemption=False,
    backfill=False,
    priorities=False,
    # nothing watches progress: a person notices a hung job like a dead node
    hang_detection=False,
    hang_timeout_s=0.0,
    # "a person notices and repairs after hours" (issue 19): within a working shift
    human_notice_s=4 * HOUR_S,
    # the user reads the failure and resubmits from the last checkpoint: a couple of hours
    resubmit_s=2 * HOUR_S,
    # the seed's "delivery from 2.5 days": reinstall, burn-in and handover by tickets
    delivery_s=2.5 * DAY_S,
)

REACTIVE: Final = Policy(
    name="reactive",
    # a fatal fault grades the node FAILING (the real scoring/lifecycle/rail) and the job
    # machine moves its jobs from the last periodic checkpoint, automatically
    auto_isolation=True,
    # ... but nothing acts before the fault
    precursors=False,
    # a modern scheduler without preemption: priorities and backfill, no checkpoint-and-
    # requeue of running jobs
    preemption=False,
    backfill=True,
    priorities=True,
    # no progress watch: a hung job (it does not exit) waits for a person
    hang_detection=False,
    hang_timeout_s=0.0,
    human_notice_s=4 * HOUR_S,
    resubmit_s=2 * HOUR_S,
    # isolation is automatic but the repaired node is still reinstalled and handed back
    # by hand: about a working day
    delivery_s=1 * DAY_S,
)

METALGUARD: Final = Policy(
    name="metalguard",
    auto_isolation=True,
    # sub-healthy drain on precursors: the real scoring grades the synthesized precursor
    # telemetry; a sub-healthy node is drained (fresh checkpoint, then move) and repaired
    # before its fault
    precursors=True,
    # preemption with checkpoints, backfill and priorities (docs/scheduler.md)
    preemption=True,
    backfill=True,
    priorities=True,
    # the job machine's hang_timeout (docs/jobs.md "Hangs and crashes"); a job's own
    # pauses (restart, checkpoint) are added to it so they are never taken for a hang
    hang_detection=True,
    hang_timeout_s=15 * MINUTE_S,
    # a person is still the fallback for what the automation does not catch (a fault the
    # safety rail holds back from isolation)
    human_notice_s=4 * HOUR_S,
    resubmit_s=2 * HOUR_S,
    # the seed's "to 12 minutes": network boot through the BMC with a per-tenant volume,
    # no reinstall (docs/provisioning.md; bench/provision_bench.py boots a node in ~11 s
    # under emulation, a real server's firmware POST adds minutes)
    delivery_s=12 * MINUTE_S,
    # the job manager's straggler detector (controller/core/stragglers.py: 8 % slower than
    # its peers for 4 windows after 1 warm-up window; 30 s windows, the jobs' default
    # timing_window_s): the node is marked SUB_HEALTHY, the job moved off it when that
    # pays (move_pays); static and reactive have no detector (a fail-slow slows its jobs
    # until it clears or a person finds it)
    straggler_detection=True,
)

POLICIES: Final[dict[PolicyName, Policy]] = {
    "static": STATIC,
    "reactive": REACTIVE,
    "metalguard": METALGUARD,
}
"""The named policies, in the order the report compares them."""
