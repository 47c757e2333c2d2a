"""One leader per region: a lease in the ``<P>_LEASES`` KV bucket (docs/operations.md).

The bucket has a TTL (its ``max_age``, ``lease_ttl_s`` of the streams' settings): a key not
rewritten within it disappears.  Every controller of a region runs a :class:`Lease` on the
key ``leader.<region>``:

- a follower tries ``create`` every ``poll_s`` (it succeeds only once the key is gone,
  expired or released) and otherwise reads who holds it;
- the holder rewrites it with ``update(last=revision)`` every ``renew_s`` (well inside the
  TTL); a compare-and-set failure means another controller took it: step down at once;
- the holder also steps down by itself when no renewal has succeeded for ``ttl - margin``
  (:func:`holding`), before the key can expire under it, so two controllers never act
  at once for longer than one in-flight round;
- a clean stop deletes the key (``delete(last=revision)``) so a follower takes over at
  its next poll instead of after the TTL.

The decisions (:func:`holding`, :func:`expires_in`) are pure; :class:`Leadership` gates a
:class:`~controller.region.RegionController` on them and reloads its state from KV when
this controller becomes the leader.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from nats.errors import Error as NatsError
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from metalguard.controller.stopping import cancel_within

log = logging.getLogger(__name__)

STOP_WAIT_S = 10.0
"""How long :meth:`Leadership.stop` waits for its cancelled lease loop."""

KEY_PREFIX = "leader."


def lease_key(region: str) -> str:
    """The lease's key in the bucket: one per region."""
    return KEY_PREFIX + region


class LeaseValue(msgspec.Struct, frozen=True, kw_only=True):
    """The lease's value (JSON, readable with ``nats kv get``)."""

    v: int = 1
    region: str
    holder: str
    """The holding controller's ``[ha] instance``."""
    term: int = 0
    """The KV revision that created this holder's lease (0 until the first renewal)."""
    acquired_ts: float
    renewed_ts: float


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(LeaseValue)


@dataclass(frozen=True, slots=True)
class LeaseTiming:
    """The lease's clock: the bucket's TTL and how often it is renewed and polled."""

    ttl_s: float = 10.0
    renew_s: float = 3.0
    """How often the holder rewrites the key (well under ``ttl_s``)."""
    poll_s: float = 0.5
    """How often a follower tries to take the key."""
    margin_s: float = 1.0
    """The holder steps down this long before the TTL after its last renewal."""

    def __post_init__(self) -> None:
        if not 0 < self.renew_s < self.ttl_s - self.margin_s:
            raise ValueError(
                f"lease renew_s {self.renew_s} must be below ttl_s - margin_s "
                f"({self.ttl_s} - {self.margin_s})"
            )
        if self.poll_s <= 0 or self.margin_s < 0:
            raise ValueError("lease poll_s must be positive and margin_s not negative")


def holding(renewed_ts: float | None, now: float, timing: LeaseTiming) -> bool:
    """Whether a holder whose last successful write was at ``renewed_ts`` still leads."""
    return renewed_ts is not None and now - renewed_ts < timing.ttl_s - timing.margin_s


def expires_in(renewed_ts: float, now: float, ttl_s: float) -> float:
    """Seconds until a lease last written at ``renewed_ts`` expires (never negative)."""
    return max(0.0, renewed_ts + ttl_s - now)


@dataclass(frozen=True, slots=True)
class LeaderStatus:
    """Who leads a region, as this controller knows it (``GET /v1/leader``)."""

    region: str
    self_: str
    leader: str | None
    term: int | None
    revision: int | None
    expires_in_s: float | None
    leading: bool

    def as_dict(self) -> dict[str, Any]:
        """The JSON body of ``GET /v1/leader`` (and of ``/healthz``'s leader fields)."""
        return {
            "region": self.region,
            "leader": self.leader,
            "self": self.self_,
            "leading": self.leading,
            "term": self.term,
            "revision": self.revision,
            "expires_in_s": None if self.expires_in_s is None else round(self.expires_in_s, 3),
        }


class Lease:
    """This controller's side of a region's lease; :meth:`step` is one tick."""

    def __init__(
        self,
        kv: KeyValue,
        region: str,
        holder: str,
        timing: LeaseTiming,
        *,
        clock: Callable[[], float] = time.time,
        key: str | None = None,
    ) -> None:
        self._kv = kv
        self.region = region
        self.holder = holder
        self.key = key or lease_key(region)
        """The lease's key: ``leader.<region>``, or another scope's (controller/shards)."""
        self.timing = timing
        self._clock = clock
        self._revision: int | None = None
        """The revision of our last write while we hold the lease."""
        self._term = 0
        self._acquired_ts = 0.0
        self._renewed_ts: float | None = None
        self._seen: tuple[LeaseValue, int, float] | None = None
        """The holder's value, its revision and when we read it (followers)."""

    @property
    def leading(self) -> bool:
        """Whether this controller holds the lease now."""
        return self._revision is not None and holding(self._renewed_ts, self._clock(), self.timing)

    async def step(self) -> bool:
        """Renew (holder) or try to acquire (follower); whether we lead afterwards."""
        now = self._clock()
        if self._revision is not None and not holding(self._renewed_ts, now, self.timing):
            log.warning(
                "lease %s: no renewal for %.1fs, stepping down", self.key, self.timing.ttl_s
            )
            self._lose()
        try:
            if self._revision is not None:
                await self._renew(now)
            else:
                await self._acquire(now)
        except (NatsError, TimeoutError) as exc:
            log.warning("lease %s: %s", self.key, exc or type(exc).__name__)
        return self.leading

    async def release(self) -> None:
        """Give the lease up (a clean stop): delete the key if it is still ours."""
        revision, self._revision = self._revision, None
        if revision is None:
            return
        with contextlib.suppress(NatsError, TimeoutError, KeyWrongLastSequenceError):
            await self._kv.delete(self.key, last=revision)
            log.info("lease %s released", self.key)

    def status(self) -> LeaderStatus:
        """Who leads, as last seen (this controller when it holds the lease)."""
        now = self._clock()
        if self.leading and self._renewed_ts is not None:
            return LeaderStatus(
                self.region,
                self.holder,
                self.holder,
                self._term,
                self._revision,
                expires_in(self._renewed_ts, now, self.timing.ttl_s),
                True,
            )
        if self._seen is not None:
            value, revision, read_ts = self._seen
            left = expires_in(read_ts, now, self.timing.ttl_s)
            if left > 0:
                return LeaderStatus(
                    self.region,
                    self.holder,
                    value.holder,
                    value.term or revision,
                    revision,
                    left,
                    False,
                )
        return LeaderStatus(self.region, self.holder, None, None, None, None, False)

    async def _acquire(self, now: float) -> None:
        value = LeaseValue(region=self.region, holder=self.holder, acquired_ts=now, renewed_ts=now)
        try:
            revision = await self._kv.create(self.key, _encoder.encode(value))
        except KeyWrongLastSequenceError:
            await self._read(now)
            return
        self._revision = self._term = revision
        self._acquired_ts = self._renewed_ts = now
        self._seen = None
        log.info("lease %s acquired by %s (term %d)", self.key, self.holder, revision)
        await self._renew(now)  # writes the term into the value

    async def _renew(self, now: float) -> None:
        value = LeaseValue(
            region=self.region,
            holder=self.holder,
            term=self._term,
            acquired_ts=self._acquired_ts,
            renewed_ts=now,
        )
        try:
            self._revision = await self._kv.update(
                self.key, _encoder.encode(value), last=self._revision
            )
        except KeyWrongLastSequenceError:
            log.warning("lease %s taken by another controller, stepping down", self.key)
            self._lose()
            await self._read(now)
            return
        self._renewed_ts = now

    async def _read(self, now: float) -> None:
        try:
            entry = await self._kv.get(self.key)
        except KeyNotFoundError:
            self._seen = None
            return
        if entry.value is None or entry.revision is None:
            self._seen = None
            return
        try:
            self._seen = (_decoder.decode(entry.value), entry.revision, now)
        except msgspec.DecodeError as exc:
            log.error("lease %s holds an undecodable value: %s", self.key, exc)
            self._seen = None

    def _lose(self) -> None:
        self._revision = None
        self._renewed_ts = None


async def lease_ttl(kv: KeyValue, default: float) -> float:
    """The bucket's TTL (its max age), or ``default`` when it has none."""
    status = await kv.status()
    ttl = status.ttl
    return float(ttl) if ttl else default


Reload = Callable[[], Awaitable[None]]


class Leadership:
    """Runs a :class:`Lease` and gates a controller on it.

    :meth:`leading` is the controller's gate: true only while the lease is held *and*
    ``on_elected`` (reload the state from KV, publish the outbox) has completed since it
    was taken.  A controller without ``[ha]`` uses :meth:`always`.
    """

    def __init__(self, lease: Lease | None, on_elected: Reload | None = None) -> None:
        self.lease = lease
        self.on_elected = on_elected
        """Awaited when the lease is taken, before the gate opens (reload from KV)."""
        self._ready = lease is None
        self._task: asyncio.Task[None] | None = None
        self.elections = 0
        """How many times this controller became the leader."""
        self.changed = asyncio.Event()
        """Set at each change of :meth:`leading` (tests and logs wait on it)."""

    @classmethod
    def always(cls) -> Leadership:
        """The gate of a controller that is the region's only one (no lease)."""
        return cls(None)

    def leading(self) -> bool:
        """Whether the controller may act (persist, publish, send commands) now."""
        if self.lease is None:
            return True
        return self._ready and self.lease.leading

    def status(self) -> dict[str, Any]:
        """``GET /v1/leader``'s body."""
        if self.lease is None:
            return {"ha": False, "leading": True}
        body = self.lease.status().as_dict()
        body["leading"] = self.leading()
        body["ha"] = True
        return body

    async def start(self) -> None:
        """Take one step at once (a sole controller leads before ingest starts), then
        keep the lease in the background."""
        if self.lease is None or self._task is not None:
            return
        await self._tick()
        self._task = asyncio.create_task(self._loop(), name=f"lease:{self.lease.key}")

    async def stop(self, release: bool = True) -> None:
        """Stop the lease; ``release`` gives it up so a follower takes over at once."""
        task, self._task = self._task, None
        # cancelled again if a step swallowed the cancel; never waited for ever
        if task is not None and not await cancel_within([task], STOP_WAIT_S, "lease stop"):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                task.result()
        self._set_ready(False)
        if release and self.lease is not None:
            await self.lease.release()

    async def _loop(self) -> None:
        assert self.lease is not None
        timing = self.lease.timing
        while True:
            await asyncio.sleep(timing.renew_s if self.lease.leading else timing.poll_s)
            try:
                await self._tick()
            except Exception:  # a bug must not end the lease silently
                log.exception("lease step failed")

    async def _tick(self) -> None:
        assert self.lease is not None
        held = await self.lease.step()
        if held and not self._ready:
            if self.on_elected is not None:
                await self.on_elected()
            if self.lease.leading:
                self.elections += 1
                self._set_ready(True)
                log.info("leading region %s as %s", self.lease.region, self.lease.holder)
        elif not held and self._ready:
            log.warning("no longer leading region %s", self.lease.region)
            self._set_ready(False)

    def _set_ready(self, ready: bool) -> None:
        if ready != self._ready:
            self._ready = ready
            self.changed.set()
            self.changed = asyncio.Event()


async def region_leadership(
    kv: KeyValue,
    region: str,
    instance: str,
    *,
    renew_s: float = 3.0,
    poll_s: float = 0.5,
    margin_s: float = 1.0,
    default_ttl_s: float = 10.0,
    clock: Callable[[], float] = time.time,
) -> Leadership:
    """A Leadership over the leases bucket ``kv`` for one region (not started); its TTL
    is the bucket's.  Set ``on_elected`` before starting it."""
    ttl = await lease_ttl(kv, default_ttl_s)
    timing = LeaseTiming(ttl_s=ttl, renew_s=min(renew_s, ttl / 3), poll_s=poll_s, margin_s=margin_s)
    return Leadership(Lease(kv, region, instance, timing, clock=clock))
