"""Slurm's view and Slurm's verbs, through its own command-line tools.

Reads: ``sinfo --json`` and ``squeue --json`` (or, where this Slurm has no ``--json``,
``scontrol show node -o`` and ``squeue -h -o '%i|%T|%N|%r'``).  Writes: ``scontrol
update`` (drain, resume), ``scancel --signal`` (checkpoint request), ``scontrol requeue``.
"""

from __future__ import annotations

import logging
from typing import Literal

from metalguard.controller.slurm.parse import (
    SQUEUE_TEXT_FORMAT,
    SlurmJob,
    SlurmNode,
    SlurmParseError,
    parse_scontrol_nodes,
    parse_sinfo_json,
    parse_squeue_json,
    parse_squeue_text,
)
from metalguard.controller.slurm.runner import SlurmCommandError, SlurmRunner

log = logging.getLogger(__name__)

_NO_JSON_HINTS = ("unrecognized option", "invalid option", "unknown option", "plugin")


class SlurmTools:
    """Slurm through ``runner``; ``output`` as the ``[slurm]`` section says."""

    def __init__(self, runner: SlurmRunner, output: Literal["auto", "json", "text"]) -> None:
        self.runner = runner
        self._json: bool | None = {"auto": None, "json": True, "text": False}[output]

    async def _uses_json(self) -> bool:
        if self._json is None:
            probe = await self.runner.once("sinfo", "--json")
            refused = probe.returncode != 0 and any(
                h in probe.stderr.lower() for h in _NO_JSON_HINTS
            )
            self._json = not refused
            log.info("slurm: reading %s output", "JSON" if self._json else "text")
        return self._json

    async def nodes(self) -> tuple[SlurmNode, ...]:
        """Every node with its state and reason."""
        try:
            if await self._uses_json():
                return parse_sinfo_json(await self.runner.run("sinfo", "--json"))
            return parse_scontrol_nodes(await self.runner.run("scontrol", "show", "node", "-o"))
        except SlurmParseError as exc:
            raise SlurmCommandError(("sinfo",), 1, str(exc)) from None

    async def jobs(self) -> tuple[SlurmJob, ...]:
        """Every job squeue lists (pending, running, completing, ...)."""
        try:
            if await self._uses_json():
                return parse_squeue_json(await self.runner.run("squeue", "--json"))
            text = await self.runner.run("squeue", "-h", "-o", SQUEUE_TEXT_FORMAT)
            return parse_squeue_text(text)
        except SlurmParseError as exc:
            raise SlurmCommandError(("squeue",), 1, str(exc)) from None

    async def drain(self, node: str, reason: str) -> None:
        """``scontrol update NodeName=N State=DRAIN Reason=...``"""
        await self.runner.run(
            "scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}"
        )

    async def resume(self, node: str) -> None:
        """``scontrol update NodeName=N State=RESUME``"""
        await self.runner.run("scontrol", "update", f"NodeName={node}", "State=RESUME")

    async def signal(self, job_id: str, signal: str, scope: Literal["batch", "full"]) -> None:
        """``scancel --signal=SIG --batch|--full JOB``"""
        await self.runner.run("scancel", f"--signal={signal}", f"--{scope}", job_id)

    async def requeue(self, job_id: str) -> None:
        """``scontrol requeue JOB``"""
        await self.runner.run("scontrol", "requeue", job_id)
