"""Remediation through the BMC as node commands, answered by the bmc-proxy.

For every Redfish or IPMI target of its ``[[bmc]]`` list the proxy answers the node's
command subjects ``<p>.cmd.<region>.<cluster>.<node>.<verb>`` for the verbs in
:data:`VERBS` (request/reply, docs/bmc.md), also when the node's own OS is hung: that is
the point of going through the BMC.  Each command runs once per ``command_id``
(:class:`agent.bmc.remediation.Remediator` keeps the outcomes, on disk too); the reply is
the outcome as a CommandReply.  The node's own agent answers other verbs (its workload
verbs), so the two never race for one subject.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Final

from nats.aio.client import Client
from nats.aio.msg import Msg

from metalguard.agent.bmc.remediation import Remediator, to_reply
from metalguard.agent.bmc.targets import BmcTarget
from metalguard.agent.connection import AnsweringConnection, NatsSettings
from metalguard.proto.base import node_handle
from metalguard.proto.codec import CodecError, decode, encode
from metalguard.proto.events import Command, CommandReply, CommandStatus
from metalguard.proto.subjects import Subjects

log = logging.getLogger(__name__)

VERBS: Final[dict[str, str]] = {
    "bmc_power_status": "power_status",
    "bmc_power_cycle": "power_cycle",
    "bmc_force_power_cycle": "force_power_cycle",
    "bmc_pxe_once": "pxe_once",
    "bmc_power_off": "power_off",
}
"""Command verb -> remediation action (agent/bmc/remediation.py)."""
REMEDIABLE: Final = frozenset({"redfish", "ipmi"})
"""Protocols that can act (SNMP here only reads)."""


def check_command(cmd: Command, verb: str, target: BmcTarget, now: float) -> str | None:
    """Why ``cmd`` received on ``verb`` for ``target`` must be rejected, or None (pure)."""
    if not cmd.command_id.strip():
        return "command_id is empty: a command needs an id to run once"
    sent_for = cmd.node.handle
    if sent_for != node_handle(*target.region_cluster_node()):
        return f"command for {sent_for} on {target.node}'s subject"
    if cmd.verb != verb:
        return f"verb {cmd.verb!r} sent on {verb!r}"
    if verb not in VERBS:
        return f"unknown verb {verb!r}; the BMC answers {', '.join(VERBS)}"
    if cmd.expires_ts is not None and now > cmd.expires_ts:
        return "expired before it was executed"
    return None


class BmcCommandService:
    """Answers the BMC verbs of the proxy's remediable targets on its own connection."""

    def __init__(
        self,
        targets: Iterable[BmcTarget],
        remediator: Remediator,
        nats: NatsSettings,
        subjects: Subjects,
        *,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._targets = {t.node: t for t in targets if t.protocol in REMEDIABLE}
        self._remediator = remediator
        self._subjects = subjects
        self._wall = wall_clock
        self._tasks: set[asyncio.Task[None]] = set()
        self.link = AnsweringConnection(nats, self._subscribe, "bmc-commands")
        self.executed = 0
        """Commands handed to the remediator (repeated ids included: it answers those)."""
        self.rejected = 0
        """Messages answered ``rejected`` unexecuted (undecodable, or a bad command)."""
        self.failed = 0
        """Commands answered ``failed`` because the remediator raised (an internal error:
        the outcome store unwritable, say); a BMC failure is an outcome, not counted here."""

    @property
    def nodes(self) -> list[str]:
        """The nodes whose BMC verbs are answered here."""
        return sorted(self._targets)

    @property
    def subscribed(self) -> bool:
        """Whether the current client's subscriptions are in place."""
        return self.link.subscribed

    async def start(self) -> None:
        """Start connecting (never blocks on NATS)."""
        await self.link.start()

    async def run(self) -> None:
        """Answer the BMC verbs: subscribe on every new client; return only when cancelled."""
        await self.link.run()

    async def _subscribe(self, client: Client) -> None:
        for target in self._targets.values():
            region, cluster, node = target.region_cluster_node()
            for verb in VERBS:
                subject = self._subjects.command(region, cluster, node, verb)
                await client.subscribe(subject, cb=self._on_msg)
        log.info("bmc commands: answering for %d nodes", len(self._targets))

    async def close(self) -> None:
        """Stop answering; wait for the commands being executed."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.link.close()

    async def _on_msg(self, msg: Msg) -> None:
        task = asyncio.create_task(self._answer(msg))  # a power cycle takes minutes
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, msg: Msg) -> None:
        parsed = msg.subject.split(".")
        verb, handle = parsed[-1], ".".join(parsed[-4:-1])
        target = self._targets.get(handle)
        reply = await self._reply(msg.data, verb, target)
        if msg.reply:
            try:
                await msg.respond(encode(reply))
            except Exception as exc:
                log.warning("cannot answer bmc command %s: %s", reply.command_id, exc)

    async def _reply(self, data: bytes, verb: str, target: BmcTarget | None) -> CommandReply:
        try:
            cmd = decode(data, Command)
        except CodecError as exc:
            return self._rejected("", f"undecodable command: {exc}")
        if target is None:
            return self._rejected(cmd.command_id, "no BMC target for this node here")
        why = check_command(cmd, verb, target, self._wall())
        if why is not None:
            return self._rejected(cmd.command_id, why)
        self.executed += 1
        try:
            outcome = await self._remediator.execute(cmd.command_id, target, VERBS[verb])
        except Exception as exc:  # e.g. the outcome store unwritable: still answer
            log.exception("bmc %s %s on %s failed", verb, cmd.command_id, target.node)
            self.failed += 1
            return CommandReply(
                command_id=cmd.command_id,
                ts=self._wall(),
                ok=False,
                status=CommandStatus.FAILED,
                message=f"internal error: {type(exc).__name__}: {exc}",
            )
        log.info("bmc %s on %s: %s", verb, target.node, outcome.message)
        return to_reply(outcome)

    def _rejected(self, command_id: str, message: str) -> CommandReply:
        self.rejected += 1
        log.debug("bmc command %r rejected: %s", command_id, message)
        return CommandReply(
            command_id=command_id,
            ts=self._wall(),
            ok=False,
            status=CommandStatus.REJECTED,
            message=message,
        )
