"""Per-rank step timing, batched into windows on the node (docs/jobs.md "Stragglers").

A training script times each step's compute and its wait in collectives (the client's
``compute()`` / ``communicate()`` blocks or explicit durations); :class:`StepTimer` keeps
them until ``window_s`` has passed, then yields one :class:`TimingWindow`: the medians
over the window's unmarked steps. One message per window, whatever the step rate (a
bounded sample of at most ``MAX_SAMPLES`` steps per window). Standard library only: the
client library imports it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

DEFAULT_WINDOW_S: Final = 30.0
"""The window a rank's timings are batched over (``MG_TIMING_WINDOW_S``)."""
MAX_SAMPLES: Final = 4096
"""Steps kept per window; past it every other one is dropped (the median survives)."""
MARK_KINDS: Final = frozenset({"checkpoint", "eval", "other"})
"""What a step can be marked as: left out of the window's medians."""


@dataclass(frozen=True, slots=True)
class TimingWindow:
    """One rank's timings over one window (what the client sends: ``op`` ``timing``)."""

    steps: int
    """Unmarked steps timed in the window."""
    compute_s: float
    """Median compute time per step."""
    comm_s: float
    """Median time waiting in collectives per step."""
    marked: int
    """Steps marked (checkpoint, evaluation) and left out."""
    first_step: int
    last_step: int
    elapsed_s: float
    role: tuple[int, ...] = ()

    def message(self) -> dict[str, object]:
        """The wire form (newline-delimited JSON, docs/workloads.md)."""
        return {
            "op": "timing",
            "steps": self.steps,
            "compute_s": round(self.compute_s, 6),
            "comm_s": round(self.comm_s, 6),
            "marked": self.marked,
            "first_step": self.first_step,
            "last_step": self.last_step,
            "elapsed_s": round(self.elapsed_s, 3),
            "role": list(self.role),
        }


@dataclass
class StepTimer:
    """Accumulates one rank's step timings; :meth:`end_step` returns a window when due."""

    window_s: float = DEFAULT_WINDOW_S
    clock: Callable[[], float] = time.monotonic
    role: tuple[int, ...] = ()
    _compute: list[float] = field(default_factory=list)
    _comm: list[float] = field(default_factory=list)
    _step_compute: float = 0.0
    _step_comm: float = 0.0
    _step_marked: bool = False
    _marked: int = 0
    _stride: int = 1
    _seen: int = 0
    _first_step: int | None = None
    _opened: float | None = None

    def add(self, compute_s: float = 0.0, comm_s: float = 0.0) -> None:
        """Add durations to the step in progress (several blocks in one step add up)."""
        if compute_s > 0:
            self._step_compute += compute_s
        if comm_s > 0:
            self._step_comm += comm_s

    def mark(self) -> None:
        """The step in progress is a checkpoint or evaluation step: left out."""
        self._step_marked = True

    def end_step(self, step: int) -> TimingWindow | None:
        """Close the step in progress (``step`` steps are done); the window, when its
        time is up."""
        now = self.clock()
        if self._opened is None:
            self._opened = now
        if self._first_step is None:
            self._first_step = step
        timed = self._step_compute > 0 or self._step_comm > 0
        if self._step_marked:
            self._marked += 1
        elif timed:
            self._seen += 1
            if self._seen % self._stride == 0:
                self._compute.append(self._step_compute)
                self._comm.append(self._step_comm)
                if len(self._compute) >= MAX_SAMPLES:
                    self._compute, self._comm = self._compute[::2], self._comm[::2]
                    self._stride *= 2
        self._step_compute = self._step_comm = 0.0
        self._step_marked = False
        if now - self._opened < self.window_s:
            return None
        return self._close(step, now)

    def _close(self, step: int, now: float) -> TimingWindow | None:
        opened, first = self._opened or now, self._first_step or step
        compute, comm, marked, seen = self._compute, self._comm, self._marked, self._seen
        self._compute, self._comm = [], []
        self._marked = self._seen = 0
        self._stride = 1
        self._opened, self._first_step = now, None
        if not compute and not marked:
            return None  # nothing timed: the script does not report timings
        return TimingWindow(
            steps=seen,
            compute_s=statistics.median(compute) if compute else 0.0,
            comm_s=statistics.median(comm) if comm else 0.0,
            marked=marked,
            first_step=first,
            last_step=step,
            elapsed_s=now - opened,
            role=self.role,
        )
