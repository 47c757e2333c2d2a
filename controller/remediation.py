"""The region's remediation loop: asks nodes for the remedies their records call for
(:mod:`controller.core.remediation`: a GPU reset once drained, a power cycle through the
BMC for a lost GPU) and announces each outcome (docs/decisions.md, "GPU").

Only the region's leader acts. Each remedy is one request/reply Command on
``<p>.cmd.<region>.<cluster>.<node>.<verb>`` (``gpu_reset``: the agent's workload runner;
``bmc_power_cycle``: the node's bmc-proxy), with the remedy's deterministic id: asked once
per episode; a node that did not answer is asked again on a later pass with the same id
(the executor never acts twice on one id). The outcome is a ControllerEvent
``node.gpu_reset`` / ``node.power_cycled`` (``...failed`` when refused or failed: an
operator looks; it is not retried), carrying the command id and the findings.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Protocol

from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.js import JetStreamContext

from metalguard.controller.config import RemediationSection
from metalguard.controller.core.remediation import (
    ALL_VERBS,
    EVENT_KIND,
    Remedy,
    RemedyVerb,
    remedies,
)
from metalguard.controller.stopping import cancel_within
from metalguard.proto.base import AttrValue, NodeIdentity
from metalguard.proto.codec import CodecError, decode, encode
from metalguard.proto.events import Command, CommandReply, ControllerEvent
from metalguard.proto.nodes import NodeRecord
from metalguard.proto.subjects import Subjects
from metalguard.runtime.deadlines import wait_event

log = logging.getLogger(__name__)

STOP_WAIT_S = 10.0
RETRY_S = 30.0
"""A remedy nobody answered (no agent runner, no bmc-proxy) is asked again after this."""
REMEMBER = 4096
"""Settled command ids kept (an episode's id is never asked again once settled)."""


def remediation_verbs(section: RemediationSection) -> frozenset[RemedyVerb]:
    """The remedies ``[remediation]`` allows."""
    verbs: set[RemedyVerb] = set()
    if section.gpu_reset:
        verbs.add("gpu_reset")
    if section.power_cycle:
        verbs.add("bmc_power_cycle")
    return frozenset(verbs)


class NodeRecords(Protocol):
    """Where the loop reads the region's records (the region controller's store)."""

    @property
    def records(self) -> Mapping[str, NodeRecord]: ...


class Remediation:
    """Asks for due remedies every ``tick_s`` (or when woken)."""

    def __init__(
        self,
        nc: Client,
        js: JetStreamContext,
        nodes: NodeRecords,
        subjects: Subjects,
        region: str,
        *,
        verbs: frozenset[RemedyVerb] = ALL_VERBS,
        tick_s: float = 2.0,
        timeout_s: float = 300.0,
        clock: Callable[[], float] = time.time,
        leading: Callable[[], bool] = lambda: True,
    ) -> None:
        """``verbs``: the remedies asked for (``[remediation]``); ``timeout_s``: how long
        one remedy's reply may take (a GPU reset, a BMC's power cycle)."""
        self.verbs = verbs
        self._nc = nc
        self._js = js
        self._nodes = nodes
        self._subjects = subjects
        self.region = region
        self.tick_s = tick_s
        self.timeout_s = timeout_s
        self._clock = clock
        self._leading = leading
        self._settled: dict[str, bool] = {}
        """Command id -> whether it succeeded (settled ids are not asked again)."""
        self._inflight: dict[str, asyncio.Task[None]] = {}
        self._retry_at: dict[str, float] = {}
        """Command id -> when an unanswered remedy is asked again."""
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def settled(self, command_id: str) -> bool | None:
        """Whether a remedy succeeded (None: not settled yet)."""
        return self._settled.get(command_id)

    async def start(self) -> None:
        """Start the passes."""
        self._task = asyncio.create_task(self._run(), name="remediation")

    async def stop(self) -> None:
        """Stop the passes and the requests in flight (asked again by the next leader)."""
        tasks = [t for t in (self._task, *self._inflight.values()) if t is not None]
        self._task, self._inflight = None, {}
        await cancel_within(tasks, STOP_WAIT_S, "remediation")

    def wake(self) -> None:
        """Run a pass now."""
        self._wake.set()

    async def _run(self) -> None:
        while True:
            try:
                self.run_pass()
            except Exception:
                log.exception("remediation pass failed; retrying on the next tick")
            await wait_event(self._wake, self.tick_s)
            self._wake.clear()

    def run_pass(self) -> list[Remedy]:
        """Ask for every due remedy not settled nor in flight; the ones asked."""
        if not self._leading():
            return []
        ours = {h: r for h, r in self._nodes.records.items() if r.node.region == self.region}
        asked = []
        now = self._clock()
        for remedy in remedies(ours, self.verbs):
            cid = remedy.command_id
            if cid in self._settled or cid in self._inflight or self._retry_at.get(cid, 0) > now:
                continue
            task = asyncio.create_task(self._ask(remedy), name=f"remedy-{remedy.command_id}")
            self._inflight[remedy.command_id] = task
            task.add_done_callback(self._forget_inflight)
            asked.append(remedy)
        return asked

    def _forget_inflight(self, task: asyncio.Task[None]) -> None:
        for command_id, running in list(self._inflight.items()):
            if running is task:
                del self._inflight[command_id]

    async def _ask(self, remedy: Remedy) -> None:
        region, cluster, name = remedy.handle.split(".", 2)
        node = NodeIdentity(region=region, cluster=cluster, node=name)
        args: dict[str, AttrValue | list[str]] = {}
        if remedy.gpus:
            args["gpus"] = [str(g) for g in remedy.gpus]
        command = Command(
            command_id=remedy.command_id,
            ts=self._clock(),
            node=node,
            verb=remedy.verb,
            args=args,
            issued_by="controller:remediation",
        )
        subject = self._subjects.command(region, cluster, name, remedy.verb)
        try:
            msg = await self._nc.request(subject, encode(command), timeout=self.timeout_s)
            reply = decode(msg.data, CommandReply)
        except (NatsError, TimeoutError, CodecError) as exc:
            self._retry_at[remedy.command_id] = self._clock() + RETRY_S
            log.warning(
                "%s %s: no answer (%s); asked again in %.0f s", remedy.verb, remedy.handle, exc,
                RETRY_S,
            )  # fmt: skip
            return
        if not await self._announce(remedy, node, reply):
            return  # not announced: asked again (same id: answered from the node's memory)
        self._settled[remedy.command_id] = reply.ok
        self._retry_at.pop(remedy.command_id, None)
        while len(self._settled) > REMEMBER:
            del self._settled[next(iter(self._settled))]

    async def _announce(self, remedy: Remedy, node: NodeIdentity, reply: CommandReply) -> bool:
        kind = EVENT_KIND[remedy.verb] + ("" if reply.ok else ".failed")
        what = (
            "reset " + ", ".join(f"gpu{g}" for g in remedy.gpus) if remedy.gpus else "power cycle"
        )
        said = reply.message if reply.message.startswith(what) else f"{what}: {reply.message}"
        message = (
            f"{said}; back in service after clean re-checks"
            if reply.ok
            else f"{what} {reply.status}: {reply.message}; an operator must look"
        )
        event = ControllerEvent(
            event_id=f"{remedy.command_id}:{kind}",
            ts=self._clock(),
            region=self.region,
            kind=kind,
            node=node,
            reasons=remedy.reasons,
            message=message,
            command_id=remedy.command_id,
            attributes={"verb": remedy.verb, "status": reply.status, "gpus": len(remedy.gpus)},
        )
        try:
            await self._js.publish(
                self._subjects.control(self.region, kind),
                encode(event),
                headers={"Nats-Msg-Id": event.event_id},
            )
        except NatsError as exc:
            log.warning("%s not published: %s", event.event_id, exc)
            return False
        log.info("%s %s: %s", remedy.handle, kind, message)
        return True
