"""Which access pattern a dataset's readers follow, from its recent file accesses (pure).

The store feeds :class:`PatternDetector` one :meth:`~PatternDetector.observe` per file
access (a read at offset 0, or a miss), with the file's place in its directory's sorted
listing; :meth:`~PatternDetector.classify` names the pattern and the evidence:

* ``sequential``: most accesses go to a file just after (in name order, same directory)
  one of the few files accessed before it (one reader walking shards, or several
  DataLoader workers interleaving one walk).  Evidence: the share of such successors,
  which must reach ``SEQUENTIAL_SHARE`` and lie halfway from what chance gives (a random
  order in a directory of n files: ~``RECENT * SUCCESSOR_SPAN / n``) to 1 — so a shuffled
  small directory is not taken for a walk.
* ``skewed``: the window's reads concentrate on few files (a hot set, an index): its
  ``reuse_share`` = 1 - (distinct files in the window) / min(window, population), where
  the population is the dataset's file count (as listed; at least the distinct files
  seen).  A pass over the data in any order reads ``min(window, population)`` distinct
  files — a share of ~0 — whatever the dataset's size; a hot set drawing 90 % of the
  reads from 10 % of the files scores ~0.5.  Above ``SKEWED_REUSE`` it is skewed.
* ``shuffled``: neither — each file once per pass, in random order (fresh-shuffle epochs,
  or the first epoch of one).
* ``""``: fewer than ``MIN_SAMPLES`` accesses seen yet.

Only the last ``WINDOW`` accesses vote, so a change of pattern (a new job) is seen within a
window.  No I/O, no clock: everything is counted in accesses.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

SEQUENTIAL = "sequential"
SHUFFLED = "shuffled"
SKEWED = "skewed"

WINDOW = 512
"""Accesses that vote on the pattern."""
MIN_SAMPLES = 64
"""Accesses needed before any pattern is named."""
SEQUENTIAL_SHARE = 0.5
"""Share of successor accesses that makes a pattern sequential."""
SKEWED_REUSE = 0.25
"""``reuse_share`` that makes a pattern skewed."""
RECENT = 8
"""How many preceding accesses a successor may follow (interleaved workers)."""
SUCCESSOR_SPAN = 2
"""A file up to this many places after a recent one counts as its successor."""
MAX_TRACKED = 1 << 22
"""Distinct files counted (beyond it: the population is taken as at least this)."""


@dataclass(frozen=True, slots=True)
class Pattern:
    """A classification and its evidence."""

    kind: str
    """``sequential``, ``shuffled``, ``skewed`` or "" (not enough accesses yet)."""
    reason: str
    samples: int
    sequential_share: float
    reuse_share: float
    """1 - distinct files in the window / min(window, population): 0 for a pass over the
    data, towards 1 for a few hot files."""


class PatternDetector:
    """Classifies a stream of file accesses; not thread-safe (the store's lock guards it)."""

    def __init__(self, window: int = WINDOW, min_samples: int = MIN_SAMPLES) -> None:
        self.window = window
        self.min_samples = min_samples
        self.population = 0
        """The dataset's file count when known (the store sets it from its listings)."""
        self._seen: set[str] = set()
        self._recent: deque[tuple[str, int]] = deque(maxlen=RECENT)
        self._votes: deque[tuple[str, bool, float]] = deque()
        self._counts: dict[str, int] = {}
        self._successors = 0
        self._chance = 0.0

    @property
    def distinct(self) -> int:
        """Distinct files seen (up to MAX_TRACKED)."""
        return len(self._seen)

    def observe(self, key: str, directory: str = "", index: int = -1, files: int = 0) -> None:
        """One access to file ``key``: ``index`` is its place in ``directory``'s sorted
        listing of ``files`` files (-1 when unknown: it then never counts as a
        successor; ``files`` 0 when unknown: chance is then taken as nil)."""
        successor = index >= 0 and any(
            d == directory and 0 < index - i <= SUCCESSOR_SPAN for d, i in self._recent
        )
        chance = min(1.0, RECENT * SUCCESSOR_SPAN / files) if index >= 0 and files else 0.0
        if len(self._votes) >= self.window:
            old_key, old_successor, old_chance = self._votes.popleft()
            self._successors -= old_successor
            self._chance -= old_chance
            left = self._counts[old_key] - 1
            if left:
                self._counts[old_key] = left
            else:
                del self._counts[old_key]
        self._votes.append((key, successor, chance))
        self._successors += successor
        self._chance += chance
        self._counts[key] = self._counts.get(key, 0) + 1
        if index >= 0:
            self._recent.append((directory, index))
        if len(self._seen) < MAX_TRACKED:
            self._seen.add(key)

    def classify(self) -> Pattern:
        """The pattern of the last ``window`` accesses, with its evidence in words."""
        n = len(self._votes)
        seq_share = self._successors / n if n else 0.0
        population = max(self.population, len(self._seen))
        expected = min(n, population)
        reuse_share = 1.0 - len(self._counts) / expected if expected else 0.0
        if n < self.min_samples:
            return Pattern(
                "", f"{n} file reads seen, {self.min_samples} needed", n, seq_share, reuse_share
            )
        evidence = (
            f"of the last {n} file reads {seq_share:.0%} followed the one before in name "
            f"order; they read {len(self._counts)} distinct files of {population} "
            f"(concentration {reuse_share:.2f})"
        )
        chance = max(self._chance / n, 0.0)
        if seq_share >= max(SEQUENTIAL_SHARE, (1.0 + chance) / 2):
            kind = SEQUENTIAL
        elif reuse_share >= SKEWED_REUSE:
            kind = SKEWED
        else:
            kind = SHUFFLED
        return Pattern(kind, evidence, n, seq_share, reuse_share)
