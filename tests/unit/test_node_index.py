"""GET /v1/nodes's index, filters and paging (controller/api/node_index.py, nodes.py)."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping

import msgspec
import pytest

from metalguard.controller.api.errors import ApiError
from metalguard.controller.api.node_index import (
    MAX_LIMIT,
    Field,
    NodeIndex,
    NodeQuery,
    WatchedRecords,
    decode_cursor,
    encode_cursor,
    index_of,
    states_of,
)
from metalguard.controller.api.nodes import parse_list_query
from metalguard.proto.base import NodeIdentity
from metalguard.proto.nodes import Grade, NodeRecord


def rec(
    cluster: str, node: str, grade: Grade = "HEALTHY", rack: str = "k1", cordoned: bool = False
) -> NodeRecord:
    return NodeRecord(
        node=NodeIdentity(region="r1", cluster=cluster, node=node),
        grade=grade,
        rack=rack,
        cordoned=cordoned,
    )


def fleet(n: int, seed: int = 7) -> dict[str, NodeRecord]:
    rng = random.Random(seed)
    out = {}
    for i in range(n):
        grade: Grade = rng.choice(("HEALTHY", "HEALTHY", "HEALTHY", "FAILING", "SUB_HEALTHY"))
        r = rec(f"c{i % 3}", f"n{i:04d}", grade, f"k{i % 5}", cordoned=rng.random() < 0.2)
        out[r.node.handle] = r
    return out


def expected(records: dict[str, NodeRecord], q: NodeQuery) -> list[str]:
    """The reference: a sort and a filter per request (what the route did before)."""
    fields: dict[str, Callable[[NodeRecord], set[str]]] = {
        "grade": lambda r: {r.grade},
        "state": lambda r: set(states_of(r)),
        "region": lambda r: {r.node.region},
        "cluster": lambda r: {r.node.cluster},
        "rack": lambda r: {r.rack},
    }
    return [
        h
        for h, r in sorted(records.items())
        if all(fields[f](r) & values for f, values in q.where.items())
    ]


def walk(index: NodeIndex, q: NodeQuery) -> tuple[list[str], set[int]]:
    """Every page of ``q`` followed by its cursors: the handles and the totals seen."""
    seen: list[str] = []
    totals = set()
    after = q.after
    while True:
        page = index.page(NodeQuery(q.where, q.limit, after))
        seen += page.handles
        totals.add(page.total)
        if page.next_cursor is None:
            return seen, totals
        after = decode_cursor(page.next_cursor)


QUERIES: list[Mapping[Field, frozenset[str]]] = [
    {},
    {"grade": frozenset({"FAILING"})},
    {"grade": frozenset({"HEALTHY", "SUB_HEALTHY"})},
    {"state": frozenset({"cordoned"})},
    {"state": frozenset({"in_service"}), "cluster": frozenset({"c1"})},
    {"rack": frozenset({"k2"}), "grade": frozenset({"FAILING"})},
    {"region": frozenset({"r2"})},
]


@pytest.mark.parametrize("where", QUERIES)
@pytest.mark.parametrize("limit", [1, 7, 500, None])
def test_pages_cover_the_matches_once_in_handle_order(
    where: Mapping[Field, frozenset[str]], limit: int | None
) -> None:
    records = fleet(400)
    q = NodeQuery(where, limit)
    handles, totals = walk(NodeIndex(records.items()), q)
    assert handles == expected(records, q)
    assert totals == {len(handles)}


def test_the_index_follows_writes_and_removals() -> None:
    records = WatchedRecords(fleet(300))
    index = records.index
    rng = random.Random(3)
    for step in range(600):
        handle = rng.choice(sorted(records))
        if step % 7 == 0:
            records.pop(handle)
        elif step % 11 == 0:
            r = rec("c9", f"new{step}", "FAILING", "k9")
            records[r.node.handle] = r
        else:
            grade: Grade = rng.choice(("HEALTHY", "FAILING", "UNREACHABLE"))
            records[handle] = msgspec.structs.replace(
                records[handle], grade=grade, held=step % 2 == 0
            )
        if step % 50 == 0:
            for where in QUERIES:
                q = NodeQuery(where, 13)
                assert walk(index, q)[0] == expected(dict(records), q)
    assert index.grade_counts()["UNREACHABLE"] == sum(
        r.grade == "UNREACHABLE" for r in records.values()
    )
    racks = {key: c.nodes for key, c in index.groups("rack")}
    assert sum(racks.values()) == len(records)
    assert racks[("r1", "c9", "k9")] == sum(r.node.cluster == "c9" for r in records.values())
    clusters = {key: c for key, c in index.groups("cluster")}
    assert set(clusters) == {("r1", c, "") for c in ("c0", "c1", "c2", "c9")}
    cordoned = sum(r.cordoned or r.held for r in records.values())
    assert sum(c.cordoned for c in clusters.values()) == cordoned


def test_a_cursor_resumes_after_its_node_even_when_that_node_is_gone() -> None:
    records = WatchedRecords(fleet(10))
    first = records.index.page(NodeQuery(limit=3))
    assert first.handles == sorted(records)[:3]
    assert first.total == 10
    assert first.next_cursor is not None
    records.pop(first.handles[-1])
    second = records.index.page(NodeQuery(limit=3, after=decode_cursor(first.next_cursor)))
    assert second.handles == sorted(records)[2:5]


def test_index_of_installs_the_watcher_once_and_again_after_a_swap() -> None:
    class Store:
        def __init__(self) -> None:
            self.records: dict[str, NodeRecord] = fleet(5)

    store = Store()
    index = index_of(store)
    assert isinstance(store.records, WatchedRecords)
    assert index_of(store) is index
    store.records = fleet(8)  # a reload
    assert len(index_of(store)) == 8


def test_cursors_are_opaque_and_checked() -> None:
    assert decode_cursor(encode_cursor("r1.c1.n1")) == "r1.c1.n1"
    for bad in ("!!", "bm9kb3Rz", encode_cursor("r1.c1.n1") + "A", "w6g"):
        with pytest.raises(ValueError, match="not a cursor"):
            decode_cursor(bad)


def test_parameters_parse_into_a_query() -> None:
    q = parse_list_query(
        {"grade": "failing, healthy", "state": "Held", "rack": "k1", "limit": "500"}
    )
    assert q.where == {
        "grade": frozenset({"FAILING", "HEALTHY"}),
        "state": frozenset({"held"}),
        "rack": frozenset({"k1"}),
    }
    assert q.limit == 500
    assert q.after == ""
    assert parse_list_query({"cursor": encode_cursor("r1.c1.n9")}).after == "r1.c1.n9"


@pytest.mark.parametrize(
    ("params", "words"),
    [
        ({"limit": "0"}, f"1 to {MAX_LIMIT}"),
        ({"limit": str(MAX_LIMIT + 1)}, "limit"),
        ({"limit": "ten"}, "'ten'"),
        ({"limit": "-1"}, "limit"),
        ({"cursor": "zz!"}, "cursor"),
        ({"state": "asleep"}, "in_service, cordoned, maintenance, held"),
        ({"grade": "SICK"}, "HEALTHY"),
    ],
)
def test_bad_parameters_are_400_saying_what_is_valid(params: dict[str, str], words: str) -> None:
    with pytest.raises(ApiError) as caught:
        parse_list_query(params)
    assert caught.value.status == 400
    assert caught.value.code == "bad_request"
    assert words in caught.value.message
