"""What the Slurm bridge publishes: its actions as ControllerEvents ``slurm.<what>`` on
``<p>.ctl.<region>.slurm.<what>``, and Slurm's own view of a node as NodeEvents
``slurm_down`` / ``slurm_up`` / ``slurm_jobs`` on ``<p>.evt.<region>.<cluster>.<node>.<kind>``
(docs/slurm.md).
A publish that fails is logged, never raised: announcing must not stop the bridge."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from nats.errors import Error as NatsError
from nats.js import JetStreamContext

from metalguard.controller.slurm.actions import Trigger
from metalguard.controller.slurm.config import BridgeConfig
from metalguard.controller.slurm.parse import SlurmNode
from metalguard.controller.slurm.runner import SlurmCommandError
from metalguard.proto.base import AttrValue, NodeIdentity
from metalguard.proto.codec import encode
from metalguard.proto.events import SLURM_JOBS_KIND, ControllerEvent, NodeEvent
from metalguard.proto.subjects import Subjects

log = logging.getLogger(__name__)

JOBS_LISTED = 10
"""Job ids a ``slurm_jobs`` event's message names (its ``jobs`` attribute has them all)."""


class Announcer:
    """Publishes the bridge's events with message ids (a republish is stored once)."""

    def __init__(
        self,
        js: JetStreamContext,
        subjects: Subjects,
        cfg: BridgeConfig,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._js = js
        self._subjects = subjects
        self.cfg = cfg
        self._clock = clock

    def _identity(self, name: str) -> NodeIdentity:
        """The metalguard node of Slurm node ``name``."""
        region, cluster, short = self.cfg.handle_of(name).split(".")
        return NodeIdentity(region=region, cluster=cluster, node=short)

    async def node_event(self, name: str, kind: str, severity: str, node: SlurmNode | None) -> None:
        """Slurm's view of Slurm node ``name`` as a NodeEvent of its metalguard node."""
        identity = self._identity(name)
        now = self._clock()
        attributes: dict[str, AttrValue] = {"slurm_node": name}
        if node is not None:
            attributes |= {"state": node.describe(), "reason": node.reason}
            message = f"Slurm reports {name} {node.describe()}" + (
                f" ({node.reason})" if node.reason else ""
            )
        else:
            message = f"Slurm reports {name} responding again"
        event = NodeEvent(
            node=identity,
            event_id=f"{kind}-{int(now * 1000)}",
            ts=now,
            kind=kind,
            source="slurm",
            device=name,
            severity=severity,
            message=message,
            attributes=attributes,
        )
        log.info("slurm bridge: %s", message)
        await self._publish_node_event(event)

    async def jobs_event(self, name: str, job_ids: tuple[str, ...]) -> bool:
        """Slurm node ``name``'s active jobs as a ``slurm_jobs`` NodeEvent (info) of its
        metalguard node: ``running`` (their count), ``jobs`` (their ids, comma-separated);
        whether it was published."""
        now = self._clock()
        listed = ", ".join(job_ids[:JOBS_LISTED]) + (", ..." if len(job_ids) > JOBS_LISTED else "")
        count = len(job_ids)
        message = f"Slurm runs {count} job{'' if count == 1 else 's'} on {name}"
        event = NodeEvent(
            node=self._identity(name),
            event_id=f"{SLURM_JOBS_KIND}-{int(now * 1000)}",
            ts=now,
            kind=SLURM_JOBS_KIND,
            source="slurm",
            device=name,
            severity="info",
            message=f"{message} ({listed})" if job_ids else message,
            attributes={"slurm_node": name, "running": count, "jobs": ",".join(job_ids)},
        )
        log.debug("slurm bridge: %s", event.message)
        return await self._publish_node_event(event)

    async def _publish_node_event(self, event: NodeEvent) -> bool:
        node = event.node
        subject = self._subjects.node_event(node.region, node.cluster, node.node, event.kind)
        return await self._publish(subject, encode(event), f"{node.handle}:{event.event_id}")

    async def failed(
        self, trigger: Trigger | None, exc: SlurmCommandError, job: str | None = None
    ) -> None:
        """Report a Slurm command that failed on every attempt (``slurm.command_failed``)."""
        log.error("slurm bridge: %s", exc)
        attrs: dict[str, AttrValue] = {
            "command": " ".join(exc.argv),
            "attempts": exc.attempts,
            "detail": exc.detail,
        }
        if trigger is not None:
            attrs["slurm_node"] = self.cfg.slurm_name(trigger.handle)
        if trigger is None:
            stamp = f"{int(self._clock() * 1000)}"
            event = ControllerEvent(
                event_id=f"slurm.command_failed:{self.cfg.region}:{stamp}",
                ts=self._clock(),
                region=self.cfg.region,
                kind="slurm.command_failed",
                message=str(exc),
                attributes=attrs,
            )
            await self._publish_control(event)
            return
        await self.announce(trigger, "command_failed", str(exc), attrs, job=job, unique=True)

    async def announce(
        self,
        trigger: Trigger,
        what: str,
        message: str,
        attributes: dict[str, AttrValue],
        *,
        job: str | None = None,
        unique: bool = False,
    ) -> None:
        """Publish ``slurm.<what>`` about the trigger's node; its id is derived from the
        decision's, so a redelivered decision does not announce twice."""
        event_id = f"slurm.{what}:{trigger.handle}:{trigger.event_id}"
        if job is not None:
            event_id += f":job{job}"
        if unique:
            event_id += f"@{int(self._clock() * 1000)}"
        event = ControllerEvent(
            event_id=event_id,
            ts=self._clock(),
            region=self.cfg.region,
            kind=f"slurm.{what}",
            node=trigger.node,
            job_id=job,
            message=message,
            attributes={"cause": trigger.kind, "cause_event_id": trigger.event_id, **attributes},
        )
        await self._publish_control(event)

    async def _publish_control(self, event: ControllerEvent) -> None:
        subject = self._subjects.control(self.cfg.region, event.kind)
        await self._publish(subject, encode(event), event.event_id)

    async def _publish(self, subject: str, data: bytes, msg_id: str) -> bool:
        """Publish with a message id; whether the stream took it (a failure is logged)."""
        try:
            await self._js.publish(subject, data, headers={"Nats-Msg-Id": msg_id})
        except (NatsError, TimeoutError) as exc:
            log.warning("slurm bridge: could not publish %s: %s", subject, exc)
            return False
        return True
