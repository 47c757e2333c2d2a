"""The workload part of the agent: runner + command handler on their own NATS connection
(:class:`agent.connection.AnsweringConnection`, same settings as the publisher's)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from metalguard.agent.collectors.gpu_xids import XidLedger
from metalguard.agent.config import CacheSection, WorkloadSection
from metalguard.agent.connection import AnsweringConnection, NatsSettings
from metalguard.agent.workload.commands import CommandHandler
from metalguard.agent.workload.gpu_reset import GpuResetSettings, GpuResetter
from metalguard.agent.workload.runner import Emit, Runner, RunnerSettings
from metalguard.proto.base import NodeIdentity
from metalguard.proto.subjects import Subjects

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


def dataset_dirs(cache: CacheSection) -> dict[str, str]:
    """The node's dataset caches (``[[cache.datasets]]``): name -> mountpoint ("" when it
    has none): what a job member's ``MG_DATASET_DIR`` is."""
    return {d.name: d.mountpoint for d in cache.datasets}


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
        datasets: Callable[[], Mapping[str, str]] = dict,
        xids: XidLedger | None = None,
        on_gpu_reset: Callable[[], None] = lambda: None,
    ) -> None:
        """``datasets``: the node's dataset mounts (:func:`dataset_dirs`), read at every
        start, so a reloaded ``[cache]`` applies to the next member started. ``xids``: the
        agent's XID ledger (a reset GPU's are forgotten); ``on_gpu_reset``: asks for a
        fresh GPU reading after a reset."""
        self.runner = Runner(
            identity, emit, runner_settings(section), wall_clock=wall_clock, dataset_dirs=datasets
        )
        resetter = GpuResetter(
            GpuResetSettings(section.nvidia_smi, section.gpu_reset_timeout_s),
            busy=lambda: sum(1 for m in self.runner.members() if m.running),
            xids=xids,
            on_reset=on_gpu_reset,
        )
        self.handler = CommandHandler(
            identity,
            self.runner,
            remember=section.remember_commands,
            wall_clock=wall_clock,
            gpu_reset=resetter,
        )
        self.link = AnsweringConnection(
            nats, lambda client: self.handler.subscribe(client, subjects), "commands"
        )

    async def start(self) -> None:
        """Open the client library's socket and start connecting (never blocks on NATS)."""
        await self.runner.start()
        await self.link.start()

    async def run(self) -> None:
        """Answer commands: subscribe on every new client; return only when cancelled."""
        await self.link.run()

    async def close(self) -> None:
        """Stop answering, stop the workloads gracefully (their exits are reported)."""
        await self.handler.unsubscribe()
        await self.runner.close()  # a checkpoint still waiting fails now: its process is gone
        await self.handler.close()
        await self.link.close()
