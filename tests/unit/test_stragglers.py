"""The straggler detector's pure core (controller/core/stragglers.py): a slow rank is
named against its peers after the persistence window; peers are ranks of one role, so a
pipeline stage heavier by design marks nobody; a whole-job slowdown blames no node;
warm-up and restarts start over; noise marks nobody."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from metalguard.controller.core.stragglers import (
    JobState,
    RankWindow,
    Settings,
    Verdict,
    move_pays,
    observe,
    suspects_across_jobs,
    window_slowness,
)

RULES = Settings(threshold=0.08, persistence=4, warmup_windows=1, min_steps=3)


def job(
    nodes: int = 8,
    ranks_per_node: int = 8,
    *,
    slow: dict[str, float] | None = None,
    stages: int = 1,
    stage_cost: tuple[float, ...] = (1.0,),
    scale: float = 1.0,
    rng: random.Random | None = None,
    jitter: float = 0.0,
) -> list[RankWindow]:
    """One window of a job: ``nodes`` x ``ranks_per_node`` ranks; pipeline stage = node
    index modulo ``stages`` (each stage's cost by design in ``stage_cost``)."""
    out = []
    for n in range(nodes):
        node = f"n{n}"
        stage = n % stages
        for local in range(ranks_per_node):
            base = 0.100 * stage_cost[stage] * scale
            noise = 1.0 + (rng.uniform(-jitter, jitter) if rng else 0.0)
            compute = base * (1.0 + (slow or {}).get(node, 0.0)) * noise
            out.append(
                RankWindow(
                    rank=n * ranks_per_node + local,
                    node=node,
                    compute_s=compute,
                    comm_s=0.02,
                    role=(stage, local) if stages > 1 else (),
                    steps=50,
                )
            )
    return out


def run(windows: list[list[RankWindow]], generation: int = 1) -> list[Verdict]:
    state = JobState()
    return [observe(state, generation, w, RULES) for w in windows]


def test_a_rank_ten_percent_slower_names_its_node_after_the_persistence() -> None:
    verdicts = run([job(slow={"n5": 0.10})] * 8)
    named = [i for i, v in enumerate(verdicts) if v.suspects]
    # window 0 is warm-up; windows 1-4 make the streak: named from window 4 on
    assert named[0] == RULES.warmup_windows + RULES.persistence - 1
    (suspect,) = verdicts[-1].suspects
    assert suspect.node == "n5"
    assert abs(suspect.slowdown - 0.10) < 1e-9
    assert suspect.peers == 63
    assert all(v.job_slowdown is None for v in verdicts)


def test_a_pipeline_stage_heavier_by_design_marks_nobody() -> None:
    """Stage 1 costs 30 % more by design: its ranks are compared with stage-1 peers only."""
    windows = [job(stages=2, stage_cost=(1.0, 1.3))] * 8
    assert all(not v.suspects for v in run(windows))
    # and a straggler inside the heavy stage is still found
    slow = [job(stages=2, stage_cost=(1.0, 1.3), slow={"n3": 0.12})] * 8
    assert [s.node for s in run(slow)[-1].suspects] == ["n3"]


def test_without_roles_the_heavy_stage_would_be_blamed() -> None:
    """The same fleet seen without roles: the heavy stage's nodes all look slow."""
    windows = job(stages=2, stage_cost=(1.0, 1.3))
    flat = [RankWindow(r.rank, r.node, r.compute_s, r.comm_s, (), r.steps) for r in windows]
    slow = {n for n, s in window_slowness(flat).items() if s.slowdown >= RULES.threshold}
    assert slow == {f"n{i}" for i in range(1, 8, 2)}


def test_a_whole_job_slowdown_blames_no_node() -> None:
    # window 0 is warm-up, windows 1-4 set the baseline; then 1.2x for 5 windows
    windows = [job()] * 5 + [job(scale=1.2)] * 5
    verdicts = run(windows)
    assert all(not v.suspects for v in verdicts)
    reported = [i for i, v in enumerate(verdicts) if v.job_slowdown is not None]
    assert reported == [8, 9]  # after the persistence, like a node
    assert verdicts[-1].job_slowdown is not None
    assert abs(verdicts[-1].job_slowdown - 0.2) < 1e-9


def test_a_whole_job_slowdown_needs_the_persistence_and_a_steady_baseline() -> None:
    """One slow window of the whole job (the data) is not a slowdown; nor is a baseline
    set by one fast window: it is the median of the first ``persistence`` windows."""
    fast, slow = job(scale=0.85), job(scale=1.2)
    verdicts = run([job(), fast, job(), job(), job(), slow, job(), slow, job(), job()])
    assert all(v.job_slowdown is None and not v.suspects for v in verdicts)


def test_one_window_under_the_threshold_does_not_start_the_count_again() -> None:
    """A 10 % straggler measured at 7 % in one window (a window's median is noisy) is
    named on time: the streak holds above 3/4 of the threshold, the average decides."""
    slow, dip = job(slow={"n5": 0.10}), job(slow={"n5": 0.07})
    verdicts = run([slow, slow, dip, slow, slow, slow])
    named = [i for i, v in enumerate(verdicts) if v.suspects]
    assert named[0] == RULES.warmup_windows + RULES.persistence - 1
    (suspect,) = verdicts[4].suspects
    assert suspect.node == "n5"
    assert abs(suspect.slowdown - (0.10 + 0.07 + 0.10 + 0.10) / 4) < 1e-9  # the average


def test_a_node_below_the_threshold_on_average_is_not_named() -> None:
    """5 % slower, now and then a window over 8 %: below the threshold on average."""
    low, high = job(slow={"n2": 0.05}), job(slow={"n2": 0.09})
    verdicts = run([low, low, high, low, low, high, low, low, low, high] * 2)
    assert all(not v.suspects for v in verdicts)
    # and one window under 3/4 of the threshold starts the count again
    slow, fine = job(slow={"n2": 0.2}), job(slow={"n2": 0.03})
    assert all(not v.suspects for v in run([slow, slow, slow, fine, slow, slow, slow]))


def test_an_intermittent_slowness_and_a_restart_start_over() -> None:
    slow, fine = job(slow={"n2": 0.2}), job()
    verdicts = run([fine, slow, slow, slow, fine, slow, slow, slow, fine])
    assert all(not v.suspects for v in verdicts)  # never 4 in a row
    state = JobState()
    for w in [slow] * 4:
        observe(state, 1, w, RULES)
    assert not observe(state, 2, slow, RULES).suspects  # a restart: warm-up again
    assert state.streak == {}


def test_too_few_steps_or_peers_say_nothing() -> None:
    lone = [RankWindow(0, "n0", 0.5, role=(0,), steps=50), RankWindow(1, "n1", 0.1, role=(1,))]
    assert window_slowness(lone) == {}
    short = [RankWindow(i, f"n{i}", 0.1 * (1 + i), steps=1) for i in range(4)]
    assert window_slowness(short, min_steps=3) == {}


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000))
def test_noise_within_three_percent_marks_nobody(seed: int) -> None:
    rng = random.Random(seed)
    windows = [job(rng=rng, jitter=0.03) for _ in range(30)]
    assert all(not v.suspects for v in run(windows))


def test_a_move_pays_only_when_the_slowdown_costs_more_than_it() -> None:
    # 10 % slower for 10 h more: 1 h lost; a restart of 5 min and 10 min of redone work
    assert move_pays(0.10, 36_000, 300, 600)
    # the same straggler with 30 min left: 3 min lost, the move costs 15
    assert not move_pays(0.10, 1_800, 300, 600)


def test_a_node_suspected_in_two_jobs_is_a_lemon() -> None:
    marks = [("n1", "a"), ("n1", "a"), ("n1", "b"), ("n2", "a")]
    assert suspects_across_jobs(marks) == {"n1": frozenset({"a", "b"})}
