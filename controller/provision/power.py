"""The power path of provisioning: a node's BMC, through its bmc-proxy (docs/bmc.md).

:class:`BmcPower` sends the bmc-proxy's Command verbs request/reply on
``<p>.cmd.<region>.<cluster>.<node>.<verb>`` (agent/bmc/commands.py answers them,
idempotent by command id) — never through the node's own OS:

- :meth:`BmcPower.network_boot`: ``bmc_pxe_once`` (a one-time PXE boot override, id
  ``<command_id>.pxe``), then ``bmc_power_cycle`` (id ``<command_id>.cycle``): the node
  boots from the network once, the boot server tells it which volume to attach;
- :meth:`BmcPower.power_off`: ``bmc_power_off`` (forced off, id ``<command_id>``).

A command no bmc-proxy answers, or answered too late, is a :class:`PowerError` with
status 504; one the proxy refused or whose BMC failed, status 502 (the BMC's message in
it).  A repeated command id is answered from the proxy's memory without acting twice, so
a restarted controller may send the same boot again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError

from metalguard.proto.base import NodeIdentity
from metalguard.proto.codec import CodecError, decode, encode
from metalguard.proto.events import Command, CommandReply
from metalguard.proto.subjects import Subjects


class PowerError(Exception):
    """The BMC did not do what was asked: ``status`` 502 (refused, failed) or 504 (no
    answer in time); ``message`` says which node, which verb and why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class PowerDriver(Protocol):
    """How the service powers nodes (the BMC path; the demo has a simulated one)."""

    async def network_boot(self, node: str, command_id: str) -> None:
        """Boot ``node`` from the network once: PXE override, then a power cycle;
        PowerError when the BMC refuses or does not answer."""
        ...

    async def power_off(self, node: str, command_id: str) -> None:
        """Turn ``node`` off (the tenant's OS stops); PowerError as above."""
        ...


class BmcPower:
    """:class:`PowerDriver` over the bmc-proxy's Command verbs on NATS."""

    def __init__(
        self,
        nc: Client,
        subjects: Subjects,
        timeout_s: float = 300.0,
        *,
        clock: Callable[[], float] = time.time,
        issued_by: str = "controller:provision",
    ) -> None:
        self._nc = nc
        self._subjects = subjects
        self.timeout_s = timeout_s
        self._clock = clock
        self._issued_by = issued_by

    async def network_boot(self, node: str, command_id: str) -> None:
        """``bmc_pxe_once`` then ``bmc_power_cycle`` (graceful: the OS may flush)."""
        await self.command(node, "bmc_pxe_once", f"{command_id}.pxe")
        await self.command(node, "bmc_power_cycle", f"{command_id}.cycle")

    async def power_off(self, node: str, command_id: str) -> None:
        """``bmc_power_off``: forced off (an off node stays off)."""
        await self.command(node, "bmc_power_off", command_id)

    async def command(self, node: str, verb: str, command_id: str) -> CommandReply:
        """Send one BMC verb to ``node``'s bmc-proxy and wait for its reply; PowerError
        unless it answered ``ok``."""
        region, cluster, name = node.split(".", 2)
        cmd = Command(
            command_id=command_id,
            ts=self._clock(),
            node=NodeIdentity(region=region, cluster=cluster, node=name),
            verb=verb,
            issued_by=self._issued_by,
        )
        subject = self._subjects.command(region, cluster, name, verb)
        try:
            msg = await self._nc.request(subject, encode(cmd), timeout=self.timeout_s)
        except NoRespondersError:
            raise PowerError(504, f"{verb} to {node}: no bmc-proxy answers for it") from None
        except TimeoutError:
            raise PowerError(
                504, f"{verb} to {node}: the BMC did not answer within {self.timeout_s:g}s"
            ) from None
        except NatsError as exc:
            raise PowerError(504, f"{verb} to {node}: not sent: {exc}") from None
        try:
            reply = decode(msg.data, CommandReply)
        except CodecError as exc:
            raise PowerError(502, f"{verb} to {node}: undecodable reply: {exc}") from None
        if not reply.ok:
            raise PowerError(502, f"{verb} to {node}: {reply.status}: {reply.message}")
        return reply
