"""Stragglers: the node that slows a synchronous job without failing (pure; issue
"Stragglers", the detection part).

In synchronous training every rank leaves each collective together, so a step's wall
time shows that the job slowed, not who slowed it. The culprit computes longest and waits
least: each rank's compute time is compared with its *peers*, the ranks doing the same
work (the same pipeline stage and tensor-parallel slot across the data-parallel
replicas; by default every rank is every other's peer). Per window, a rank's slowness is
its median compute time over its peers' median; a node's is the slowest of its ranks'.

- A node is a **suspect** once it has been slower than its peers in ``persistence``
  consecutive windows, by at least ``threshold`` on average over them and by at least
  three quarters of it (:data:`HOLD_SHARE`) in each (warm-up windows after a start or
  restart, and steps the workload marked as checkpoint or evaluation steps, are not in
  any window). The average, not every window over the threshold: a window's median
  carries a percent or two of noise (more when the step cost varies with the data), and
  one window of a 10 % straggler measured at 7.5 % would otherwise start its count again
  (bench/straggler_bench.py measures both).
- A **whole-job slowdown** (every rank slower than the job's own baseline: shared
  congestion, a slower data shard) is reported as such, by the same rule, and blames no
  node. The baseline is the job's median over its first ``persistence`` windows after
  warm-up (one window's median moves with the data).

Everything here takes the windows as data and returns verdicts: the clock, the
transport and the actions are the caller's.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

DEFAULT_THRESHOLD: Final = 0.08
"""8 % slower than the peers' median."""
DEFAULT_PERSISTENCE: Final = 4
"""Consecutive windows (of 30 s each by default, a job's ``timing_window_s``: two minutes,
not seconds)."""
DEFAULT_WARMUP_WINDOWS: Final = 1
HOLD_SHARE: Final = 0.75
"""A window counts towards a streak when at least this share of ``threshold`` slower (6 %
by default; the streak's average must reach the threshold)."""
MIN_PEERS: Final = 2
"""A role group needs this many ranks (the rank and a peer) to compare anything."""


@dataclass(frozen=True, slots=True)
class RankWindow:
    """One rank's timings over one window (steps marked checkpoint/eval left out)."""

    rank: int
    node: str
    compute_s: float
    """The rank's median compute time per step in the window."""
    comm_s: float = 0.0
    """Its median time waiting in collectives per step."""
    role: tuple[int, ...] = ()
    """Its role (pipeline stage, tensor slot): ranks of one role are peers; () all peers."""
    steps: int = 1


@dataclass(frozen=True, slots=True)
class Settings:
    """The detector's knobs (docs: defaults stated)."""

    threshold: float = DEFAULT_THRESHOLD
    persistence: int = DEFAULT_PERSISTENCE
    warmup_windows: int = DEFAULT_WARMUP_WINDOWS
    min_steps: int = 3
    """A rank's window with fewer steps says nothing (a start, a stall)."""


@dataclass(frozen=True, slots=True)
class NodeSlowness:
    """How much slower a node's ranks computed than their peers in one window."""

    node: str
    slowdown: float
    """The slowest of its ranks: its compute median over its peers' median, minus 1."""
    peers: int
    """How many peer ranks it was compared with."""
    wait_share: float
    """Its ranks' time waiting in collectives over their step time (a straggler waits
    least)."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """What one window adds."""

    suspects: tuple[NodeSlowness, ...] = ()
    """Nodes slower than their peers for ``persistence`` windows, slowest first (their
    ``slowdown``: the average over those windows)."""
    job_slowdown: float | None = None
    """The whole job slower than its baseline by this (every rank alike, the average over
    the last ``persistence`` windows); None: not."""


@dataclass
class JobState:
    """What the detector remembers of one job (per generation)."""

    generation: int = 0
    windows_seen: int = 0
    streak: dict[str, int] = field(default_factory=dict)
    """Consecutive slow windows per node."""
    last: dict[str, NodeSlowness] = field(default_factory=dict)
    baseline_s: float | None = None
    """The job's median compute time per step in its first windows after warm-up."""
    recent: dict[str, list[float]] = field(default_factory=dict)
    """Per node in a streak, its slowdowns in the streak's last ``persistence`` windows."""
    first_medians: list[float] = field(default_factory=list)
    """The job's medians of its first windows after warm-up (until the baseline is set)."""
    job_recent: list[float] = field(default_factory=list)
    """The whole job's slowdowns in its current streak (the last ``persistence``)."""


def window_slowness(ranks: Sequence[RankWindow], min_steps: int = 1) -> dict[str, NodeSlowness]:
    """Each node's slowness against its peers in one window (pure)."""
    groups: dict[tuple[int, ...], list[RankWindow]] = {}
    for r in ranks:
        if r.steps >= min_steps and r.compute_s > 0:
            groups.setdefault(r.role, []).append(r)
    out: dict[str, NodeSlowness] = {}
    for members in groups.values():
        if len(members) < MIN_PEERS:
            continue
        for r in members:
            others = [m.compute_s for m in members if m is not r]
            reference = statistics.median(others)
            slowdown = r.compute_s / reference - 1.0
            step = r.compute_s + r.comm_s
            wait = r.comm_s / step if step > 0 else 0.0
            seen = out.get(r.node)
            if seen is None or slowdown > seen.slowdown:
                out[r.node] = NodeSlowness(r.node, slowdown, len(others), wait)
    return out


def observe(
    state: JobState,
    generation: int,
    ranks: Sequence[RankWindow],
    settings: Settings | None = None,
) -> Verdict:
    """Take in one window of a job's ranks; the suspects and whole-job slowdown it shows.

    A new ``generation`` (a restart, a move) starts the warm-up and the streaks again.
    """
    settings = settings or Settings()
    if generation != state.generation:
        state.generation, state.windows_seen = generation, 0
        state.streak.clear()
        state.last.clear()
        state.recent.clear()
        state.job_recent.clear()
    state.windows_seen += 1
    if state.windows_seen <= settings.warmup_windows:
        return Verdict()
    usable = [r for r in ranks if r.steps >= settings.min_steps and r.compute_s > 0]
    if not usable:
        return Verdict()
    job_median = statistics.median(r.compute_s for r in usable)
    slowness = window_slowness(usable, settings.min_steps)
    hold = settings.threshold * HOLD_SHARE
    for node, s in slowness.items():
        if s.slowdown >= hold:
            state.streak[node] = state.streak.get(node, 0) + 1
            state.last[node] = s
            _keep(state.recent.setdefault(node, []), s.slowdown, settings.persistence)
        else:
            _forget(state, node)
    for node in [n for n in state.streak if n not in slowness]:
        _forget(state, node)
    suspects = sorted(
        (
            _averaged(state.last[n], state.recent[n])
            for n, k in state.streak.items()
            if k >= settings.persistence and _mean(state.recent[n]) >= settings.threshold
        ),
        key=lambda s: (-s.slowdown, s.node),
    )
    if state.baseline_s is None:
        state.first_medians.append(job_median)
        if len(state.first_medians) < settings.persistence:
            return Verdict(suspects=tuple(suspects))
        state.baseline_s = statistics.median(state.first_medians)
        state.first_medians.clear()
    whole = job_median / state.baseline_s - 1.0
    if whole >= hold:
        _keep(state.job_recent, whole, settings.persistence)
    else:
        state.job_recent.clear()
    slow = len(state.job_recent) >= settings.persistence and not suspects
    average = _mean(state.job_recent)
    slow_job = average if slow and average >= settings.threshold else None
    return Verdict(suspects=tuple(suspects), job_slowdown=slow_job)


def _keep(values: list[float], value: float, persistence: int) -> None:
    values.append(value)
    del values[: -max(1, persistence)]


def _forget(state: JobState, node: str) -> None:
    state.streak.pop(node, None)
    state.last.pop(node, None)
    state.recent.pop(node, None)


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def _averaged(last: NodeSlowness, recent: Sequence[float]) -> NodeSlowness:
    return NodeSlowness(last.node, _mean(recent), last.peers, last.wait_share)


def move_pays(
    slowdown: float,
    remaining_s: float,
    restart_cost_s: float,
    lost_work_s: float,
) -> bool:
    """Whether moving the job away from a straggler pays: the time the slowdown would
    still cost (``slowdown`` x the remaining run time) exceeds the restart's cost plus the
    work since the last checkpoint that a move redoes."""
    return slowdown * remaining_s > restart_cost_s + lost_work_s


def suspects_across_jobs(
    marks: Iterable[tuple[str, str]], min_jobs: int = 2
) -> Mapping[str, frozenset[str]]:
    """Nodes suspected in at least ``min_jobs`` different jobs (a lemon): node -> jobs,
    from ``(node, job)`` marks."""
    jobs: dict[str, set[str]] = {}
    for node, job in marks:
        jobs.setdefault(node, set()).add(job)
    return {n: frozenset(j) for n, j in jobs.items() if len(j) >= min_jobs}
