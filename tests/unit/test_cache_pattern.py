"""The dataset cache's access-pattern detector (pure): sequential scans, fresh-shuffle
epochs and skewed hot sets are told apart, with their evidence, from the last window."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from metalguard.agent.cache.pattern import MIN_SAMPLES, WINDOW, PatternDetector
from tests.support.cache_traces import sequential_epochs, shuffled_epochs, skewed

KEYS = [f"train/{i:06d}" for i in range(3000)]


def feed(detector: PatternDetector, trace: list[str], files: int = len(KEYS)) -> None:
    for key in trace:
        directory, name = key.split("/")
        detector.observe(key, directory, int(name), files)


def test_nothing_is_named_before_min_samples():
    d = PatternDetector()
    feed(d, sequential_epochs(KEYS[:10], 1))
    p = d.classify()
    assert p.kind == ""
    assert f"{MIN_SAMPLES} needed" in p.reason


def test_a_sequential_scan_is_sequential_and_says_why():
    d = PatternDetector()
    feed(d, sequential_epochs(KEYS, 1)[:1000])
    p = d.classify()
    assert p.kind == "sequential"
    assert p.sequential_share > 0.9
    assert "followed the one before in name order" in p.reason


def test_interleaved_workers_of_one_sequential_walk_are_sequential():
    """Four DataLoader workers each taking every 4th file, their reads interleaved in a
    jittered order: still one sequential walk."""
    rng = random.Random(2)
    trace: list[str] = []
    for start in range(0, 2000, 4):
        chunk = KEYS[start : start + 4]
        rng.shuffle(chunk)
        trace.extend(chunk)
    d = PatternDetector()
    feed(d, trace)
    assert d.classify().kind == "sequential"


def test_fresh_shuffle_epochs_are_shuffled_in_every_epoch():
    rng = random.Random(3)
    d = PatternDetector()
    trace = shuffled_epochs(KEYS[:1000], 3, rng)
    for epoch in range(3):
        feed(d, trace[epoch * 1000 : (epoch + 1) * 1000])
        p = d.classify()
        assert p.kind == "shuffled", (epoch, p)
        assert p.reuse_share < 0.1, p


def test_a_small_dataset_shuffled_many_times_is_still_shuffled():
    """Reuse is measured against the distinct files seen: 100 files re-read every 100
    reads are epochs, not a hot set, even though the window holds several epochs."""
    rng = random.Random(4)
    d = PatternDetector()
    feed(d, shuffled_epochs(KEYS[:100], 20, rng), files=100)
    assert d.classify().kind == "shuffled"


def test_a_shuffled_tiny_directory_is_not_taken_for_a_walk_but_a_walk_of_it_is():
    """In a directory of 20 files, a random order often lands next to a recent file by
    chance: the successor share must beat chance, not only SEQUENTIAL_SHARE."""
    rng = random.Random(5)
    d = PatternDetector()
    feed(d, shuffled_epochs(KEYS[:20], 30, rng), files=20)
    p = d.classify()
    assert p.kind == "shuffled", p
    assert p.sequential_share >= 0.5, p
    d = PatternDetector()
    feed(d, sequential_epochs(KEYS[:20], 30), files=20)
    assert d.classify().kind == "sequential"


def test_a_hot_set_is_skewed():
    rng = random.Random(5)
    d = PatternDetector()
    feed(d, skewed(KEYS, 3000, rng))
    p = d.classify()
    assert p.kind == "skewed"
    assert p.reuse_share > 0.3


def test_a_change_of_pattern_is_seen_within_a_window():
    rng = random.Random(6)
    d = PatternDetector()
    feed(d, skewed(KEYS, 2000, rng))
    assert d.classify().kind == "skewed"
    feed(d, sequential_epochs(KEYS, 1)[:WINDOW])
    assert d.classify().kind == "sequential"


def test_unknown_places_never_count_as_sequential():
    d = PatternDetector()
    for key in sequential_epochs(KEYS, 1)[:500]:
        d.observe(key)
    assert d.classify().kind == "shuffled"


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 50),
            st.sampled_from(["a", "b"]),
            st.integers(-1, 60),
            st.integers(0, 100),
        ),
        max_size=800,
    )
)
def test_classify_always_answers_with_shares_in_range(accesses):
    d = PatternDetector(window=128, min_samples=16)
    for key, directory, index, files in accesses:
        d.observe(f"{directory}/{key}", directory, index, files)
    p = d.classify()
    assert p.kind in ("", "sequential", "shuffled", "skewed")
    assert 0.0 <= p.sequential_share <= 1.0
    assert 0.0 <= p.reuse_share <= 1.0
    assert p.samples == min(len(accesses), 128)
    assert (p.kind == "") == (p.samples < 16)
