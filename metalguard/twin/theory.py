"""Closed forms for one checkpointing job under constant-rate failures: what the twin's
engine is validated against (tests/integration/test_twin_validation.py).

The model (Daly 2006, "A higher order estimate of the optimum checkpoint interval for
restart dumps", FGCS 22(3); the "exact" expectation in which failures can also strike
during a restart):

- the job needs ``work_s`` seconds of progress; after every ``interval_s`` seconds of
  progress it writes a checkpoint that takes ``checkpoint_s`` wall seconds (no
  checkpoint once the work is done: the job simply ends);
- failures strike as a Poisson process of ``rate`` per second (a job on N nodes, each
  failing at rate lam, sees N * lam) at any moment the job holds its nodes: while it
  computes, checkpoints or restarts;
- after a failure the job loses the progress since its last *completed* checkpoint and
  restarts: ``restart_s`` wall seconds from the failure until progress resumes. A failure
  during a restart starts the restart again (this is what the twin's engine does: the job
  still holds its nodes while it loads, so a fault there interrupts it again);
- the first start pays the restart cost too (loading the model), as in the engine.

A segment of ``s`` wall seconds (``interval_s`` of work plus a checkpoint) that must run
uninterrupted, after which nothing is lost, takes in expectation (renewal argument: an
attempt either succeeds, time s, probability e^(-rate s), or fails after E[min(X, s)],
then pays a restart, itself a segment of R with the same law, and tries again)::

    T(s) = e^(rate R) (e^(rate s) - 1) / rate

and a (re)start alone ``(e^(rate R) - 1) / rate``. The job's expected wall time is the
sum over its segments (``ceil(W / tau) - 1`` full ones of ``tau + C``, the last of the
remaining work with no checkpoint) plus the first start. Without failures during restart
(``restart_failures=False``, the simpler model) a failure costs exactly R more:
``T(s) = (e^(rate s) - 1) (1 / rate + R)``.

Everything here is pure arithmetic.
"""

from __future__ import annotations

import math

__all__ = [
    "daly_interval",
    "expected_ettr",
    "expected_failures",
    "expected_wall_s",
    "job_rate",
    "optimal_interval",
    "restart_wall_s",
    "segment_wall_s",
    "segments",
    "young_daly_interval",
]

DAY_S = 86_400.0


def job_rate(nodes: int, rate_per_node_day: float) -> float:
    """Failures per second a job on ``nodes`` nodes sees, each failing ``rate_per_node_day``."""
    return nodes * rate_per_node_day / DAY_S


def _expm1_over(rate: float, s: float) -> float:
    """(e^(rate s) - 1) / rate, with its limit s at rate 0."""
    return s if rate == 0.0 else math.expm1(rate * s) / rate


def restart_wall_s(restart_s: float, rate: float, *, restart_failures: bool = True) -> float:
    """Expected wall seconds of one (re)start of ``restart_s`` until progress resumes."""
    if not restart_failures:
        return restart_s
    return _expm1_over(rate, restart_s)


def segment_wall_s(
    segment_s: float, restart_s: float, rate: float, *, restart_failures: bool = True
) -> float:
    """Expected wall seconds to get ``segment_s`` seconds through uninterrupted, every
    failure costing a restart of ``restart_s`` and the segment again from its start."""
    if rate == 0.0:
        return segment_s
    tries = math.expm1(rate * segment_s)  # expected failures before the segment succeeds
    if restart_failures:
        return math.exp(rate * restart_s) * tries / rate
    return tries * (1.0 / rate + restart_s)


def segments(work_s: float, interval_s: float, checkpoint_s: float) -> tuple[float, int, float]:
    """The job's segments: ``(full_wall, full_count, last_wall)``: ``full_count`` of
    ``interval_s + checkpoint_s`` wall seconds each, then the rest of the work with no
    checkpoint after it. ``interval_s`` 0 (or beyond the work): one segment."""
    if work_s <= 0:
        return 0.0, 0, 0.0
    if interval_s <= 0 or interval_s >= work_s:
        return 0.0, 0, work_s
    full = math.ceil(work_s / interval_s) - 1
    return interval_s + checkpoint_s, full, work_s - full * interval_s


def expected_wall_s(
    work_s: float,
    interval_s: float,
    checkpoint_s: float,
    restart_s: float,
    rate: float,
    *,
    restart_failures: bool = True,
    initial_restart: bool = True,
) -> float:
    """Expected wall seconds from the first start until ``work_s`` of progress is done.

    ``rate``: failures per second the job sees (:func:`job_rate`); ``interval_s``:
    progress between checkpoints (0: never); ``checkpoint_s``: wall cost of one;
    ``restart_s``: wall from a failure (or the first start, ``initial_restart``) until
    progress resumes. ``restart_failures``: failures can strike during a restart (Daly's
    exact model, the engine's); False: the simpler model where a restart always takes R.
    """
    if min(work_s, interval_s, checkpoint_s, restart_s, rate) < 0:
        raise ValueError("negative argument")
    full_wall, full_count, last_wall = segments(work_s, interval_s, checkpoint_s)
    rf = restart_failures
    wall = full_count * segment_wall_s(full_wall, restart_s, rate, restart_failures=rf)
    wall += segment_wall_s(last_wall, restart_s, rate, restart_failures=rf)
    if initial_restart:
        wall += restart_wall_s(restart_s, rate, restart_failures=rf)
    return wall


def expected_ettr(
    work_s: float,
    interval_s: float,
    checkpoint_s: float,
    restart_s: float,
    rate: float,
    *,
    restart_failures: bool = True,
    initial_restart: bool = True,
) -> float:
    """Effective training time ratio: ``work_s / expected_wall_s(...)``."""
    wall = expected_wall_s(
        work_s,
        interval_s,
        checkpoint_s,
        restart_s,
        rate,
        restart_failures=restart_failures,
        initial_restart=initial_restart,
    )
    return work_s / wall if wall > 0 else 1.0


def expected_failures(
    work_s: float, interval_s: float, checkpoint_s: float, restart_s: float, rate: float
) -> float:
    """Expected failures the job suffers before it is done (failures during restarts
    included): the rate times the expected wall (a Poisson process over the whole wall)."""
    return rate * expected_wall_s(work_s, interval_s, checkpoint_s, restart_s, rate)


def young_daly_interval(mttf_s: float, checkpoint_s: float) -> float:
    """Young's (1974) first-order optimum interval, ``sqrt(2 * MTTF * C)``."""
    return math.sqrt(2.0 * mttf_s * checkpoint_s)


def daly_interval(mttf_s: float, checkpoint_s: float) -> float:
    """Daly's (2006) higher-order estimate of the optimum interval (compute time between
    checkpoints): ``sqrt(2 C M) [1 + sqrt(C / 2M) / 3 + (C / 2M) / 9] - C`` for C < 2M,
    else M."""
    if checkpoint_s >= 2.0 * mttf_s:
        return mttf_s
    q = checkpoint_s / (2.0 * mttf_s)
    return math.sqrt(2.0 * checkpoint_s * mttf_s) * (1 + math.sqrt(q) / 3 + q / 9) - checkpoint_s


def optimal_interval(mttf_s: float, checkpoint_s: float) -> float:
    """The exact minimiser of the model's wall per unit of work, ``(e^(rate (tau + C)) -
    1) / tau`` (the restart cost only scales it): ``tau = M (1 + W0(-e^(-1 - C/M)))``,
    found here as the root of ``(1 - x) e^(x + c) = 1`` in ``x = tau / M`` (0 < x < 1)."""
    if mttf_s <= 0 or checkpoint_s <= 0:
        raise ValueError("mttf_s and checkpoint_s must be positive")
    c = checkpoint_s / mttf_s
    lo, hi = 0.0, 1.0  # f(0) = e^c - 1 > 0, f(1) = -1, f decreasing on (0, 1)
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if (1.0 - mid) * math.exp(mid + c) > 1.0:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-15:
            break
    return mttf_s * 0.5 * (lo + hi)
