"""Which files the dataset cache keeps: ``lru``, ``pin`` (training-aware) and ``auto`` (pure).

A policy sees keys (a file's relative path) and sizes, never I/O.  The store (the only
caller, under its lock) tells it about every file access (:meth:`Policy.access`), asks it
whether to cache a missed file and what to evict for it (:meth:`Policy.make_room`), and
tells it when a file became resident (:meth:`Policy.insert`) or left (:meth:`Policy.remove`:
dropped because its source changed, or a failed fill).  A policy tracks only resident
files: a fill in flight is the store's reservation, not the policy's.  The store keeps
``used + reserved <= max_bytes``; a policy's victims free at least what it is asked for.

``lru``
    The baseline (what Alluxio and JuiceFS do): :class:`cachetools.LRUCache` keyed by path,
    weighted by size.  On epoch-shuffled training data it hits ~c^2/2 of reads for a cache
    holding a fraction c of the dataset: each epoch's order is a fresh shuffle, so by the
    time a file comes round again the cache has churned past it.

``pin``
    Training-aware, after CoorDL's "MinIO" (Mohan et al., VLDB 2021): admit files while
    there is room, then *keep* them — a fresh shuffle re-reads every file once per epoch,
    so any fixed subset of size c hits c of the reads, and evicting one file for another
    only costs fetches.  Two refinements:

    * a protected segment: a file re-read within a short reuse distance (an index, a hot
      file: reuse distance under a quarter of the distinct files seen) is admitted even
      when the cache is full, into a segment of at most ``protected_share`` of the
      capacity, LRU within itself; it displaces stable files, never the other way, so no
      scan flushes it;
    * aging: a stable file not read for ``cold_epochs`` times the distinct files seen (in
      accesses; ~3 epochs) is cold, and cold files are evicted first for new ones, so a
      cache left by an earlier job's subset does not freeze forever.

    Prefetching for sequential readers is the store's (it needs the listing order); a
    policy only says whether it wants it (:attr:`Policy.prefetch`).

``auto``
    Reads the pattern (:mod:`.pattern`) of the recent accesses and runs ``pin`` for
    shuffled epochs, ``pin`` with prefetch for sequential scans (repeated scans: LRU would
    hit nothing once the dataset outgrows the cache), ``lru`` for a skewed hot set
    (recency tracks a moving hot set; pin would hold on to the first files it saw).  A
    switch hands the resident files over in their recency order.  Until a pattern is
    named, ``pin`` (it is never worse than LRU by more than the protected segment's churn).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Iterator
from typing import Protocol

import cachetools

from metalguard.agent.cache.pattern import (
    MAX_TRACKED,
    SEQUENTIAL,
    SHUFFLED,
    SKEWED,
    Pattern,
    PatternDetector,
)

POLICIES = ("auto", "lru", "pin")
HOT_REUSES = 2
"""Short-distance re-reads in a row that make a file hot (``pin``'s protected segment)."""
CLASSIFY_EVERY = 64
"""``auto`` re-reads the pattern every this many accesses."""


class Policy(Protocol):
    """What the store asks of a policy (all calls under the store's lock)."""

    @property
    def name(self) -> str:
        """The policy in force (``auto`` answers the one it runs)."""
        ...

    @property
    def reason(self) -> str:
        """Why this policy: "configured" or the pattern's evidence."""
        ...

    @property
    def prefetch(self) -> bool:
        """Whether the store should fetch ahead of sequential readers."""
        ...

    def access(self, key: str, size: int, hit: bool) -> None:
        """One access to file ``key`` (a hit on a resident file or a miss)."""

    def make_room(self, key: str, size: int, need: int) -> list[str] | None:
        """Whether to cache missed file ``key``: None (no; nothing changed), or the
        resident keys to evict (already forgotten by the policy), freeing >= ``need``
        bytes (``need <= 0``: there is room; the answer is then [] or None)."""

    def insert(self, key: str, size: int) -> None:
        """``key`` is now resident."""

    def remove(self, key: str) -> None:
        """``key`` left the cache for a reason of the store's (a no-op when unknown)."""

    def resident(self) -> Iterator[tuple[str, int]]:
        """Resident keys and sizes, least valuable first."""


class LruPolicy:
    """Least recently used, by bytes: cachetools.LRUCache does the bookkeeping."""

    name = "lru"
    prefetch = False

    def __init__(self, capacity: int, reason: str = "configured") -> None:
        self.reason = reason
        self._lru: cachetools.LRUCache[str, int] = cachetools.LRUCache(
            maxsize=max(capacity, 1), getsizeof=_size_of
        )

    def access(self, key: str, size: int, hit: bool) -> None:
        if hit:
            self._lru.get(key)  # marks it most recently used

    def make_room(self, key: str, size: int, need: int) -> list[str] | None:
        if size > self._lru.maxsize:
            return None
        if need <= 0:
            return []
        if self._lru.currsize < need:
            return None
        victims: list[str] = []
        freed = 0
        while freed < need:
            victim, victim_size = self._lru.popitem()
            victims.append(victim)
            freed += victim_size
        return victims

    def insert(self, key: str, size: int) -> None:
        self._lru.pop(key, None)
        if self._lru.currsize + size <= self._lru.maxsize:
            self._lru[key] = size

    def remove(self, key: str) -> None:
        self._lru.pop(key, None)

    def resident(self) -> Iterator[tuple[str, int]]:
        # popitem order is the only public view of recency: copy and drain the copy
        ordered = copy.copy(self._lru)
        while ordered:
            yield ordered.popitem()


def _size_of(size: int) -> int:
    return size


class PinPolicy:
    """Training-aware: keep a stable subset, protect hot files, age out cold ones."""

    name = "pin"

    def __init__(
        self,
        capacity: int,
        reason: str = "configured",
        protected_share: float = 0.5,
        cold_epochs: float = 3.0,
        prefetch: bool = True,
    ) -> None:
        self.capacity = capacity
        self.reason = reason
        self.prefetch = prefetch
        self.protected_budget = int(capacity * protected_share)
        self.cold_epochs = cold_epochs
        self._stable: OrderedDict[str, int] = OrderedDict()
        """Resident, admitted while there was room: least recently read first."""
        self._protected: OrderedDict[str, int] = OrderedDict()
        """Resident, hot: least recently read first."""
        self._protected_bytes = 0
        self._seq = 0
        self._last: OrderedDict[str, int] = OrderedDict()
        """Access number of every file's last read (resident or not), oldest first."""
        self._hot_pending: set[str] = set()
        self._short: dict[str, int] = {}
        """Short-distance re-reads in a row, per file (see _is_hot)."""

    # -- bookkeeping ----------------------------------------------------------------------

    def _is_hot(self, key: str, previous: int | None) -> bool:
        """Whether this access makes ``key`` hot: its ``HOT_REUSES``-th re-read in a row
        at a short reuse distance (under a quarter of the distinct files seen).  One
        short reuse happens to ~3 % of the files of a shuffled epoch at each epoch
        boundary; two in a row to ~0.1 %; an index re-read all epoch long: at once."""
        short = previous is not None and (self._seq - previous) * 4 < max(len(self._last), 16)
        if not short:
            self._short.pop(key, None)
            return False
        count = self._short.get(key, 0) + 1
        self._short[key] = count
        return count >= HOT_REUSES

    def _cold_age(self) -> int:
        return int(self.cold_epochs * max(len(self._last), 16))

    def access(self, key: str, size: int, hit: bool) -> None:
        self._seq += 1
        previous = self._last.pop(key, None)
        self._last[key] = self._seq
        if len(self._last) > MAX_TRACKED:
            forgotten, _ = self._last.popitem(last=False)
            self._short.pop(forgotten, None)
        hot = self._is_hot(key, previous)
        if key in self._protected:
            self._protected.move_to_end(key)
        elif key in self._stable:
            self._stable.move_to_end(key)
            if hot:
                self._promote(key)
        elif hot:
            self._hot_pending.add(key)
        else:
            self._hot_pending.discard(key)

    def _promote(self, key: str) -> None:
        size = self._stable.pop(key)
        self._protected[key] = size
        self._protected_bytes += size
        while self._protected_bytes > self.protected_budget and len(self._protected) > 1:
            demoted, demoted_size = self._protected.popitem(last=False)
            self._protected_bytes -= demoted_size
            self._stable[demoted] = demoted_size

    def make_room(self, key: str, size: int, need: int) -> list[str] | None:
        if size > self.capacity:
            return None
        if need <= 0:
            return []
        hot = key in self._hot_pending
        if hot and size > self.protected_budget:
            hot = False
        victims: list[str] = []
        freed = 0
        # 1. cold stable files (not read for ~cold_epochs epochs), oldest first
        horizon = self._seq - self._cold_age()
        for victim, victim_size in self._stable.items():
            if freed >= need:
                break
            if self._last.get(victim, 0) > horizon:
                break
            victims.append(victim)
            freed += victim_size
        if freed < need and hot:
            # 2. a hot file displaces protected files beyond the budget, then stable ones
            over = self._protected_bytes + size - self.protected_budget
            for victim, victim_size in self._protected.items():
                if freed >= need or over <= 0:
                    break
                victims.append(victim)
                freed += victim_size
                over -= victim_size
            for victim, victim_size in self._stable.items():
                if freed >= need:
                    break
                if victim not in victims:
                    victims.append(victim)
                    freed += victim_size
        if freed < need:
            return None
        for victim in victims:
            self.remove(victim)
        return victims

    def insert(self, key: str, size: int) -> None:
        self.remove(key)
        if key in self._hot_pending and size <= self.protected_budget:
            self._hot_pending.discard(key)
            self._stable[key] = size
            self._promote(key)
        else:
            self._stable[key] = size

    def remove(self, key: str) -> None:
        if key in self._stable:
            del self._stable[key]
        elif key in self._protected:
            self._protected_bytes -= self._protected.pop(key)

    def resident(self) -> Iterator[tuple[str, int]]:
        yield from list(self._stable.items())
        yield from list(self._protected.items())

    @property
    def protected(self) -> frozenset[str]:
        """The keys in the protected (hot) segment."""
        return frozenset(self._protected)


class AutoPolicy:
    """Runs ``pin`` or ``lru`` as the detected access pattern says; see the module doc."""

    def __init__(self, capacity: int, detector: PatternDetector | None = None) -> None:
        self.capacity = capacity
        self.detector = detector if detector is not None else PatternDetector()
        self.owns_detector = detector is None
        """Whether :meth:`access` feeds the detector and reclassifies (else the detector's
        owner, the store, does both: it knows each file's place in its listing)."""
        self.pattern = Pattern("", "no file reads seen yet", 0, 0.0, 0.0)
        self._inner: PinPolicy | LruPolicy = PinPolicy(capacity, self._reason())
        self._count = 0

    def _reason(self) -> str:
        p = self.pattern
        if not p.kind:
            return f"auto: no pattern yet ({p.reason}): pin until one is seen"
        choice = {SEQUENTIAL: "pin + prefetch", SHUFFLED: "pin", SKEWED: "lru"}[p.kind]
        return f"auto: {p.kind} -> {choice}: {p.reason}"

    @property
    def inner(self) -> PinPolicy | LruPolicy:
        """The policy running now."""
        return self._inner

    @property
    def name(self) -> str:
        return self._inner.name

    @property
    def reason(self) -> str:
        return self._inner.reason

    @property
    def prefetch(self) -> bool:
        return self._inner.prefetch

    def access(self, key: str, size: int, hit: bool) -> None:
        self._inner.access(key, size, hit)
        if self.owns_detector:
            self.detector.observe(key)
            self._count += 1
            if self._count % CLASSIFY_EVERY == 0:
                self.reclassify(self.detector.classify())

    def reclassify(self, pattern: Pattern) -> None:
        """Take ``pattern`` as the current one; switch policies if it calls for another."""
        self.pattern = pattern
        want_lru = self.pattern.kind == SKEWED
        want_prefetch = self.pattern.kind == SEQUENTIAL
        reason = self._reason()
        if want_lru and not isinstance(self._inner, LruPolicy):
            new: PinPolicy | LruPolicy = LruPolicy(self.capacity, reason)
        elif not want_lru and not isinstance(self._inner, PinPolicy):
            new = PinPolicy(self.capacity, reason, prefetch=want_prefetch)
        else:
            self._inner.reason = reason
            if isinstance(self._inner, PinPolicy):
                self._inner.prefetch = want_prefetch
            return
        for key, size in self._inner.resident():
            new.insert(key, size)
        self._inner = new

    def make_room(self, key: str, size: int, need: int) -> list[str] | None:
        return self._inner.make_room(key, size, need)

    def insert(self, key: str, size: int) -> None:
        self._inner.insert(key, size)

    def remove(self, key: str) -> None:
        self._inner.remove(key)

    def resident(self) -> Iterator[tuple[str, int]]:
        return self._inner.resident()


def make_policy(
    name: str, capacity: int, detector: PatternDetector | None = None
) -> LruPolicy | PinPolicy | AutoPolicy:
    """The policy called ``name`` (one of POLICIES) for a cache of ``capacity`` bytes;
    ``detector``: the store's pattern detector, which ``auto`` then reads (not feeds)."""
    if name == "lru":
        return LruPolicy(capacity)
    if name == "pin":
        return PinPolicy(capacity)
    if name == "auto":
        return AutoPolicy(capacity, detector)
    raise ValueError(f"unknown cache policy {name!r} (one of {', '.join(POLICIES)})")
