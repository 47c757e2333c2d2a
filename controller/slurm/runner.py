"""Running Slurm's tools: a subprocess per command, a timeout, retries with backoff.

A command that fails (non-zero exit, killed at its timeout, binary missing) is retried
with exponential backoff and full jitter; after the last attempt it raises
:class:`SlurmCommandError`, which the bridge reports as an event.  Nothing here ever
lets an ``OSError`` or a timeout escape.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from metalguard.controller.slurm.config import SlurmSection
from metalguard.runtime.deadlines import within

log = logging.getLogger(__name__)

Sleep = Callable[[float], Awaitable[None]]


class SlurmCommandError(RuntimeError):
    """A Slurm command failed on every attempt; ``detail`` is its last error."""

    def __init__(self, argv: tuple[str, ...], attempts: int, detail: str) -> None:
        super().__init__(f"{' '.join(argv)}: failed {attempts} time(s): {detail}")
        self.argv = argv
        self.attempts = attempts
        self.detail = detail


@dataclass(frozen=True, slots=True)
class Completed:
    """One finished run."""

    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str


class SlurmRunner:
    """Runs ``scontrol``/``squeue``/``sinfo``/``scancel`` per the ``[slurm]`` section."""

    def __init__(
        self,
        cfg: SlurmSection,
        *,
        sleep: Sleep = asyncio.sleep,
        rng: random.Random | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self._cfg = cfg
        self._sleep = sleep
        self._rng = rng or random.Random()
        base = dict(os.environ if env is None else env)
        if cfg.conf:
            base["SLURM_CONF"] = cfg.conf
        self._env = base
        self.failures = 0
        """Failed attempts so far (every attempt, not only final failures)."""

    def argv(self, tool: str, *args: str) -> tuple[str, ...]:
        """The full command line of ``tool`` (resolved in ``bin_dir`` when set)."""
        exe = str(Path(self._cfg.bin_dir) / tool) if self._cfg.bin_dir else tool
        return (exe, *args)

    async def once(self, tool: str, *args: str) -> Completed:
        """One attempt; a missing binary or a timeout is a Completed with code 127 / 124."""
        argv = self.argv(tool, *args)
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=self._env,
                start_new_session=True,
            )
        except OSError as exc:
            return Completed(argv, 127, "", f"cannot run: {exc}")
        try:
            out, err = await within(proc.communicate(), self._cfg.command_timeout_s)
        except TimeoutError:
            await _reap(proc)
            return Completed(argv, 124, "", f"timed out after {self._cfg.command_timeout_s}s")
        except asyncio.CancelledError:
            await asyncio.shield(_reap(proc))  # never leave a child behind a cancelled task
            raise
        return Completed(
            argv, proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace")
        )

    async def run(self, tool: str, *args: str) -> str:
        """Run until it succeeds (its stdout) or the attempts are spent (SlurmCommandError)."""
        last: Completed | None = None
        for attempt in range(self._cfg.attempts):
            if attempt:
                ceiling = min(self._cfg.backoff_max_s, self._cfg.backoff_s * 2 ** (attempt - 1))
                await self._sleep(self._rng.uniform(0, ceiling))
            last = await self.once(tool, *args)
            if last.returncode == 0:
                return last.stdout
            self.failures += 1
            log.warning(
                "slurm: %s: attempt %d/%d: exit %d: %s",
                " ".join(last.argv),
                attempt + 1,
                self._cfg.attempts,
                last.returncode,
                last.stderr.strip()[:300],
            )
        assert last is not None
        detail = f"exit {last.returncode}: {last.stderr.strip()[:300]}"
        raise SlurmCommandError(last.argv, self._cfg.attempts, detail)


async def _reap(proc: asyncio.subprocess.Process) -> None:
    """Kill a child and wait for it."""
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    await proc.wait()
