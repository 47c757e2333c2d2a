"""The controller's receiving time: when its own intake was live (docs/lifecycle.md).

A node is silent only over time in which the controller itself was connected and
receiving. Ingest reports *evidence* that its intake is live: a fetch that brought
messages, or the broker answering a consumer probe, each with the consumer's count of
messages still pending (``num_pending``). A gap between two pieces of evidence longer
than ``gap_s`` is a *stall* (the broker frozen or electing a leader, the connection
lost, the controller's own event loop starved): the whole gap is not receiving time.
After a stall the backlog is taken in first: the stall lasts until the consumer reports
nothing pending (or ``backlog_wait_s`` after the evidence resumed, whichever comes first),
so the agents' spooled batches are in before anyone's silence is judged again.

Pure: no clock, no I/O; times are arguments. :func:`silence_s` is what
:func:`controller.lifecycle.check_silence` measures.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Final

Span = tuple[float, float]
"""``(start, end)``: a stretch of time, ``start <= end``."""

STALL_GAP_S: Final = 2.5
"""Evidence comes at least every second (the probe) and far more often in a live fleet:
a longer gap than this is a stall."""
BACKLOG_WAIT_S: Final = 30.0
"""Longest wait for a backlog after a stall before silence is judged again anyway (a
controller that never catches up must still see dead nodes)."""
SPANS_KEPT: Final = 256
"""Closed stalls remembered (oldest dropped first)."""
SPAN_KEPT_S: Final = 3600.0
"""Closed stalls older than this are forgotten: they matter only to nodes long silent."""


@dataclass(frozen=True, slots=True)
class Intake:
    """What the controller knows of its own intake; the empty one knows nothing and
    stalls nothing (a controller without ingest judges all time as receiving time)."""

    heard_ts: float | None = None
    """The newest evidence that the intake was live."""
    stalls: tuple[Span, ...] = ()
    """Closed stalls, oldest first."""
    stalled_since: float | None = None
    """Start of the stall whose backlog is still being taken in (None: none)."""
    resumed_ts: float | None = None
    """When evidence came back after that stall."""
    pending: int | None = None
    """The consumer's pending count in the newest evidence that had one."""

    @property
    def catching_up(self) -> bool:
        """A stall ended and its backlog is not yet taken in."""
        return self.stalled_since is not None


def heard(
    intake: Intake,
    ts: float,
    pending: int | None,
    *,
    gap_s: float = STALL_GAP_S,
    backlog_wait_s: float = BACKLOG_WAIT_S,
) -> Intake:
    """``intake`` after evidence at ``ts`` with ``pending`` messages left in the consumer
    (None: not known). A gap before it opens a stall; the stall closes once nothing is
    pending (or ``backlog_wait_s`` after the evidence came back)."""
    last = intake.heard_ts
    pending_now = intake.pending if pending is None else pending
    if last is None:
        return replace(intake, heard_ts=ts, pending=pending_now)
    now = max(ts, last)
    stalled_since, resumed = intake.stalled_since, intake.resumed_ts
    if stalled_since is None and ts - last > gap_s:
        stalled_since, resumed = last, ts  # the whole gap was not receiving time
    stalls = intake.stalls
    if stalled_since is not None:
        drained = pending == 0
        waited = resumed is not None and now - resumed >= backlog_wait_s
        if drained or waited:
            stalls = _kept((*stalls, (stalled_since, now)), now)
            stalled_since = resumed = None
    return Intake(now, stalls, stalled_since, resumed, pending_now)


def stalled(intake: Intake, now: float, *, gap_s: float = STALL_GAP_S) -> tuple[Span, ...]:
    """Every stall up to ``now``: the closed ones, the one whose backlog is being taken
    in, and the gap since the newest evidence if it is already longer than ``gap_s``."""
    last = intake.heard_ts
    if last is None:
        return intake.stalls
    if intake.stalled_since is not None:
        return (*intake.stalls, (intake.stalled_since, max(now, last)))
    if now - last > gap_s:
        return (*intake.stalls, (last, now))
    return intake.stalls


def silence_s(since: float, now: float, stalls: Sequence[Span]) -> float:
    """Receiving time between ``since`` and ``now``: the stretch minus its stalls
    (overlapping stalls counted once)."""
    if now <= since:
        return 0.0
    off = 0.0
    covered = since  # stalls are merged as they are walked in start order
    for start, end in sorted(stalls):
        start, end = max(start, covered), min(end, now)
        if end > start:
            off += end - start
            covered = end
    return now - since - off


def _kept(stalls: tuple[Span, ...], now: float) -> tuple[Span, ...]:
    """The newest SPANS_KEPT stalls that ended within SPAN_KEPT_S of ``now``."""
    recent = tuple(s for s in stalls if now - s[1] <= SPAN_KEPT_S)
    return recent[-SPANS_KEPT:]
