"""The workload part of the agent: runner + command handler on their own NATS connection.

Commands are request/reply on core NATS, so they get a connection of their own (same
settings as the publisher's): a slow JetStream publish never delays an answer, and the
subscriptions are made again on every new client the connection creates.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path

from nats.aio.client import Client

from agent.config import WorkloadSection
from agent.connection import Connection, NatsSettings
from agent.workload.commands import CommandHandler
from agent.workload.runner import Emit, Runner, RunnerSettings
from proto.base import NodeIdentity
from proto.subjects import Subjects

log = logging.getLogger(__name__)


def runner_settings(section: WorkloadSection) -> RunnerSettings:
    """The runner's settings from ``[workload]``."""
    return RunnerSettings(
        work_dir=Path(section.work_dir),
        socket_path=section.socket,
        stop_grace_s=section.stop_grace_s,
        checkpoint_timeout_s=section.checkpoint_timeout_s,
        progress_interval_s=section.progress_interval_s,
        python=section.python,
    )


class WorkloadService:
    """Starts the runner and answers commands until closed."""

    def __init__(
        self,
        section: WorkloadSection,
        identity: Callable[[], NodeIdentity],
        emit: Emit,
        nats: NatsSettings,
        subjects: Subjects,
        *,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.runner = Runner(identity, emit, runner_settings(section), wall_clock=wall_clock)
        self.handler = CommandHandler(
            identity, self.runner, remember=section.remember_commands, wall_clock=wall_clock
        )
        self._subjects = subjects
        self._client: Client | None = None
        self._changed = asyncio.Event()
        self.connection = Connection(
            dataclasses.replace(nats, name=f"{nats.name}-commands"),
            client_factory=self._new_client,
            on_state=lambda _up: self._changed.set(),
        )

    def _new_client(self) -> Client:
        self._client = Client()
        return self._client

    async def start(self) -> None:
        """Open the client library's socket and start connecting (never blocks on NATS)."""
        await self.runner.start()
        self._changed.set()
        if not await self.connection.start():
            log.warning("workload commands: NATS not reachable yet; retrying")

    async def run(self) -> None:
        """Subscribe on every new client; return only when cancelled."""
        subscribed_on: Client | None = None
        while True:
            await self._changed.wait()
            self._changed.clear()
            client = self._client
            if self.connection.connected.is_set() and client is not subscribed_on:
                assert client is not None
                await self.handler.subscribe(client, self._subjects)
                await client.flush()
                subscribed_on = client
                log.info("workload commands: subscribed")

    async def close(self) -> None:
        """Stop answering, stop the workloads gracefully (their exits are reported)."""
        await self.handler.unsubscribe()
        await self.runner.close()  # a checkpoint still waiting fails now: its process is gone
        await self.handler.close()
        await self.connection.close()
