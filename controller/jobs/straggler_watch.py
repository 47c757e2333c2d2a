"""The job manager's straggler watch (docs/jobs.md "Stragglers"). No I/O: the manager
feeds it the ranks' ``job_timing`` windows and the time, and acts on what it returns.

Each job's ranks send one window each per ``timing_window_s``; a *round* is one window
from every rank of the job's current generation (a rank that sent two before the others
sent one counts with its newest). A complete round goes to the pure detector
(:func:`metalguard.controller.core.stragglers.observe`); a round still incomplete after
``STALE_WINDOWS`` windows is dropped (a rank that stopped reporting says nothing).

A suspect becomes a :class:`Finding` once per job, generation and node: the evidence
(slowdown against how many peers, for how many windows, its wait share, the node's own
corroborating signals), whether the node was suspected in other jobs too (a lemon), and
whether moving the job pays (:func:`metalguard.controller.core.stragglers.move_pays`
with the job's own figures).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final

from metalguard.controller.core import stragglers
from metalguard.controller.core.stragglers import JobState, NodeSlowness, RankWindow, Settings
from metalguard.proto.base import AttrValue, NodeIdentity, Reason
from metalguard.proto.events import ControllerEvent
from metalguard.proto.jobs import JobStatus
from metalguard.proto.nodes import NodeRecord

STRAGGLER: Final = "node.straggler"
JOB_SLOWED: Final = "job.slowed"
STALE_WINDOWS: Final = 3
WATCHED_STATES: Final = frozenset({"running"})
CORROBORATING: Final = (
    "gpu.throttle",
    "gpu.pcie_link",
    "pcie.",
    "rdma.",
    "network.",
    "hwmon.",
)
"""Signal prefixes of a node's own findings that explain slowness (shown in the
evidence, raising the confidence; never required)."""


@dataclass(frozen=True, slots=True)
class WatchSettings:
    """``[jobs]`` straggler knobs (docs/jobs.md "Stragglers")."""

    detector: Settings = field(default_factory=Settings)
    hold_s: float = 86_400.0
    """How long a straggler stays SUB_HEALTHY (an operator's uncordon ends it sooner)."""
    restart_cost_s: float = 300.0
    """A restart's cost for a job that states none (``restart_cost_s``)."""
    lemon_jobs: int = 2
    """A node suspected in this many different jobs is a lemon."""
    memory_s: float = 7 * 86_400.0
    """How long a suspicion is remembered for the lemon count."""


def straggler_event_id(job_id: str, generation: int, handle: str) -> str:
    """``node.straggler``'s id: one announcement per job, generation and node."""
    return f"{job_id}.g{generation}.{handle}.straggler"


@dataclass(frozen=True, slots=True)
class Finding:
    """A node found slowing one generation of one job."""

    job_id: str
    generation: int
    handle: str
    slowness: NodeSlowness
    windows: int
    window_s: float
    corroboration: tuple[str, ...]
    other_jobs: tuple[str, ...]
    """Other jobs that found it slow within the memory (a lemon when not empty)."""
    move: bool
    remaining_s: float | None
    restart_cost_s: float
    lost_work_s: float

    @property
    def event_id(self) -> str:
        """Deterministic: one announcement per job, generation and node."""
        return straggler_event_id(self.job_id, self.generation, self.handle)

    @property
    def percent(self) -> float:
        return round(self.slowness.slowdown * 100, 1)

    def message(self) -> str:
        """The evidence in words."""
        s = self.slowness
        text = (
            f"its ranks in job {self.job_id} computed {self.percent:g} % slower than their "
            f"{s.peers} same-role peers for {self.windows} windows of "
            f"{self.window_s:g} s (waiting in collectives {s.wait_share:.0%} of a step)"
        )
        if self.corroboration:
            text += f"; corroborated by {', '.join(self.corroboration)}"
        if self.other_jobs:
            text += f"; also slow in {', '.join(self.other_jobs)} (a lemon)"
        return text

    def reason(self) -> Reason:
        """The node's evidence (kept in its record while the mark holds)."""
        return Reason(
            signal="jobs.straggler",
            value=self.percent,
            threshold=None,
            rule="straggler",
            message=self.message(),
        )

    def attributes(self) -> dict[str, AttrValue]:
        """The ``node.straggler`` event's attributes."""
        return {
            "generation": self.generation,
            "slowdown_pct": self.percent,
            "peers": self.slowness.peers,
            "windows": self.windows,
            "window_s": self.window_s,
            "wait_share": round(self.slowness.wait_share, 3),
            "corroborated_by": ",".join(self.corroboration),
            "confidence": "high" if self.corroboration or self.other_jobs else "medium",
            "other_jobs": ",".join(self.other_jobs),
            "action": "move" if self.move else "finish",
            "remaining_s": None if self.remaining_s is None else round(self.remaining_s, 1),
            "restart_cost_s": self.restart_cost_s,
            "lost_work_s": round(self.lost_work_s, 1),
        }


@dataclass(frozen=True, slots=True)
class Slowed:
    """A whole job slower than its own baseline, every rank alike: no node blamed."""

    job_id: str
    generation: int
    slowdown: float

    @property
    def event_id(self) -> str:
        return f"{self.job_id}.g{self.generation}.slowed"


def straggler_event(
    found: Finding, region: str, node: NodeIdentity | None, now: float
) -> ControllerEvent:
    """``node.straggler``: the evidence, and whether the job is moved off the node."""
    action = (
        "the job is moved off it (moving pays)"
        if found.move
        else "the job finishes where it is (moving would not pay)"
    )
    return ControllerEvent(
        event_id=found.event_id,
        ts=now,
        region=region,
        kind=STRAGGLER,
        node=node,
        job_id=found.job_id,
        reasons=(found.reason(),),
        message=f"straggler {found.handle}: {found.message()}; {action}",
        attributes=found.attributes(),
    )


def slowed_event(slowed: Slowed, region: str, now: float) -> ControllerEvent:
    """``job.slowed``: the whole job slower than its baseline; no node blamed."""
    pct = round(slowed.slowdown * 100, 1)
    return ControllerEvent(
        event_id=slowed.event_id,
        ts=now,
        region=region,
        kind=JOB_SLOWED,
        job_id=slowed.job_id,
        message=f"job {slowed.job_id} runs {pct:g} % slower than its own baseline, every "
        "rank alike (shared congestion, the data): no node is blamed",
        attributes={"generation": slowed.generation, "slowdown_pct": pct},
    )


@dataclass
class _Job:
    generation: int
    world_size: int
    window_s: float
    detector: JobState = field(default_factory=JobState)
    round: dict[int, RankWindow] = field(default_factory=dict)
    round_opened: float = 0.0
    step_s: float = 0.0
    """The job's median step time (compute + collectives) in its last round."""


def window_from(rank: int, handle: str, attributes: Mapping[str, AttrValue]) -> RankWindow | None:
    """A rank's window from a ``job_timing`` event's attributes (None: malformed)."""
    try:
        steps = attributes["steps"]
        compute, comm = attributes["compute_s"], attributes["comm_s"]
        role_text = str(attributes.get("role") or "")
        role = tuple(int(r) for r in role_text.split(",")) if role_text else ()
    except (KeyError, ValueError):
        return None
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        return None
    if isinstance(compute, bool) or not isinstance(compute, int | float):
        return None
    if isinstance(comm, bool) or not isinstance(comm, int | float):
        return None
    if not (compute >= 0 and comm >= 0):
        return None
    return RankWindow(rank, handle, float(compute), float(comm), role, steps)


def corroboration(record: NodeRecord | None) -> tuple[str, ...]:
    """The node's own findings that explain slowness (its current reasons)."""
    if record is None:
        return ()
    return tuple(
        f"{r.signal} ({r.message})" if r.message else r.signal
        for r in record.reasons
        if r.signal.startswith(CORROBORATING)
    )


def remaining_s(status: JobStatus, step_s: float, slowdown: float) -> float | None:
    """The job's remaining run time at its own pace: the steps still to do x its measured
    step time without the slowdown (``step_s / (1 + slowdown)``), so ``slowdown`` x it is
    what the slowdown would still cost. None: its ``total_steps`` is not stated."""
    job = status.job
    if job is None or job.total_steps <= 0 or step_s <= 0:
        return None
    done = max((m.step for m in status.members), default=0)
    return max(0, job.total_steps - done) * step_s / (1.0 + max(0.0, slowdown))


def lost_work_s(status: JobStatus, now: float) -> float:
    """What a move may redo: the time since the job's last checkpoint (none: since its
    generation started). A planned move asks for a fresh one first; this is the bound
    when none comes."""
    if status.last_checkpoint is not None:
        return max(0.0, now - status.last_checkpoint.ts)
    started = [t.ts for t in status.history if t.state == "running"]
    return max(0.0, now - started[-1]) if started else 0.0


class StragglerWatch:
    """Rounds of timing windows per job → findings and whole-job slowdowns."""

    def __init__(self, settings: WatchSettings | None = None) -> None:
        self.settings = settings or WatchSettings()
        self._jobs: dict[str, _Job] = {}
        self._found: list[Finding] = []
        self._slowed: list[Slowed] = []
        self._said: set[str] = set()
        self._marks: list[tuple[str, str, float]] = []
        """(node, job, time) of every suspicion, for the lemon count."""
        self.rounds = 0
        """Complete rounds handed to the detector (what a quiet watch has looked at)."""

    def add(
        self,
        status: JobStatus,
        generation: int,
        window: RankWindow,
        records: Mapping[str, NodeRecord],
        now: float,
    ) -> None:
        """Take one rank's window; a round complete with it goes to the detector."""
        job = status.job
        if job is None or status.state not in WATCHED_STATES:
            return
        if generation != status.generation or not status.members:
            return
        if not any(m.rank == window.rank and m.node == window.node for m in status.members):
            return
        state = self._jobs.get(status.job_id)
        if state is None or state.generation != generation:
            # a new run: a new round; the detector's state goes on (observe() starts the
            # warm-up and the streaks again, the job's baseline stays)
            detector = state.detector if state is not None else JobState()
            state = _Job(generation, len(status.members), job.timing_window_s, detector)
            self._jobs[status.job_id] = state
        if state.round and now - state.round_opened > STALE_WINDOWS * state.window_s:
            state.round.clear()  # a rank stopped reporting: start the round again
        if not state.round:
            state.round_opened = now
        state.round[window.rank] = window
        if len(state.round) < state.world_size:
            return
        ranks = list(state.round.values())
        state.round.clear()
        self.rounds += 1
        state.step_s = statistics.median(r.compute_s + r.comm_s for r in ranks)
        verdict = stragglers.observe(state.detector, generation, ranks, self.settings.detector)
        for suspect in verdict.suspects:
            self._suspect(status, state, suspect, records, now)
        if verdict.job_slowdown is not None:
            slowed = Slowed(status.job_id, generation, verdict.job_slowdown)
            if slowed.event_id not in self._said:
                self._said.add(slowed.event_id)
                self._slowed.append(slowed)

    def _suspect(
        self,
        status: JobStatus,
        state: _Job,
        suspect: NodeSlowness,
        records: Mapping[str, NodeRecord],
        now: float,
    ) -> None:
        event_id = straggler_event_id(status.job_id, state.generation, suspect.node)
        if event_id in self._said:
            return
        self._said.add(event_id)
        cfg = self.settings
        self._marks = [m for m in self._marks if m[2] > now - cfg.memory_s]
        self._marks.append((suspect.node, status.job_id, now))
        lemons = stragglers.suspects_across_jobs(
            ((n, j) for n, j, _ in self._marks), cfg.lemon_jobs
        )
        others = tuple(sorted(lemons.get(suspect.node, frozenset()) - {status.job_id}))
        job = status.job
        assert job is not None
        remaining = remaining_s(status, state.step_s, suspect.slowdown)
        restart = job.restart_cost_s if job.restart_cost_s is not None else cfg.restart_cost_s
        lost = lost_work_s(status, now)
        move = remaining is not None and stragglers.move_pays(
            suspect.slowdown, remaining, restart, lost
        )
        self._found.append(
            Finding(
                job_id=status.job_id,
                generation=state.generation,
                handle=suspect.node,
                slowness=suspect,
                windows=state.detector.streak.get(suspect.node, 0),
                window_s=state.window_s,
                corroboration=corroboration(records.get(suspect.node)),
                other_jobs=others,
                move=move,
                remaining_s=remaining,
                restart_cost_s=restart,
                lost_work_s=lost,
            )
        )

    @property
    def pending(self) -> bool:
        """Whether something was found since the last :meth:`take`."""
        return bool(self._found or self._slowed)

    def take(self) -> tuple[list[Finding], list[Slowed]]:
        """What was found since the last call (each once)."""
        found, slowed = self._found, self._slowed
        self._found, self._slowed = [], []
        return found, slowed

    def forget(self, running: Iterable[str]) -> None:
        """Drop the jobs no longer running (their announcements go with them)."""
        keep = set(running)
        self._jobs = {j: s for j, s in self._jobs.items() if j in keep}
        self._said = {e for e in self._said if e.split(".g", 1)[0] in keep}
