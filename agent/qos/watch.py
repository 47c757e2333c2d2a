"""Watch the node's desired QosProfile in KV ``<P>_QOS`` and hand it to the reconciler.

Keys: ``<cluster>.<node>`` (this node's override) wins over ``<cluster>`` (the cluster's
profile).  Values are QosProfile messages encoded with :func:`proto.codec.encode`
(msgpack), the same function the controller writes them with; they are decoded with
``proto.codec.decode(value, QosProfile)``.  A value that does not decode or fails
``profile_problems`` is reported (``qos_failed``) and the profile applied before stays.
Deleting both keys leaves the applied state in place (nothing is enforced any more).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError

from metalguard.agent.qos.reconciler import QosReconciler
from metalguard.proto.codec import CodecError, decode
from metalguard.proto.qos import QosProfile, profile_problems
from metalguard.proto.subjects import Subjects

log = logging.getLogger(__name__)

BUCKET = "qos"
UPDATE_WAIT_S = 5.0
RETRY_S = 2.0

GetJs = Callable[[], Awaitable[JetStreamContext]]


def keys_for(cluster: str, node: str) -> tuple[str, str]:
    """(node override key, cluster key) in precedence order."""
    return f"{cluster}.{node}", cluster


class ProfileWatcher:
    """Feeds the effective profile (node override, else cluster) to a reconciler."""

    def __init__(
        self,
        subjects: Subjects,
        cluster: str,
        node: str,
        reconciler: QosReconciler,
        *,
        retry_s: float = RETRY_S,
    ) -> None:
        self.bucket = subjects.bucket(BUCKET)
        self.node_key, self.cluster_key = keys_for(cluster, node)
        self._reconciler = reconciler
        self._retry_s = retry_s
        self._values: dict[str, QosProfile | None] = {self.node_key: None, self.cluster_key: None}
        self._effective: tuple[str, QosProfile | None] = ("", None)

    async def run(self, get_js: GetJs) -> None:
        """Watch until cancelled; reopens the watch after a lost bucket or connection."""
        while True:
            try:
                js = await get_js()
                kv = await js.key_value(self.bucket)
                await self._watch(kv)
            except asyncio.CancelledError:
                raise
            except BucketNotFoundError:
                log.info("QoS bucket %s does not exist yet; retrying", self.bucket)
            except Exception as exc:  # lost connection, deleted stream: watch again
                log.warning("QoS watch on %s ended (%s); retrying", self.bucket, exc)
            await asyncio.sleep(self._retry_s)

    async def _watch(self, kv: Any) -> None:
        watchers = [await kv.watch(key) for key in (self.node_key, self.cluster_key)]
        try:
            await asyncio.gather(*(self._follow(w) for w in watchers))
        finally:
            for w in watchers:
                try:
                    await w.stop()
                except Exception:  # already gone with the connection
                    log.debug("stopping a QoS watcher failed", exc_info=True)

    async def _follow(self, watcher: Any) -> None:
        while True:
            try:
                entry = await watcher.updates(timeout=UPDATE_WAIT_S)
            except TimeoutError:
                continue
            if entry is None:  # end of the initial values
                continue
            await self.take(entry.key, entry.value, entry.operation)

    async def take(self, key: str, value: bytes | None, operation: str | None) -> None:
        """One KV entry: decode it, update the effective profile, tell the reconciler."""
        if key not in self._values:
            return
        if operation in ("DEL", "PURGE") or not value:
            self._values[key] = None
        else:
            try:
                profile = decode(value, QosProfile)
            except CodecError as exc:
                await self._reconciler.report_invalid(key, [exc.reason])
                return
            if problems := profile_problems(profile):
                await self._reconciler.report_invalid(key, problems)
                return
            self._values[key] = profile
        await self._publish()

    async def _publish(self) -> None:
        for key in (self.node_key, self.cluster_key):
            profile = self._values[key]
            if profile is not None:
                break
        else:
            key, profile = "", None
        if (key, profile) != self._effective:
            self._effective = (key, profile)
            log.info("QoS profile now from %s", key or "nowhere")
            await self._reconciler.set_profile(profile, key)
