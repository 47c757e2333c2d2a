"""The on-disk spool: FIFO order, restarts, bounds, damaged files, drop accounting."""

from __future__ import annotations

import logging
import tempfile
from collections import deque
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metalguard.agent.spool import Spool, SpoolEntry, SpoolError, StoredEntry, encode_entry


def entry(i: int, size: int = 10) -> SpoolEntry:
    return SpoolEntry(subject=f"mg.tel.r.c.n{i % 3}", msg_id=f"r.c.n:{i}", payload=bytes(size))


def ids(stored: list[StoredEntry]) -> list[str]:
    return [s.entry.msg_id for s in stored]


def entry_size(i: int, size: int = 10) -> int:
    return len(encode_entry(entry(i, size)))


def test_fifo_order_peek_and_ack(tmp_path: Path) -> None:
    with Spool(tmp_path, max_bytes=1 << 20) as spool:
        for i in range(5):
            assert spool.append(entry(i)) == 0
        assert len(spool) == 5
        head = spool.peek(3)
        assert ids(head) == ["r.c.n:0", "r.c.n:1", "r.c.n:2"]
        assert head[0].entry == entry(0)
        assert spool.ack(head[1].index) == 2
        assert ids(spool.peek(10)) == ["r.c.n:2", "r.c.n:3", "r.c.n:4"]
        assert spool.remove_upto(10**9) == 3
        assert len(spool) == 0
        assert spool.size_bytes == 0
        assert spool.peek(5) == []


def test_survives_reopen_and_keeps_appending_in_order(tmp_path: Path) -> None:
    with Spool(tmp_path, max_bytes=1 << 20) as spool:
        spool.append_many([entry(i) for i in range(3)])
        size = spool.size_bytes
    with Spool(tmp_path, max_bytes=1 << 20) as spool:
        assert len(spool) == 3
        assert spool.size_bytes == size
        spool.append(entry(3))
        assert ids(spool.peek(10)) == [f"r.c.n:{i}" for i in range(4)]


def test_a_second_owner_is_refused_until_the_first_closes(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=1 << 20)
    with pytest.raises(SpoolError, match="in use"):
        Spool(tmp_path, max_bytes=1 << 20)
    spool.close()
    Spool(tmp_path, max_bytes=1 << 20).close()


def test_byte_bound_drops_oldest_and_counts(tmp_path: Path) -> None:
    one = entry_size(0)
    with Spool(tmp_path, max_bytes=3 * one) as spool:
        dropped = [spool.append(entry(i)) for i in range(5)]
        assert dropped == [0, 0, 0, 1, 1]
        assert spool.dropped_total == 2
        assert spool.lost_total == 2
        assert ids(spool.peek(10)) == ["r.c.n:2", "r.c.n:3", "r.c.n:4"]
        assert spool.size_bytes <= 3 * one


def test_entry_bound_drops_oldest(tmp_path: Path) -> None:
    with Spool(tmp_path, max_bytes=1 << 20, max_entries=2) as spool:
        assert spool.append_many([entry(i) for i in range(5)]) == 3
        assert ids(spool.peek(10)) == ["r.c.n:3", "r.c.n:4"]


def test_entry_larger_than_the_spool_is_refused(tmp_path: Path) -> None:
    with Spool(tmp_path, max_bytes=100) as spool:
        spool.append(entry(0))
        assert spool.append(entry(1, size=500)) == 1
        assert ids(spool.peek(10)) == ["r.c.n:0"]


def test_smaller_bound_at_reopen_drops_oldest(tmp_path: Path) -> None:
    with Spool(tmp_path, max_bytes=1 << 20) as spool:
        spool.append_many([entry(i) for i in range(4)])
    with Spool(tmp_path, max_bytes=1 << 20, max_entries=1) as spool:
        assert spool.dropped_total == 3
        assert ids(spool.peek(10)) == ["r.c.n:3"]


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda data: data[: len(data) // 2], id="torn"),
        pytest.param(lambda data: b"\x00garbage" * 5, id="garbage"),
        pytest.param(lambda data: data[:-1] + bytes([data[-1] ^ 1]), id="bitflip"),
        pytest.param(lambda data: b"", id="empty"),
    ],
)
def test_damaged_entry_is_skipped_logged_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: object
) -> None:
    with Spool(tmp_path, max_bytes=1 << 20) as spool:
        spool.append_many([entry(i) for i in range(3)])
    victim = sorted(tmp_path.glob("*.msg"))[1]
    victim.write_bytes(damage(victim.read_bytes()))  # type: ignore[operator]
    (tmp_path / ".00000000000000000009.tmp").write_bytes(b"half-written")
    with (
        caplog.at_level(logging.WARNING, logger="metalguard.agent.spool"),
        Spool(tmp_path, 1 << 20) as spool,
    ):
        assert ids(spool.peek(10)) == ["r.c.n:0", "r.c.n:2"]
        assert spool.corrupt_total == 1
        assert spool.lost_total == 1
        assert len(spool) == 2
        assert spool.size_bytes == 2 * entry_size(0)
    assert "corrupt entry" in caplog.text
    assert not victim.exists()
    assert not list(tmp_path.glob("*.tmp"))


def test_unreported_drops_are_carried_over_a_restart(tmp_path: Path) -> None:
    with Spool(tmp_path, max_bytes=1 << 20) as spool:
        assert spool.take_unreported_drops() == 0
        spool.add_unreported_drops(3)
        spool.add_unreported_drops(2)
    with Spool(tmp_path, max_bytes=1 << 20) as spool:
        assert spool.take_unreported_drops() == 5
        assert spool.take_unreported_drops() == 0


# --- property: any sequence of appends, acks and reopens is a bounded FIFO ----------------

Op = tuple[str, int]
ops = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(min_value=0, max_value=300)),
        st.tuples(st.just("ack"), st.integers(min_value=0, max_value=6)),
        st.tuples(st.just("reopen"), st.just(0)),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(ops=ops, max_entries=st.one_of(st.none(), st.integers(min_value=1, max_value=8)))
def test_property_fifo_and_bounds(ops: list[Op], max_entries: int | None) -> None:
    max_bytes = 1200
    with tempfile.TemporaryDirectory() as d:
        directory = Path(d)
        spool = Spool(directory, max_bytes, max_entries)
        model: deque[tuple[str, int]] = deque()  # (msg_id, file size)
        model_dropped = 0
        counter = 0
        try:
            for op, arg in ops:
                if op == "append":
                    e = SpoolEntry("mg.tel.r.c.n", f"id-{counter}", bytes(arg))
                    counter += 1
                    size = len(encode_entry(e))
                    if size > max_bytes:
                        expected = 1
                    else:
                        expected = 0
                        while model and (
                            sum(s for _, s in model) + size > max_bytes
                            or (max_entries is not None and len(model) + 1 > max_entries)
                        ):
                            model.popleft()
                            expected += 1
                        model.append((e.msg_id, size))
                    assert spool.append(e) == expected
                    model_dropped += expected
                elif op == "ack":
                    head = spool.peek(arg)
                    if head:
                        spool.ack(head[-1].index)
                        for _ in head:
                            model.popleft()
                else:
                    spool.close()
                    spool = Spool(directory, max_bytes, max_entries)
                    model_dropped = 0  # counters are per Spool object
                assert ids(spool.peek(100)) == [m for m, _ in model]
                assert spool.size_bytes == sum(s for _, s in model) <= max_bytes
                assert max_entries is None or len(spool) <= max_entries
                assert spool.dropped_total == model_dropped
        finally:
            spool.close()
