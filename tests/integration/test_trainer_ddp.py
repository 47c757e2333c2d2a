"""examples/train_ddp.py: a real 2-rank DDP gang over gloo, stopped and resumed; the loss
continues from the checkpoint and the final parameters are those of an uninterrupted run.
Needs the ``torch`` extra (``pip install '.[torch]'``); skipped with the reason otherwise."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import socket
import sys
from pathlib import Path

import pytest

from tests.support.waiting import wait_for_line

if importlib.util.find_spec("torch") is None:
    pytest.skip(
        "torch is not installed (pip install '.[torch]'); the DDP example is not run",
        allow_module_level=True,
    )

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # six torch imports on 2 cores
DDP = str(Path(__file__).parents[2] / "examples" / "train_ddp.py")
STEPS = 30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _gang(ckpt: Path, *args: str) -> list[asyncio.subprocess.Process]:
    port = str(_free_port())
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "MG_RANK": str(rank),
            "MG_WORLD_SIZE": "2",
            "MG_MASTER_ADDR": "127.0.0.1",
            "MG_MASTER_PORT": port,
            "MG_CHECKPOINT_DIR": str(ckpt),
            "PYTHONWARNINGS": "ignore",
        }
        env.pop("MG_WORKLOAD_SOCKET", None)
        procs.append(
            await asyncio.create_subprocess_exec(
                sys.executable,
                DDP,
                "--steps",
                str(STEPS),
                *args,
                env=env,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL,
            )
        )
    return procs


async def _finish(procs: list[asyncio.subprocess.Process]) -> list[list[str]]:
    outs = await asyncio.wait_for(asyncio.gather(*(p.communicate() for p in procs)), 120)
    for p in procs:
        assert p.returncode == 0
    return [o[0].decode().splitlines() for o in outs]


def _losses(lines: list[str]) -> dict[int, str]:
    found = {}
    for line in lines:
        if line.startswith("step="):
            step, loss = line.split()
            found[int(step.split("=")[1])] = loss
    return found


async def test_ddp_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    uninterrupted = asyncio.create_task(_finish(await _gang(tmp_path / "plain")))
    gang = await _gang(ckpt, "--step-seconds", "0.1")
    assert gang[0].stdout is not None
    seen: list[str] = []
    await wait_for_line(gang[0].stdout, "step=5 ", 120, seen)
    gang[1].send_signal(signal.SIGTERM)  # the agent stops one member: both checkpoint
    codes = await asyncio.wait_for(asyncio.gather(*(p.wait() for p in gang)), 60)
    assert codes == [143, 143]
    rest = (await gang[0].stdout.read()).decode().splitlines()
    stopped = [line for line in seen + rest if line.startswith("stopped step=")]
    step = int(stopped[0].split("=")[1])
    assert 5 <= step < STEPS

    plain = await uninterrupted
    assert plain[0][-1].startswith("digest=")
    assert plain[0][-1] == plain[1][-1]  # every rank holds the same parameters
    resumed = await _finish(await _gang(ckpt, "--resume", "auto"))
    assert resumed[0][0] == f"resumed step={step} path={ckpt / f'ckpt-{step:08d}.pt'}"
    before, after, expected = _losses(seen + rest), _losses(resumed[0]), _losses(plain[0])
    assert min(after) == step + 1  # the loss curve continues where the checkpoint was
    assert {s: before[s] for s in range(1, step + 1)} == {
        s: expected[s] for s in range(1, step + 1)
    }
    assert after == {s: expected[s] for s in range(step + 1, STEPS + 1)}
    assert resumed[0][-1] == plain[0][-1]
