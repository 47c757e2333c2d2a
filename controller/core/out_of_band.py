"""What a node's BMC said, read by a bmc-proxy (``TelemetryBatch.out_of_band``).

Out-of-band batches are not signs of life of the node's OS: the controller keeps the
newest one per node and uses it twice (docs/lifecycle.md): its BMC readings join the
node's next in-band batch for scoring (fans, PSUs, chassis health the host cannot see),
and a silent node's UNREACHABLE decision says what the BMC says of its power and health.
Pure functions; the region controller holds the state.
"""

from __future__ import annotations

from dataclasses import dataclass

from msgspec.structs import replace

from metalguard.proto.telemetry import BmcReading, TelemetryBatch

FRESH_INTERVALS = 3
"""An out-of-band reading older than this many of its intervals is not used."""
DEFAULT_INTERVAL_S = 30.0
"""Assumed when the proxy's batch does not say its interval."""


@dataclass(frozen=True, slots=True)
class BmcWord:
    """The newest out-of-band batch of one node and when it was taken in."""

    received_ts: float
    batch: TelemetryBatch

    def fresh(self, now: float) -> bool:
        """Whether it is recent enough to speak for the node now."""
        interval = self.batch.interval_s or DEFAULT_INTERVAL_S
        return now - self.received_ts <= FRESH_INTERVALS * interval

    @property
    def power_on(self) -> bool | None:
        """True/False when a reachable BMC reported its power state; None otherwise."""
        for reading in self.batch.bmc:
            if reading.reachable and reading.power_state in ("on", "off"):
                return reading.power_state == "on"
        return None

    @property
    def health(self) -> str:
        """The worst health a reachable BMC reported (``critical`` > ``warning`` > ``ok``),
        ``unreachable`` when none answered, ``""`` when nothing was said."""
        return worst_health(self.batch.bmc)


_HEALTH_RANK = {"ok": 1, "warning": 2, "critical": 3}


def worst_health(readings: tuple[BmcReading, ...]) -> str:
    """The worst ``health`` of the reachable readings; ``unreachable`` if none answered."""
    if readings and not any(r.reachable for r in readings):
        return "unreachable"
    said = [r.health.lower() for r in readings if r.reachable and r.health]
    known = [h for h in said if h in _HEALTH_RANK]
    if known:
        return max(known, key=_HEALTH_RANK.__getitem__)
    return said[0] if said else ""


def with_bmc(batch: TelemetryBatch, word: BmcWord | None, now: float) -> TelemetryBatch:
    """``batch`` with the node's fresh out-of-band BMC readings, unless it has its own."""
    if word is None or batch.bmc or not word.batch.bmc or not word.fresh(now):
        return batch
    return replace(batch, bmc=word.batch.bmc)
