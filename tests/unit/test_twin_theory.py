"""metalguard.twin.theory against known limits and a small independent Monte Carlo."""

from __future__ import annotations

import math
import random

import pytest

from metalguard.twin import theory
from metalguard.twin.theory import (
    daly_interval,
    expected_ettr,
    expected_failures,
    expected_wall_s,
    job_rate,
    optimal_interval,
    young_daly_interval,
)


def _simulate(
    work: float,
    tau: float,
    ckpt: float,
    restart: float,
    rate: float,
    rng: random.Random,
    *,
    restart_failures: bool = True,
) -> tuple[float, int]:
    """One job to completion, event by event: (wall seconds, failures).

    Written from the model's words, not from the formulas: each (re)start draws the time
    to the next failure, then runs restart + segments (tau of work, then a checkpoint of
    ckpt, none after the last work) until the work is done or the failure strikes, which
    loses everything since the last completed checkpoint."""
    t, saved, failures = 0.0, 0.0, 0
    while True:
        gap = rng.expovariate(rate) if rate > 0 else math.inf
        if not restart_failures and failures > 0:
            # the simpler model: the restart itself cannot fail; the clock for the next
            # failure starts when progress resumes
            t += restart
            clock = 0.0
        else:
            clock = restart
            if gap < clock:
                t += gap
                failures += 1
                continue
        progress = saved
        while progress < work:
            step = min(tau, work - progress) if tau > 0 else work - progress
            last = progress + step >= work
            seg = step + (0.0 if last else ckpt)
            if clock + seg > gap:
                break
            clock += seg
            progress += step
        if progress >= work:
            return t + clock, failures
        saved = progress
        t += gap
        failures += 1


def _mc(
    n: int, work: float, tau: float, ckpt: float, restart: float, rate: float, **kw: bool
) -> tuple[float, float, float]:
    """Mean wall, its standard error and the mean failures over ``n`` seeded runs."""
    rng = random.Random(f"theory:{work}:{tau}:{ckpt}:{restart}:{rate}:{kw}")
    runs = [_simulate(work, tau, ckpt, restart, rate, rng, **kw) for _ in range(n)]
    walls = [w for w, _ in runs]
    mean = sum(walls) / n
    sd = math.sqrt(sum((w - mean) ** 2 for w in walls) / (n - 1))
    return mean, sd / math.sqrt(n), sum(f for _, f in runs) / n


@pytest.mark.parametrize(
    ("work", "tau", "ckpt", "restart", "mttf"),
    [
        (10_000.0, 1_000.0, 50.0, 200.0, 3_000.0),  # ~3 failures a run, restart matters
        (10_000.0, 2_500.0, 100.0, 600.0, 2_000.0),  # harsh: restart 30 % of the MTTF
        (5_000.0, 700.0, 20.0, 50.0, 10_000.0),  # mild: W not a multiple of tau
        (3_000.0, 0.0, 0.0, 100.0, 5_000.0),  # never checkpoints: all or nothing
    ],
)
def test_expected_wall_matches_monte_carlo(
    work: float, tau: float, ckpt: float, restart: float, mttf: float
) -> None:
    rate = 1.0 / mttf
    mean, se, failures = _mc(4_000, work, tau, ckpt, restart, rate)
    expect = expected_wall_s(work, tau, ckpt, restart, rate)
    assert abs(mean - expect) <= 4 * se, (mean, expect, se)
    assert abs(mean - expect) / expect < 0.03
    assert failures == pytest.approx(expected_failures(work, tau, ckpt, restart, rate), rel=0.06)
    assert expected_ettr(work, tau, ckpt, restart, rate) == pytest.approx(work / expect)


def test_simpler_model_without_failures_during_restart_matches_its_monte_carlo() -> None:
    work, tau, ckpt, restart, rate = 10_000.0, 2_500.0, 100.0, 600.0, 1 / 2_000.0
    mean, se, _ = _mc(4_000, work, tau, ckpt, restart, rate, restart_failures=False)
    simple = expected_wall_s(work, tau, ckpt, restart, rate, restart_failures=False)
    exact = expected_wall_s(work, tau, ckpt, restart, rate)
    assert abs(mean - simple) <= 4 * se, (mean, simple, se)
    # the two models differ measurably here (restart 30 % of the MTTF: failures during
    # restart cost ~4 % more), and this Monte Carlo tells them apart
    assert exact > simple * 1.03
    assert abs(mean - exact) > 4 * se


def test_no_failures_is_work_plus_checkpoints_plus_one_restart() -> None:
    # 9 checkpoints (at 1000, ..., 9000; none at the end of 9,500 s of work)
    assert expected_wall_s(9_500.0, 1_000.0, 30.0, 120.0, 0.0) == pytest.approx(
        9_500 + 9 * 30 + 120
    )
    assert expected_wall_s(9_500.0, 1_000.0, 30.0, 120.0, 0.0, initial_restart=False) == (
        pytest.approx(9_500 + 9 * 30)
    )
    # a multiple of the interval: no checkpoint once the work is done
    assert expected_wall_s(10_000.0, 1_000.0, 30.0, 0.0, 0.0) == pytest.approx(10_000 + 9 * 30)


def test_rate_to_zero_ettr_tends_to_tau_over_tau_plus_c() -> None:
    tau, ckpt = 3_600.0, 120.0
    limit = tau / (tau + ckpt)
    work = 100_000 * tau  # long enough that the restart and the missing last checkpoint vanish
    values = [expected_ettr(work, tau, ckpt, 300.0, r) for r in (1e-6, 1e-8, 1e-10, 0.0)]
    assert values == sorted(values), "fewer failures, more effective time"
    assert values[-1] == pytest.approx(limit, rel=1e-5)
    assert values[-2] == pytest.approx(limit, rel=1e-5)
    assert values[0] < limit * 0.999  # 1e-6 /s over ~3.9e6 s: ~4 failures cost something


def test_rate_limit_is_continuous() -> None:
    args = (50_000.0, 1_000.0, 30.0, 200.0)
    assert expected_wall_s(*args, 1e-12) == pytest.approx(expected_wall_s(*args, 0.0), rel=1e-9)


def test_young_daly_and_the_exact_optimum() -> None:
    assert young_daly_interval(36_000.0, 300.0) == pytest.approx(math.sqrt(2 * 36_000 * 300))
    for mttf, ckpt in [(36_000.0, 300.0), (11_000.0, 60.0), (1_000.0, 100.0), (1_000, 500)]:
        best = optimal_interval(mttf, ckpt)
        rate = 1 / mttf

        def per_work(tau: float, rate: float = rate, ckpt: float = ckpt) -> float:
            return math.expm1(rate * (tau + ckpt)) / tau

        # it is the minimum of the per-work wall
        assert per_work(best) < per_work(best * 1.01)
        assert per_work(best) < per_work(best * 0.99)
        # Daly's higher-order estimate is much closer to it than Young's first order
        daly, young = daly_interval(mttf, ckpt), young_daly_interval(mttf, ckpt)
        assert abs(daly - best) / best < 0.01
        assert abs(daly - best) < abs(young - best)
        assert young > best  # Young's overestimates the optimum (C / M > 0)
    # small C / M: all three agree
    assert young_daly_interval(1e6, 10.0) == pytest.approx(optimal_interval(1e6, 10.0), rel=0.003)
    assert daly_interval(100.0, 300.0) == 100.0  # C >= 2M: Daly says checkpoint every M


def test_the_optimum_minimises_the_closed_form_wall() -> None:
    mttf, ckpt, restart = 20_000.0, 200.0, 300.0
    rate, work = 1 / mttf, 2_000_000.0
    best = optimal_interval(mttf, ckpt)
    grid = [best * 1.05**k for k in range(-10, 11)]
    walls = [expected_wall_s(work, tau, ckpt, restart, rate) for tau in grid]
    assert grid[walls.index(min(walls))] == pytest.approx(best, rel=0.06)


def test_job_rate_and_bad_arguments() -> None:
    assert job_rate(2_048, 419 / (2_048 * 54)) == pytest.approx(419 / (54 * 86_400))
    with pytest.raises(ValueError, match="negative"):
        expected_wall_s(100.0, 10.0, 1.0, 1.0, -1.0)
    with pytest.raises(ValueError, match="positive"):
        optimal_interval(0.0, 1.0)
    assert theory.segments(0.0, 10.0, 1.0) == (0.0, 0, 0.0)
    assert theory.segments(25.0, 10.0, 1.0) == (11.0, 2, 5.0)
    assert theory.segments(20.0, 10.0, 1.0) == (11.0, 1, 10.0)
