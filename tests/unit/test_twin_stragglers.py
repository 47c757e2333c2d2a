"""The twin's stragglers (docs/twin.md "Stragglers"): fail-slow nodes in the failure
model, a job slowed to its slowest node's pace, the detector's verdict (the node marked
SUB_HEALTHY, the job moved off it when ``move_pays``), the report's ``stragglers``
section and the command's flags. Small fleets with chosen episodes, the real health
model and job machine; times worked out by hand from the job's costs."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest

from metalguard.cli import build_parser
from metalguard.twin import jobs as twin_jobs
from metalguard.twin import report as rep
from metalguard.twin.cli import _policy, build_inputs
from metalguard.twin.engine import Engine, run
from metalguard.twin.errors import TwinInputError
from metalguard.twin.failures import (
    draw_faults,
    draw_stragglers,
    load_failure_model,
    model_dict,
    sample_slowdown,
    with_straggler_rate,
)
from metalguard.twin.fleet import fleet_from_count
from metalguard.twin.generator import GangParams, generate_gangs
from metalguard.twin.health import HealthModel
from metalguard.twin.model import (
    DAY_S,
    DEFAULT_SLOWDOWN,
    DEFAULT_STRAGGLER_RATE_PER_NODE_DAY,
    Distribution,
    FailureModel,
    JobOutcomeRecord,
    PlannedMaintenance,
    Policy,
    Slowdown,
    Straggler,
    StragglerModel,
    TwinInputs,
    TwinResult,
)
from metalguard.twin.policies import POLICIES
from tests.support.twin_results import result as hand_made_result
from tests.support.twin_small import (
    CLEAN_END,
    JOB,
    START,
    first_node,
    inputs,
    placement,
)

STATIC, REACTIVE, METALGUARD = POLICIES["static"], POLICIES["reactive"], POLICIES["metalguard"]
NO_DETECTION = replace(METALGUARD, straggler_detection=False)

LONG = replace(JOB, job_id="long", work_s=36_000.0)  # 10 h of work
SLOW = 0.25  # 1.25 x the wall per second of the job's own schedule: exact in binary
AT = START + 1000.0  # the slowdown starts 1,000 s into the job's schedule
FOREVER = 10 * DAY_S


def straggler(
    node: str, at: float = AT, slowdown: float = SLOW, duration: float = FOREVER
) -> Straggler:
    return Straggler(
        straggler_id=1,
        node=node,
        at_s=at,
        slowdown=slowdown,
        duration_s=duration,
        repair_s=3600.0,
    )


def simulate(
    inp: TwinInputs,
    policy: Policy,
    stragglers: tuple[Straggler, ...] = (),
    planned: tuple[PlannedMaintenance, ...] = (),
) -> TwinResult:
    health = HealthModel(inp.nodes, policy)
    engine = Engine(inp, policy, faults=(), planned=planned, stragglers=stragglers, health=health)
    return engine.run()


def record(result: TwinResult, job_id: str = "j") -> JobOutcomeRecord:
    (rec,) = [r for r in result.jobs if r.job_id == job_id]
    return rec


# --- the generation's own clock, pure ----------------------------------------------------


def test_a_generations_clock_runs_slower_by_its_pace_and_back() -> None:
    g = twin_jobs.Generation(attempt=0, number=1, t0=100.0, s0=0, nodes=("a", "b"))
    assert (g.clock(600.0), g.wall(500.0), g.slowed(600.0)) == (500.0, 600.0, 0.0)
    g.set_pace(1100.0, 1.25)  # 1,000 s of its schedule behind it
    assert g.clock(1600.0) == 1000.0 + 500.0 / 1.25
    assert g.wall(1400.0) == 1100.0 + 400.0 * 1.25
    assert g.slowed(1600.0) == 100.0
    g.set_pace(2100.0, 1.0)  # the slowdown ends: 800 s of its clock in 1,000 s of wall
    assert g.clock(2100.0) == 1800.0
    assert g.clock(3100.0) == 2800.0
    assert g.slowed(3100.0) == 200.0
    for own in (50.0, 1000.0, 1500.0, 1800.0, 2500.0):
        assert g.clock(g.wall(own)) == pytest.approx(own)


# --- without detection: the job at its slowest node's pace ---------------------------------


@pytest.mark.parametrize("policy", [STATIC, REACTIVE, NO_DETECTION], ids=lambda p: p.name)
def test_a_straggler_slows_the_job_by_its_factor_until_the_end(policy: Policy) -> None:
    inp = inputs()
    result = simulate(inp, policy, (straggler(first_node(inp)),))
    rec = record(result)
    # 1,000 s of its 4,200 s schedule done at the slowdown; the other 3,200 take 1.25 x
    assert rec.end_s == AT + 3200.0 * 1.25
    assert rec.slowed_s == 3200.0 * SLOW
    assert (rec.state, rec.done_s, rec.redone_s, rec.unplanned, rec.planned) == (
        "succeeded",
        3600.0,
        0.0,
        0,
        0,
    )
    assert result.decisions["straggler:episodes"] == 1
    assert "straggler:detected" not in result.decisions
    report = rep.build_report(result)["stragglers"]
    assert report["gpu_hours_slowed"] == pytest.approx(800.0 * 16 / 3600)
    assert (report["episodes"], report["moves"], report["detection"]) == (1, 0, False)


def test_a_straggler_that_clears_slows_the_job_only_meanwhile() -> None:
    inp = inputs()
    result = simulate(inp, REACTIVE, (straggler(first_node(inp), duration=2000.0),))
    rec = record(result)
    # 2,000 s of wall at 1.25 x: 1,600 s of the schedule, 400 s lost
    assert rec.end_s == CLEAN_END + 400.0
    assert rec.slowed_s == 400.0
    assert result.decisions["straggler:cleared"] == 1


def test_a_straggler_on_a_node_the_job_does_not_use_changes_nothing() -> None:
    inp = inputs()
    (idle,) = [n.handle for n in inp.nodes if n.handle not in placement(inp)]
    rec = record(simulate(inp, REACTIVE, (straggler(idle),)))
    assert (rec.end_s, rec.slowed_s) == (CLEAN_END, 0.0)


def test_a_job_placed_on_a_slow_node_runs_slowed_from_its_start() -> None:
    inp = inputs()
    rec = record(simulate(inp, REACTIVE, (straggler(first_node(inp), at=0.0),)))
    assert rec.end_s == START + 4200.0 * 1.25
    assert rec.slowed_s == 4200.0 * SLOW


def test_the_nodes_repair_ends_its_slowdown() -> None:
    """Planned maintenance moves the job off the node with a fresh checkpoint; the node
    comes back repaired, its slowdown gone."""
    inp = inputs()
    node = first_node(inp)
    window = (PlannedMaintenance(node=node, at_s=2000.0, duration_s=3600.0),)
    result = simulate(inp, REACTIVE, (straggler(node),), window)
    assert result.decisions["straggler:repaired"] == 1
    assert "straggler:cleared" not in result.decisions
    rec = record(result)
    assert rec.slowed_s == (2000.0 - AT) * SLOW / (1 + SLOW)  # until the move's checkpoint
    assert rec.planned == 1


# --- with detection: marked, moved when it pays ---------------------------------------------


def test_with_detection_a_long_job_is_moved_off_the_straggler() -> None:
    inp = inputs((LONG,))
    node = first_node(inp, LONG)
    result = simulate(inp, METALGUARD, (straggler(node),))
    rec = record(result, "long")
    delay = METALGUARD.straggler_delay_s
    assert delay == 150.0  # 1 warm-up + 4 windows of 30 s
    detected = AT + delay
    # its clock at the verdict: 1,000 + 150 / 1.25 = 1,120 s = 300 restart + 660 + 160:
    # 760 s of work done, 35,240 to go, 44,050 s at its slowed step time; 0.25 x 44,050 >
    # 300 restart + 190 s since its last checkpoint (at 1,060) as the job manager weighs it
    assert result.decisions["straggler:detected"] == 1
    assert result.decisions["straggler:moved"] == 1
    assert result.decisions["grade:HEALTHY->SUB_HEALTHY"] == 1
    assert result.decisions["move:straggler"] == 1
    # a fresh checkpoint (60 s), placed at once on the two other nodes, restarted from
    # step 760: 300 + 35,240 + 58 checkpoints x 60
    resumed = detected + 60.0
    assert rec.end_s == pytest.approx(resumed + 300.0 + 35_240.0 + 58 * 60.0)
    assert (rec.state, rec.redone_s, rec.unplanned, rec.planned) == ("succeeded", 0.0, 0, 1)
    assert rec.slowed_s == pytest.approx(delay * SLOW / (1 + SLOW))
    assert (rec.straggler_moves, rec.straggler_move_s) == (1, 360.0)
    assert result.decisions["interruption:planned:straggler"] == 1
    # the marked node, its job gone, drained (MAINTENANCE) and went to repair
    assert result.decisions["straggler:drained"] == 1
    assert result.decisions["grade:SUB_HEALTHY->MAINTENANCE"] == 1
    assert result.decisions["straggler:repaired"] == 1
    report = rep.build_report(result)
    assert report["stragglers"]["moves"] == 1
    assert report["stragglers"]["gpu_hours_moves"] == pytest.approx(360.0 * 16 / 3600)
    assert report["stragglers"]["detection_delay_s"] == 150.0
    assert report["interruptions"]["by_cause"]["planned"] == {"straggler": 1}


def test_with_detection_a_short_job_finishes_slowed_when_moving_would_not_pay() -> None:
    inp = inputs()
    node = first_node(inp)
    at = START + 3500.0  # 700 s of its schedule left
    result = simulate(inp, METALGUARD, (straggler(node, at=at),))
    rec = record(result)
    # at the verdict (150 s later: its clock 3,620) 580 s of work to go, 725 s at its pace:
    # 0.25 x 725 = 181 < 300 restart + 25 s since its last checkpoint (at 3,725): it
    # stays, slowed to its end
    assert result.decisions["straggler:detected"] == 1
    assert result.decisions["straggler:kept"] == 1
    assert "straggler:moved" not in result.decisions
    assert rec.end_s == at + 700.0 * 1.25
    assert rec.slowed_s == 700.0 * SLOW
    assert (rec.unplanned, rec.planned, rec.straggler_moves) == (0, 0, 0)
    # no new work while it ran there (SUB_HEALTHY); its job done, the node drained
    assert result.decisions["grade:HEALTHY->SUB_HEALTHY"] == 1
    assert result.decisions["straggler:drained"] == 1


def test_a_slowdown_below_the_detectors_threshold_is_not_found() -> None:
    inp = inputs((LONG,))
    result = simulate(inp, METALGUARD, (straggler(first_node(inp, LONG), slowdown=0.05),))
    rec = record(result, "long")
    assert result.decisions["straggler:below_threshold"] == 1
    assert "straggler:detected" not in result.decisions
    assert rec.slowed_s > 0
    assert rec.straggler_moves == 0


def test_a_one_node_job_has_no_peers_to_compare_with() -> None:
    one = replace(LONG, nodes=1)
    inp = inputs((one,))
    result = simulate(inp, METALGUARD, (straggler(first_node(inp, one)),))
    assert "straggler:detected" not in result.decisions
    assert record(result, "long").slowed_s > 0


def test_no_straggler_decisions_without_the_detector() -> None:
    inp = inputs((LONG,))
    for policy in (REACTIVE, NO_DETECTION):
        result = simulate(inp, policy, (straggler(first_node(inp, LONG)),))
        assert "straggler:detected" not in result.decisions
        assert "grade:HEALTHY->SUB_HEALTHY" not in result.decisions
        # its schedule: 300 + 36,000 + 59 checkpoints x 60; 1,000 s of it before the slowdown
        schedule = 300.0 + LONG.work_s + 59 * 60.0
        assert record(result, "long").slowed_s == (schedule - 1000.0) * SLOW


# --- zero stragglers changes nothing -----------------------------------------------------------


def fleet_inputs(model: FailureModel, days: float = 6.0) -> TwinInputs:
    nodes = fleet_from_count(64, rack_nodes=16)
    gangs = generate_gangs(GangParams(), 64 * 8, days, random.Random("3:gangs"))
    return TwinInputs(nodes=nodes, jobs=gangs, failures=model, days=days, seed=3)


def test_zero_stragglers_give_the_same_report_as_a_model_without_them() -> None:
    from metalguard.twin.failures import default_failure_model

    base = default_failure_model()
    zero = with_straggler_rate(base, 0.0)
    for policy in POLICIES.values():
        before = rep.build_report(run(fleet_inputs(base), policy))
        after = rep.build_report(run(fleet_inputs(zero), policy))
        assert rep.dumps_report(before) == rep.dumps_report(after)
        assert before["stragglers"]["episodes"] == 0
        assert before["stragglers"]["gpu_hours_slowed"] == 0.0
        assert not any(k.startswith("straggler:") for k in before["decisions"])
    table = rep.compare_table([before])
    assert "straggler" not in table


def test_stragglers_leave_the_faults_as_they_were_and_runs_repeat() -> None:
    from metalguard.twin.failures import default_failure_model

    model = with_straggler_rate(default_failure_model(), 0.05)
    inp = fleet_inputs(model)
    first = run(inp, METALGUARD)
    assert first.stragglers
    base = draw_faults(default_failure_model(), inp.nodes, inp.days, random.Random("3:faults"))
    assert first.faults == base
    again = run(inp, METALGUARD)
    assert rep.dumps_report(rep.build_report(first)) == rep.dumps_report(rep.build_report(again))
    slowed = rep.build_report(run(inp, REACTIVE))["stragglers"]["gpu_hours_slowed"]
    assert slowed > 0
    assert "straggler episodes" in rep.compare_table([rep.build_report(first)])


# --- the failure model ---------------------------------------------------------------------


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "f.toml"
    path.write_text(text)
    return path


def test_a_stragglers_table_turns_them_on_with_the_stated_defaults(tmp_path: Path) -> None:
    model = load_failure_model(write(tmp_path, "[stragglers]\n"))
    assert model.stragglers == StragglerModel(rate_per_node_day=DEFAULT_STRAGGLER_RATE_PER_NODE_DAY)
    assert model.stragglers.slowdown.mean == pytest.approx(0.29)
    assert load_failure_model(write(tmp_path, "")).stragglers.rate_per_node_day == 0.0
    text = """
[stragglers]
rate_per_node_day = 0.01
duration = {kind = "fixed", mean_s = 600}
repair = {kind = "exponential", mean_s = 3600}
[stragglers.slowdown]
kind = "discrete"
values = [0.1, 0.5]
weights = [3, 1]
"""
    model = load_failure_model(write(tmp_path, text))
    sm = model.stragglers
    assert sm.rate_per_node_day == 0.01
    assert sm.slowdown == Slowdown("discrete", (0.1, 0.5), (3.0, 1.0))
    assert sm.slowdown.mean == pytest.approx(0.2)
    assert (sm.duration, sm.repair) == (
        Distribution("fixed", 600.0),
        Distribution("exponential", 3600.0),
    )
    assert model_dict(model)["stragglers"] == {
        "rate_per_node_day": 0.01,
        "slowdown": {"kind": "discrete", "mean": 0.2, "values": [0.1, 0.5], "weights": [3, 1]},
        "duration": {"kind": "fixed", "mean_s": 600.0},
        "repair": {"kind": "exponential", "mean_s": 3600.0},
    }
    fixed = load_failure_model(
        write(tmp_path, '[stragglers]\nslowdown = {kind = "fixed", value = 0.3}\n')
    )
    assert fixed.stragglers.slowdown.mean == 0.3
    logn = load_failure_model(
        write(
            tmp_path,
            '[stragglers]\nslowdown = {kind = "lognormal", median = 0.2, sigma = 0.5, '
            "min = 0.1, max = 0.4}\n",
        )
    )
    rng = random.Random(1)
    draws = [sample_slowdown(logn.stragglers.slowdown, rng) for _ in range(2000)]
    assert min(draws) >= 0.1
    assert max(draws) <= 0.4
    assert 0.1 in draws
    assert 0.4 in draws


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[stragglers]\nrate_per_node_day = -1\n", "stragglers.rate_per_node_day"),
        ("[stragglers]\nrate = 1\n", "stragglers.rate"),
        ('[stragglers]\nslowdown = {kind = "weird"}\n', "stragglers.slowdown.kind"),
        ('[stragglers]\nslowdown = {kind = "fixed"}\n', "stragglers.slowdown.value"),
        (
            '[stragglers]\nslowdown = {kind = "fixed", value = 0.1, median = 2}\n',
            "stragglers.slowdown.median",
        ),
        (
            "[stragglers]\nslowdown = {values = [0.1, 0.2], weights = [1]}\n",
            "stragglers.slowdown.weights",
        ),
        ("[stragglers]\nslowdown = {values = []}\n", "stragglers.slowdown.values"),
        ("[stragglers]\nslowdown = {values = [0.1], weights = [0]}\n", "stragglers.slowdown"),
        (
            '[stragglers]\nslowdown = {kind = "lognormal", median = 0.2, min = 0.5, max = 0.1}\n',
            "stragglers.slowdown.min",
        ),
        ('[stragglers]\nduration = {kind = "fixed"}\n', "stragglers.duration.mean_s"),
    ],
)
def test_bad_straggler_tables_name_the_key(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(TwinInputError, match=f"key {key}"):
        load_failure_model(write(tmp_path, text))


def test_draws_are_a_poisson_process_with_the_slowdown_mix() -> None:
    nodes = [f"n{i}" for i in range(1000)]
    model = StragglerModel(rate_per_node_day=0.01)
    drawn = draw_stragglers(model, nodes, 100.0, random.Random("1:stragglers"))
    assert drawn == draw_stragglers(model, nodes, 100.0, random.Random("1:stragglers"))
    assert len(drawn) == pytest.approx(1000, rel=0.1)  # 0.01 x 1,000 nodes x 100 days
    assert [s.straggler_id for s in drawn] == list(range(1, len(drawn) + 1))
    assert all(0 <= s.at_s < 100 * DAY_S for s in drawn)
    assert {s.slowdown for s in drawn} == set(DEFAULT_SLOWDOWN.values)
    mean = sum(s.slowdown for s in drawn) / len(drawn)
    assert mean == pytest.approx(DEFAULT_SLOWDOWN.mean, abs=0.02)
    assert draw_stragglers(StragglerModel(), nodes, 100.0, random.Random(1)) == ()


# --- the report and the command ------------------------------------------------------------


def test_the_report_states_what_stragglers_cost() -> None:
    base = hand_made_result()
    jobs = (
        replace(base.jobs[0], slowed_s=360.0, straggler_moves=1, straggler_move_s=720.0),
        *base.jobs[1:],
    )
    episodes = (straggler("twin.c0.n0"), straggler("twin.c0.n1"))
    result = replace(base, jobs=jobs, stragglers=episodes, decisions={"straggler:moved": 1})
    section = rep.build_report(result)["stragglers"]
    gpus = jobs[0].gpus
    assert section == {
        "detection": False,  # the hand-made policy has no detector
        "detection_delay_s": None,
        "episodes": 2,
        "gpu_hours_slowed": pytest.approx(360.0 * gpus / 3600),
        "moves": 1,
        "gpu_hours_moves": pytest.approx(720.0 * gpus / 3600),
        "decisions": {"moved": 1},
    }
    on = rep.build_report(replace(result, policy=replace(METALGUARD)))["stragglers"]
    assert (on["detection"], on["detection_delay_s"]) == (True, 150.0)


def test_the_commands_straggler_flags(tmp_path: Path) -> None:
    parser = build_parser()
    args = parser.parse_args(["twin", "run", "--nodes", "16"])
    assert (args.straggler_rate, args.no_straggler_detection, args.straggler_window) == (
        None,
        False,
        None,
    )
    assert _policy("metalguard", args) == METALGUARD
    args = parser.parse_args(
        ["twin", "compare", "--nodes", "16", "--no-straggler-detection", "--straggler-window",
         "60", "--straggler-rate", "0.01"]
    )  # fmt: skip
    policy = _policy("metalguard", args)
    assert (policy.straggler_detection, policy.straggler_window_s) == (False, 60.0)
    assert policy.straggler_delay_s == 300.0
    inp = build_inputs("16", days=1.0, seed=0, straggler_rate=0.01, no_gangs=True)
    assert inp.failures.stragglers == StragglerModel(rate_per_node_day=0.01)
    assert inp.workload["straggler_rate_per_node_day"] == 0.01
    path = write(tmp_path, '[stragglers]\nslowdown = {kind = "fixed", value = 0.3}\n')
    inp = build_inputs(
        "16", days=1.0, seed=0, failures=str(path), straggler_rate=0.5, no_gangs=True
    )
    assert inp.failures.stragglers.rate_per_node_day == 0.5
    assert inp.failures.stragglers.slowdown.mean == 0.3  # the file's, at the flag's rate
    for bad in (["--straggler-rate", "-1"], ["--straggler-window", "0"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["twin", "run", "--nodes", "8", *bad])
