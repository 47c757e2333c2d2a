"""The ``gpu_reset`` verb: reset a drained node's GPUs with ``nvidia-smi --gpu-reset -i N``
(docs/decisions.md, "GPU"). The controller sends it once the node's last job has ended;
the agent refuses while a job member still runs here. A reset GPU's XIDs are forgotten
(``agent.collectors.gpu_xids``) and the gpu collector reads it again at once: the node
returns to service only when that re-check is clean.
"""

from __future__ import annotations

import asyncio
import logging
import shlex
from collections.abc import Callable
from dataclasses import dataclass

from metalguard.agent.collectors.gpu_xids import XidLedger
from metalguard.agent.workload.runner import RunnerError
from metalguard.proto.events import CommandStatus

log = logging.getLogger(__name__)

OUTPUT_TAIL = 400
"""Characters of nvidia-smi's output a failed reset's message keeps."""


@dataclass(frozen=True, slots=True)
class GpuResetSettings:
    """``[workload] nvidia_smi`` and ``gpu_reset_timeout_s``."""

    nvidia_smi: str = "nvidia-smi"
    """The command (split like a shell would) whose ``--gpu-reset -i N`` resets GPU N."""
    timeout_s: float = 120.0
    """How long one GPU's reset may take before it counts as failed."""


def reset_argv(nvidia_smi: str, index: int) -> list[str]:
    """``nvidia-smi --gpu-reset -i <index>`` (``nvidia_smi`` may carry its own arguments)."""
    return [*shlex.split(nvidia_smi), "--gpu-reset", "-i", str(index)]


def parse_gpus(value: object) -> tuple[int, ...]:
    """The ``gpus`` argument (GPU indices as strings or ints); ValueError saying why."""
    if not isinstance(value, list | tuple) or not value:
        raise ValueError("args.gpus must be a non-empty list of GPU indices")
    gpus: list[int] = []
    for item in value:
        try:
            index = int(item)
        except (TypeError, ValueError):
            raise ValueError(f"args.gpus: {item!r} is not a GPU index") from None
        if index < 0 or isinstance(item, bool):
            raise ValueError(f"args.gpus: {item!r} is not a GPU index")
        gpus.append(index)
    return tuple(sorted(set(gpus)))


class GpuResetter:
    """Resets GPUs through nvidia-smi, only when no job member runs on the node."""

    def __init__(
        self,
        settings: GpuResetSettings,
        *,
        busy: Callable[[], int],
        xids: XidLedger | None = None,
        on_reset: Callable[[], None] = lambda: None,
    ) -> None:
        """``busy``: the job members still running here; ``on_reset``: asks the gpu
        collector for a fresh reading."""
        self.settings = settings
        self._busy = busy
        self._xids = xids
        self._on_reset = on_reset
        self._lock = asyncio.Lock()

    async def reset(self, gpus: tuple[int, ...]) -> dict[str, object]:
        """Reset each of ``gpus`` in turn; RunnerError (rejected while busy, failed when
        nvidia-smi fails: the GPUs reset before it keep their reset)."""
        async with self._lock:
            running = self._busy()
            if running:
                raise RunnerError(
                    f"{running} job member(s) still running here: drain the node first",
                    CommandStatus.REJECTED,
                    running=running,
                )
            cleared = 0
            done: list[str] = []
            try:
                for index in gpus:
                    await self._reset_one(index)
                    if self._xids is not None:
                        cleared += self._xids.clear(index)
                    done.append(str(index))
            finally:
                if done:
                    self._on_reset()
            return {"gpus": done, "cleared_xids": cleared}

    async def _reset_one(self, index: int) -> None:
        argv = reset_argv(self.settings.nvidia_smi, index)
        shown = shlex.join(argv)
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
            )
        except OSError as exc:
            raise RunnerError(f"{shown}: {exc}", CommandStatus.FAILED, gpu=index) from None
        try:
            async with asyncio.timeout(self.settings.timeout_s):
                out, _ = await proc.communicate()
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise RunnerError(
                f"{shown}: no answer within {self.settings.timeout_s:g} s",
                CommandStatus.FAILED,
                gpu=index,
            ) from None
        text = out.decode(errors="replace").strip()
        if proc.returncode != 0:
            raise RunnerError(
                f"{shown} exited {proc.returncode}: {text[-OUTPUT_TAIL:]}",
                CommandStatus.FAILED,
                gpu=index,
                exit_code=proc.returncode,
            )
        log.info("GPU %d reset: %s", index, text[-OUTPUT_TAIL:])
