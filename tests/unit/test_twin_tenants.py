"""The twin's tenants (issue 31): the tenants file read strictly (every error names the
file, the key and the problem), the contracts carved out of the fleet, and the demand
generator (deterministic per seed, bursts and idle periods visible)."""

from __future__ import annotations

import itertools
import random
import statistics
from pathlib import Path

import pytest

from metalguard.controller.jobs.scheduler import FleetNode
from metalguard.twin.errors import TwinInputError
from metalguard.twin.fleet import fleet_from_count, fleet_from_csv
from metalguard.twin.model import DAY_S
from metalguard.twin.tenants import (
    DEFAULT_TENANTS_PATH,
    JobMix,
    Tenant,
    Tenants,
    active_periods,
    all_tenant_jobs,
    can_use,
    default_tenants,
    fitting_sizes,
    generate_tenant_jobs,
    load_tenants,
    partition,
    tenants_dict,
)

NODE_LIST = (
    Path(__file__).parent.parent
    / "fixtures"
    / "traces"
    / "alibaba-gpu-2023"
    / "openb_node_list_gpu_node.csv"
)

TWO = """\
[[tenant]]
name = "a"
share = 0.5
load = 0.6
burstiness = 0.5
[tenant.jobs]
sizes = {8 = 1, 16 = 1}

[[tenant]]
name = "b"
share = 0.25
load = 0.3
"""


def _file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tenants.toml"
    path.write_text(text)
    return path


# --- reading -----------------------------------------------------------------------------


def test_a_file_is_read_with_defaults_for_what_it_leaves_out(tmp_path: Path) -> None:
    spec = load_tenants(_file(tmp_path, TWO))
    a, b = spec.tenants
    assert (a.name, a.share, a.load, a.burstiness, a.cycle_days) == ("a", 0.5, 0.6, 0.5, 14.0)
    assert a.jobs.sizes == ((8, 1.0), (16, 1.0))
    assert a.peak_load == pytest.approx(1.2)
    assert b.jobs == JobMix()
    assert b.burstiness == 0.0
    assert b.peak_load == pytest.approx(0.3)
    assert spec.source == str(tmp_path / "tenants.toml")


def test_load_scale_multiplies_every_load(tmp_path: Path) -> None:
    spec = load_tenants(_file(tmp_path, "load_scale = 2.0\n" + TWO))
    assert [t.load for t in spec.tenants] == [pytest.approx(1.2), pytest.approx(0.6)]
    assert tenants_dict(spec)["load_scale"] == 2.0


def test_the_default_tenants_share_the_whole_fleet() -> None:
    spec = default_tenants()
    assert spec.source == str(DEFAULT_TENANTS_PATH)
    assert 4 <= len(spec.tenants) <= 8
    assert sum(t.share for t in spec.tenants) == pytest.approx(1.0)
    assert len({t.burstiness for t in spec.tenants}) > 2  # steady to bursty
    # contracts sized for the expected peak: active demand within [0.5, 1] of the contract
    assert all(0.5 <= t.peak_load <= 1.0 for t in spec.tenants)


@pytest.mark.parametrize(
    ("text", "where", "problem"),
    [
        ("tenants = 1\n" + TWO, "key tenants", "unknown key"),
        (TWO.replace('name = "b"', 'name = "b"\nshares = 0.1'), "key tenant[1].shares", "unknown"),
        (TWO.replace("sizes = {", "size = {"), "key tenant[0].jobs.size", "unknown key"),
        (TWO.replace("share = 0.25", "share = -0.25"), "key tenant[1].share", "negative"),
        (TWO.replace("share = 0.25", "share = 0"), "key tenant[1].share", "must be above 0"),
        (TWO.replace("share = 0.25", "share = 0.75"), "key tenant.share", "add up to 1.25"),
        (TWO.replace("share = 0.25", "share = 1.5"), "key tenant[1].share", "above 1"),
        (TWO.replace("load = 0.3", 'load = "high"'), "key tenant[1].load", "not a number"),
        (TWO.replace("load = 0.3\n", ""), "key tenant[1].load", "missing"),
        (
            TWO.replace("burstiness = 0.5", "burstiness = 1.0"),
            "key tenant[0].burstiness",
            "below 1",
        ),
        (TWO.replace('name = "b"', 'name = "a"'), "key tenant[1].name", "given twice"),
        (TWO.replace('name = "b"', 'name = "b.c"'), "key tenant[1].name", "not a tenant name"),
        (TWO.replace("8 = 1,", "3 = 1,"), "key tenant[0].jobs.sizes.3", "1, 2 or 4 GPUs"),
        (TWO.replace("16 = 1", "12 = 1"), "key tenant[0].jobs.sizes.12", "whole 8-GPU nodes"),
        (TWO.replace("16 = 1", "16 = 0"), "key tenant[0].jobs.sizes.16", "not positive"),
        ("[x]\n", "key x", "unknown key"),
        ("load_scale = 1.0\n", "key tenant", "no [[tenant]] tables"),
    ],
)
def test_a_bad_file_names_the_key_and_the_problem(
    tmp_path: Path, text: str, where: str, problem: str
) -> None:
    path = _file(tmp_path, text)
    with pytest.raises(TwinInputError) as caught:
        load_tenants(path)
    err = caught.value
    assert err.path == str(path)
    assert err.where == where
    assert problem in err.problem
    assert str(err).startswith(f"{path}: {where}: ")


def test_an_unreadable_or_invalid_file_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(TwinInputError, match="cannot read"):
        load_tenants(tmp_path / "missing.toml")
    with pytest.raises(TwinInputError, match="not valid TOML"):
        load_tenants(_file(tmp_path, "[[tenant]\n"))


# --- contracts ---------------------------------------------------------------------------


def _tenant(name: str, share: float, sizes: tuple[tuple[int, float], ...] = ((8, 1.0),)) -> Tenant:
    return Tenant(name, share, 0.5, jobs=JobMix(sizes=sizes))


def test_each_contract_is_its_share_of_whole_nodes_in_fleet_order() -> None:
    fleet = fleet_from_count(64)
    parts = partition(fleet, [_tenant("a", 0.5), _tenant("b", 0.25), _tenant("c", 0.25)])
    handles = [n.handle for n in fleet]
    assert parts == {"a": tuple(handles[:32]), "b": tuple(handles[32:48]), "c": tuple(handles[48:])}


def test_rounding_never_contracts_more_than_the_shares_allow() -> None:
    fleet = fleet_from_count(10)
    parts = partition(fleet, [_tenant("a", 0.33), _tenant("b", 0.33), _tenant("c", 0.2)])
    sizes = {name: len(h) for name, h in parts.items()}
    assert sum(sizes.values()) == 8  # floor(10 x 0.86): two nodes belong to nobody
    assert sizes == {"a": 3, "b": 3, "c": 2}
    taken = [h for hs in parts.values() for h in hs]
    assert len(taken) == len(set(taken))


def test_small_nodes_go_to_the_tenants_whose_jobs_fit_them() -> None:
    fleet = fleet_from_csv(NODE_LIST)
    gangs = _tenant("gangs", 0.5)
    small = _tenant("small", 0.5, ((1, 1.0), (8, 1.0)))
    parts = partition(fleet, [gangs, small])
    gpus = {n.handle: n.gpus for n in fleet}
    assert {gpus[h] for h in parts["gangs"]} == {8}
    assert {gpus[h] for h in parts["small"]} == {1, 2, 4, 8}
    eights = sum(1 for n in fleet if n.gpus == 8)
    assert abs(len(parts["gangs"]) - len([h for h in parts["small"] if gpus[h] == 8])) <= 1
    assert len(parts["gangs"]) + len([h for h in parts["small"] if gpus[h] == 8]) == eights
    assert sum(len(h) for h in parts.values()) == len(fleet)  # every node contracted


def test_a_tenant_runs_only_the_sizes_its_contract_holds() -> None:
    mix = JobMix(sizes=((2, 1.0), (8, 1.0), (32, 1.0), (512, 1.0)))
    four = fleet_from_count(4)
    assert fitting_sizes(mix, four) == ((2, 1.0), (8, 1.0), (32, 1.0))
    assert can_use(mix, 2)
    assert not can_use(JobMix(sizes=((4, 1.0), (8, 1.0))), 2)


def test_a_tenant_whose_contract_runs_none_of_its_sizes_is_refused() -> None:
    fleet = fleet_from_count(8)
    spec = Tenants((_tenant("a", 0.5, ((64, 1.0),)), _tenant("b", 0.5)), "t.toml")
    parts = partition(fleet, spec.tenants)
    with pytest.raises(TwinInputError) as caught:
        all_tenant_jobs(spec, fleet, parts, 10, 1)
    assert caught.value.path == "t.toml"
    assert caught.value.where == "key tenant[0].jobs.sizes"
    assert "4 nodes, 32 GPUs" in caught.value.problem


# --- demand ------------------------------------------------------------------------------


def _jobs(tenant: Tenant, part: list[FleetNode], days: float, seed: str) -> list[float]:
    return [j.submit_s for j in generate_tenant_jobs(tenant, part, days, random.Random(seed))]


def test_the_same_seed_gives_the_same_jobs() -> None:
    fleet = fleet_from_count(64)
    spec = Tenants((_tenant("a", 0.5), Tenant("b", 0.5, 0.5, burstiness=0.5)), "t")
    parts = partition(fleet, spec.tenants)
    first = all_tenant_jobs(spec, fleet, parts, 30, seed=1)
    assert first == all_tenant_jobs(spec, fleet, parts, 30, seed=1)
    assert first != all_tenant_jobs(spec, fleet, parts, 30, seed=2)
    assert [j.submit_s for j in first] == sorted(j.submit_s for j in first)
    assert {j.tenant for j in first} == {"a", "b"}
    assert all(j.job_id.startswith(f"{j.tenant}-") for j in first)


def test_a_tenants_stream_does_not_depend_on_the_others() -> None:
    fleet = fleet_from_count(64)
    alone = Tenants((_tenant("a", 0.5),), "t")
    both = Tenants((_tenant("a", 0.5), _tenant("b", 0.5)), "t")
    jobs_alone = all_tenant_jobs(alone, fleet, partition(fleet, alone.tenants), 30, 1)
    jobs_both = all_tenant_jobs(both, fleet, partition(fleet, both.tenants), 30, 1)
    assert jobs_alone == tuple(j for j in jobs_both if j.tenant == "a")


def test_the_demand_matches_the_load_in_the_long_run() -> None:
    part = list(fleet_from_count(16))
    mix = JobMix(sizes=((8, 1.0), (16, 1.0)), duration_median_days=0.5, duration_min_days=0.1)
    for burst in (0.0, 0.6):
        tenant = Tenant("a", 1.0, 0.5, burstiness=burst, cycle_days=10, jobs=mix)
        days = 3000
        jobs = generate_tenant_jobs(tenant, part, days, random.Random(f"demand:{burst}"))
        asked = sum(j.work_s * j.gpus for j in jobs)
        assert asked / (128 * days * DAY_S) == pytest.approx(0.5, rel=0.1)


def test_idle_periods_take_the_burstiness_share_of_the_time() -> None:
    tenant = Tenant("a", 1.0, 0.5, burstiness=0.7, cycle_days=14)
    horizon = 20_000 * DAY_S
    periods = active_periods(tenant, horizon, random.Random("periods"))
    active = sum(end - start for start, end in periods)
    assert active / horizon == pytest.approx(0.3, abs=0.03)
    assert all(b[0] > a[1] for a, b in itertools.pairwise(periods))  # gaps
    assert active_periods(Tenant("s", 1.0, 0.5), horizon, random.Random(0)) == ((0.0, horizon),)


def test_a_bursty_tenant_has_idle_weeks_a_steady_one_does_not() -> None:
    part = list(fleet_from_count(32))
    mix = JobMix(sizes=((8, 1.0),), duration_median_days=0.25, duration_min_days=0.05)
    days = 120

    def per_day(burst: float) -> list[int]:
        tenant = Tenant("a", 1.0, 0.5, burstiness=burst, cycle_days=21, jobs=mix)
        counts = [0] * days
        for t in _jobs(tenant, part, days, f"burst:{burst}"):
            counts[int(t // DAY_S)] += 1
        return counts

    def longest_idle(counts: list[int]) -> int:
        best = run = 0
        for c in counts:
            run = run + 1 if c == 0 else 0
            best = max(best, run)
        return best

    steady, bursty = per_day(0.0), per_day(0.6)
    assert longest_idle(steady) <= 1
    assert longest_idle(bursty) >= 7  # an idle week at least
    cv = [statistics.pstdev(c) / statistics.mean(c) for c in (steady, bursty)]
    assert cv[1] > 2 * cv[0]
