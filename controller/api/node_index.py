"""The index behind ``GET /v1/nodes`` and ``GET /v1/summary`` (docs/api.md "Paging"):
node handles kept sorted, a bucket of handles per filter value and grade counts per rack,
all maintained as records change, so that a page of a 100,000-node region costs the page
(and the smallest matching bucket), not a sort of the region.

:class:`WatchedRecords` is the store's ``records`` dict that tells its :class:`NodeIndex`
of every write; :func:`index_of` installs it on a store (once, and again after the store
replaced its dict, e.g. on a leader's reload).  Pure: no I/O.
"""

from __future__ import annotations

import base64
import binascii
from bisect import bisect_right
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from metalguard.proto.nodes import GRADES, NodeRecord

Field = Literal["grade", "state", "region", "cluster", "rack"]
FIELDS: Final[tuple[Field, ...]] = ("grade", "state", "region", "cluster", "rack")
STATES: Final = ("in_service", "cordoned", "maintenance", "held")
"""A node's operator states: ``in_service`` (neither cordoned nor held), or any of the
others (a node in maintenance is also cordoned)."""
MAX_LIMIT: Final = 5000
"""The largest page of ``GET /v1/nodes`` (without ``limit``: every match)."""
MEMO_SIZE: Final = 64
GroupKey = tuple[str, str, str]
"""(region, cluster, rack)."""


def states_of(r: NodeRecord) -> tuple[str, ...]:
    """The :data:`STATES` a record is in."""
    if not (r.cordoned or r.held):
        return ("in_service",)
    return tuple(
        s for s, on in (("cordoned", r.cordoned), ("maintenance", r.maintenance), ("held", r.held))
        if on
    )  # fmt: skip


def keys_of(r: NodeRecord) -> tuple[tuple[str, ...], ...]:
    """A record's values per field of :data:`FIELDS` (state: one or more)."""
    return (
        (r.grade,),
        states_of(r),
        (r.node.region,),
        (r.node.cluster,),
        (r.rack,),
    )


@dataclass(frozen=True)
class NodeQuery:
    """A listing's filters (each a set of accepted values; empty: any) and its page."""

    where: Mapping[Field, frozenset[str]] = field(default_factory=dict)
    limit: int | None = None
    """At most this many nodes; None: every match."""
    after: str = ""
    """Start after this handle (the decoded cursor)."""


@dataclass(frozen=True)
class Page:
    """A page of handles in handle order, the number of matches and the next cursor."""

    handles: list[str]
    total: int
    next_cursor: str | None


@dataclass
class GroupCounts:
    """Grade counts of one rack (or cluster) and how many of its nodes are cordoned."""

    grades: dict[str, int] = field(default_factory=dict)
    """Nodes per grade (a grade no node has may be 0 or absent)."""
    nodes: int = 0
    cordoned: int = 0

    def add(self, grade: str, cordoned: bool, n: int = 1) -> None:
        self.grades[grade] = self.grades.get(grade, 0) + n
        self.nodes += n
        self.cordoned += n if cordoned else 0


def encode_cursor(handle: str) -> str:
    """The opaque cursor that resumes after ``handle``."""
    return base64.urlsafe_b64encode(handle.encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> str:
    """The handle a cursor resumes after; ValueError when it is not one of ours."""
    try:
        raw = base64.b64decode(cursor + "=" * (-len(cursor) % 4), altchars=b"-_", validate=True)
        handle = raw.decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise ValueError(f"cursor {cursor!r} is not a cursor of this API") from None
    printable = handle.isprintable() and not any(c.isspace() for c in handle)
    if handle.count(".") < 2 or not printable or encode_cursor(handle) != cursor:
        raise ValueError(f"cursor {cursor!r} is not a cursor of this API")
    return handle


class NodeIndex:
    """Sorted handles, buckets per field value and per-rack grade counts of a record map,
    kept by :meth:`put` and :meth:`drop`; new handles are merged into the order lazily."""

    def __init__(self, records: Iterable[tuple[str, NodeRecord]] = ()) -> None:
        self._sorted: list[str] = []
        self._added: set[str] = set()
        self._gone: set[str] = set()
        self._keys: dict[str, tuple[tuple[str, ...], ...]] = {}
        self._interned: dict[tuple[tuple[str, ...], ...], tuple[tuple[str, ...], ...]] = {}
        """The keys tuples in use, shared (a few per rack, not one per node)."""
        self._buckets: dict[Field, dict[str, set[str]]] = {f: {} for f in FIELDS}
        self._groups: dict[GroupKey, GroupCounts] = {}
        self.version = 0
        """Counts the changes that moved a bucket or a count (what :meth:`memo` keys on)."""
        self._memo: dict[Hashable, tuple[int, bytes]] = {}
        for handle, record in records:
            self.put(handle, record)

    def __len__(self) -> int:
        return len(self._keys)

    def put(self, handle: str, record: NodeRecord) -> None:
        """A record written (new or changed): only the fields that changed move."""
        keys = keys_of(record)
        keys = self._interned.setdefault(keys, keys)  # one tuple per (grade, state, rack)
        old = self._keys.get(handle)
        if old == keys:
            return  # the common write: liveness fields only
        self.version += 1
        self._keys[handle] = keys
        if old is None:
            if handle in self._gone:
                self._gone.discard(handle)  # still in the sorted list
            else:
                self._added.add(handle)
            for f, values in zip(FIELDS, keys, strict=True):
                self._bucket(f, (), values, handle)
        else:
            for f, was, now in zip(FIELDS, old, keys, strict=True):
                if was != now:
                    self._bucket(f, was, now, handle)
            self._count(old, -1)
        self._count(keys, 1)

    def drop(self, handle: str) -> None:
        """A record removed."""
        old = self._keys.pop(handle, None)
        if old is None:
            return
        self.version += 1
        for f, values in zip(FIELDS, old, strict=True):
            self._bucket(f, values, (), handle)
        self._count(old, -1)
        if handle in self._added:
            self._added.discard(handle)
        else:
            self._gone.add(handle)

    def _bucket(self, f: Field, was: tuple[str, ...], now: tuple[str, ...], handle: str) -> None:
        buckets = self._buckets[f]
        for v in was:
            gone = buckets[v]
            gone.discard(handle)
            if not gone:
                del buckets[v]
        for v in now:
            into = buckets.get(v)
            if into is None:
                into = buckets[v] = set()
            into.add(handle)

    def _count(self, keys: tuple[tuple[str, ...], ...], n: int) -> None:
        key = (keys[2][0], keys[3][0], keys[4][0])
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = GroupCounts()
        group.add(keys[0][0], "in_service" not in keys[1], n)
        if not group.nodes:
            del self._groups[key]

    def ordered(self) -> list[str]:
        """Every handle, sorted (merging the ones added since the last call)."""
        if self._gone:
            gone = self._gone
            self._sorted = [h for h in self._sorted if h not in gone]
            self._gone = set()
        if self._added:
            self._sorted.extend(self._added)
            self._sorted.sort()  # a sorted run and a short tail: about one pass
            self._added = set()
        return self._sorted

    def page(self, query: NodeQuery) -> Page:
        """The handles of one page of ``query``, the number of matches and the cursor of
        the next page (None on the last)."""
        handles = self.ordered()
        wanted = [self._matching(f, values) for f, values in query.where.items() if values]
        if not wanted:
            return _slice(handles, query, len(handles))
        wanted.sort(key=len)
        smallest, rest = wanted[0], wanted[1:]
        matches = {h for h in smallest if all(h in s for s in rest)} if rest else smallest
        if len(matches) * 8 < len(handles):  # few: sort them
            return _slice(sorted(matches), query, len(matches))
        return _scan(handles, matches, query)

    def _matching(self, f: Field, values: frozenset[str]) -> set[str]:
        buckets = self._buckets[f]
        found = [buckets[v] for v in values if v in buckets]
        if len(found) == 1:
            return found[0]
        return set().union(*found)

    def groups(self, by: Literal["cluster", "rack"]) -> Iterator[tuple[GroupKey, GroupCounts]]:
        """Grade counts per rack or per cluster (rack ``""``), in key order."""
        if by == "rack":
            yield from sorted(self._groups.items())
            return
        clusters: dict[GroupKey, GroupCounts] = {}
        for (region, cluster, _), counts in self._groups.items():
            into = clusters.setdefault((region, cluster, ""), GroupCounts())
            for grade, n in counts.grades.items():
                into.grades[grade] = into.grades.get(grade, 0) + n
            into.nodes += counts.nodes
            into.cordoned += counts.cordoned
        yield from sorted(clusters.items())

    def memo(self, key: Hashable, build: Callable[[], bytes]) -> bytes:
        """``build()``, kept until the index changes (a summary read by every dashboard
        between two grade changes is built once); at most :data:`MEMO_SIZE` kept."""
        hit = self._memo.get(key)
        if hit is not None and hit[0] == self.version:
            return hit[1]
        body = build()
        if len(self._memo) >= MEMO_SIZE or any(v != self.version for v, _ in self._memo.values()):
            self._memo = {k: m for k, m in self._memo.items() if m[0] == self.version}
            if len(self._memo) >= MEMO_SIZE:
                self._memo.clear()
        self._memo[key] = (self.version, body)
        return body

    def grade_counts(self) -> dict[str, int]:
        """How many nodes have each grade (every grade named)."""
        grades = self._buckets["grade"]
        return {g: len(grades.get(g, ())) for g in GRADES}


def _slice(ordered: list[str], query: NodeQuery, total: int) -> Page:
    start = bisect_right(ordered, query.after) if query.after else 0
    end = len(ordered) if query.limit is None else start + query.limit
    chunk = ordered[start:end]
    more = end < len(ordered) and bool(chunk)
    return Page(chunk, total, encode_cursor(chunk[-1]) if more else None)


def _scan(handles: list[str], matches: set[str], query: NodeQuery) -> Page:
    """Walk the sorted handles from the cursor, keeping the matches (many of them)."""
    start = bisect_right(handles, query.after) if query.after else 0
    want = len(matches) if query.limit is None else query.limit
    chunk: list[str] = []
    more = False
    for i in range(start, len(handles)):
        h = handles[i]
        if h in matches:
            if len(chunk) == want:
                more = True
                break
            chunk.append(h)
    return Page(chunk, len(matches), encode_cursor(chunk[-1]) if more else None)


class WatchedRecords(dict[str, NodeRecord]):
    """A store's ``records`` that keeps a :class:`NodeIndex` as it is written."""

    def __init__(self, records: Mapping[str, NodeRecord]) -> None:
        super().__init__(records)
        self.index = NodeIndex(records.items())

    def __setitem__(self, key: str, value: NodeRecord) -> None:
        super().__setitem__(key, value)
        self.index.put(key, value)

    def __delitem__(self, key: str) -> None:
        super().__delitem__(key)
        self.index.drop(key)

    def pop(self, key: str, *default: Any) -> Any:
        if key in self:
            self.index.drop(key)
        return super().pop(key, *default)

    def popitem(self) -> tuple[str, NodeRecord]:
        key, value = super().popitem()
        self.index.drop(key)
        return key, value

    def clear(self) -> None:
        super().clear()
        self.index = NodeIndex()

    def setdefault(self, key: str, default: NodeRecord) -> NodeRecord:
        if key not in self:
            self[key] = default
        return self[key]

    def update(self, *args: Any, **kwargs: NodeRecord) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def __ior__(self, other: Any) -> WatchedRecords:  # type: ignore[override,misc]
        self.update(other)
        return self


def index_of(store: Any) -> NodeIndex:
    """The index of ``store.records``: installed as a :class:`WatchedRecords` when the
    store holds a plain dict it lets us replace (a NodeStore), kept while the store keeps
    it; over any other mapping, an index built now (small fakes in tests)."""
    records = store.records
    if isinstance(records, WatchedRecords):
        return records.index
    if type(records) is dict:
        watched = WatchedRecords(records)
        try:
            store.records = watched
        except AttributeError:
            return watched.index
        return watched.index
    return NodeIndex(records.items())
