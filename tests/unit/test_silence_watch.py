"""SilenceWatch: the nodes whose silence may be due, and a check over those alone finds
the same silent nodes as decide_silence over every node."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from msgspec.structs import replace

from metalguard.controller.core.decide import decide_silence
from metalguard.controller.core.lifecycle import LifecycleConfig, silence_due_ts
from metalguard.controller.core.silence_watch import RECHECK_S, SilenceWatch
from metalguard.proto.base import NodeIdentity
from metalguard.proto.nodes import Grade, NodeRecord

CFG = LifecycleConfig()
T0 = 1_000_000.0


def test_pop_due_gives_the_due_handles_earliest_first_once() -> None:
    watch = SilenceWatch()
    watch.watch("b", 20.0)
    watch.watch("a", 10.0)
    watch.watch("c", 30.0)
    assert watch.pop_due(5.0) == []
    assert watch.pop_due(20.0) == ["a", "b"]
    assert watch.pop_due(20.0) == []
    assert list(watch.pop_due(99.0)) == ["c"]
    assert len(watch) == 0


def test_a_new_time_replaces_the_old_one_either_way() -> None:
    watch = SilenceWatch()
    watch.watch("a", 10.0)
    watch.watch("a", 50.0)  # heard since: later
    assert watch.pop_due(20.0) == []
    watch.watch("a", 15.0)  # a shorter interval: earlier
    assert watch.pop_due(20.0) == ["a"]
    assert watch.pop_due(99.0) == []


def test_forget_and_many_rewatches_keep_the_heap_bounded() -> None:
    watch = SilenceWatch()
    watch.watch("gone", 1.0)
    watch.forget("gone")
    for i in range(10_000):
        watch.watch("a", float(i))
    assert len(watch._heap) <= 2 * len(watch) + 64
    assert watch.pop_due(20_000.0) == ["a"]


def test_rewatch_forgets_what_cannot_fall_silent_and_rechecks_not_before_now() -> None:
    watch = SilenceWatch()
    records = {"a": record("a", 10.0, 5.0), "b": record("b", 10.0, 5.0, grade="FAILING")}
    watch.rewatch(["a", "b", "missing"], records, lambda r: silence_due_ts(r, CFG))
    assert "a" in watch
    assert "b" not in watch
    assert "missing" not in watch
    due = silence_due_ts(records["a"], CFG)
    assert due is not None
    watch.rewatch(["a"], records, lambda r: silence_due_ts(r, CFG), now=due + 100)
    assert watch.pop_due(due + 100) == []
    assert watch.pop_due(due + 100 + RECHECK_S) == ["a"]


def record(name: str, last_seen: float, interval: float, grade: Grade = "HEALTHY") -> NodeRecord:
    return NodeRecord(
        node=NodeIdentity(region="r1", cluster="c1", node=name),
        grade=grade,
        last_seen_ts=last_seen,
        interval_s=interval,
    )


step = st.tuples(
    st.floats(RECHECK_S, 120.0),  # time to the next check: at least RECHECK_S
    st.lists(st.integers(0, 29), max_size=12),  # nodes heard (liveness only)
    st.lists(st.integers(0, 29), max_size=3),  # nodes back in service (a decided change)
    st.booleans(),  # a stall of the intake just before the check
)


@settings(max_examples=150, deadline=None)
@given(
    intervals=st.lists(st.sampled_from([5.0, 10.0, 30.0, 60.0]), min_size=30, max_size=30),
    steps=st.lists(step, min_size=1, max_size=25),
)
def test_watching_finds_the_silent_nodes_a_walk_over_all_finds(
    intervals: list[float],
    steps: list[tuple[float, list[int], list[int], bool]],
) -> None:
    records = {f"n{i}": record(f"n{i}", T0, iv) for i, iv in enumerate(intervals)}
    watch = SilenceWatch()
    watch.rewatch(records, records, lambda r: silence_due_ts(r, CFG, T0))
    changed: set[str] = set()
    now = T0
    stalls: list[tuple[float, float]] = []
    for dt, heard, revived, stall in steps:
        now += dt
        for i in heard:  # a steady batch: only the liveness moves, the watch is not told
            h = f"n{i}"
            if records[h].grade in ("HEALTHY", "SUB_HEALTHY"):
                records[h] = replace(records[h], last_seen_ts=now - dt / 2)
        for i in revived:  # a decided change (a record written): the watch is told
            h = f"n{i}"
            records[h] = replace(records[h], grade="HEALTHY", last_seen_ts=now - dt / 2)
            changed.add(h)
        if stall:
            stalls.append((now - dt / 3, now - dt / 4))
        expected = decide_silence(records, now, CFG, watching_since=T0, stalls=stalls)

        watch.rewatch(changed, records, lambda r: silence_due_ts(r, CFG, T0))
        changed = set()
        due = watch.pop_due(now)
        candidates = {h: records[h] for h in due}
        got = decide_silence(candidates, now, CFG, watching_since=T0, stalls=stalls)
        assert set(got.records) == set(expected.records)
        assert got.records == expected.records
        records.update(got.records)
        changed |= set(got.records)  # UNREACHABLE now: written, so the watch is told
        watch.rewatch(due, records, lambda r: silence_due_ts(r, CFG, T0), now=now)
