"""take_group: the oldest queued inputs, one per node, at most a limit."""

from __future__ import annotations

from metalguard.controller.round_queue import QueuedInput, take_group


def queued(*handles: str) -> list[QueuedInput]:
    return [QueuedInput(h, lambda: None, float(i)) for i, h in enumerate(handles)]


def test_takes_every_queued_input_in_order() -> None:
    queue = queued("a", "b", "c")
    entries = list(queue)
    assert take_group(queue) == entries
    assert queue == []


def test_a_nodes_later_input_waits_for_the_next_round_in_its_order() -> None:
    queue = queued("a", "b", "a", "c", "a")
    a1, b, a2, c, a3 = queue
    assert take_group(queue) == [a1, b, c]
    assert queue == [a2, a3]
    assert take_group(queue) == [a2]
    assert take_group(queue) == [a3]
    assert queue == []


def test_at_most_the_limit_the_rest_stays_queued() -> None:
    queue = queued(*(f"n{i}" for i in range(10)))
    entries = list(queue)
    assert take_group(queue, limit=4) == entries[:4]
    assert queue == entries[4:]


def test_an_empty_queue_gives_an_empty_round() -> None:
    queue: list[QueuedInput] = []
    assert take_group(queue) == []
