"""examples/trainer.py resized (docs/jobs.md "Elastic jobs"): N ranks in lockstep stop with
a fresh checkpoint in their shared directory, M != N ranks resume from it with the new
``MG_WORLD_SIZE`` (the runner's environment), and every rank prints the digest of an
uninterrupted run."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
from pathlib import Path

import pytest

from examples import trainer
from tests.support.waiting import wait_for_line

TRAINER = str(Path(__file__).parents[2] / "examples" / "trainer.py")
FAST = ("--step-seconds", "0.01", "--no-client")
EXIT_S = 15.0
"""The most a rank may take to end once it should (the runs themselves take < 2 s)."""
Proc = asyncio.subprocess.Process


def free_port() -> int:
    """A free loopback TCP port (rank 0 binds it again with SO_REUSEADDR)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def start_ranks(world: int, *args: str, **extra: str) -> list[Proc]:
    """``world`` ranks with the runner's environment (MG_RANK, MG_WORLD_SIZE, the master
    address and port, ``extra``; none of the caller's MG_* variables)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("MG_")}
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = {**base, "MG_RANK": str(rank), "MG_WORLD_SIZE": str(world)}
        env.update(MG_MASTER_ADDR="127.0.0.1", MG_MASTER_PORT=port, **extra)
        pipe = asyncio.subprocess.PIPE
        procs.append(
            await asyncio.create_subprocess_exec(
                sys.executable, TRAINER, *args, env=env, stdout=pipe, stderr=pipe
            )
        )
    return procs


async def finish_all(procs: list[Proc], seen: list[list[str]]) -> list[tuple[int, list[str], str]]:
    """Wait (at most EXIT_S) for every rank to end: exit status, stdout lines (``seen``
    first), stderr."""

    async def finish(proc: Proc, lines: list[str]) -> tuple[int, list[str], str]:
        try:
            out, err = await asyncio.wait_for(proc.communicate(), EXIT_S)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise AssertionError(f"still running after {EXIT_S}s: {lines}") from None
        text = [line.rstrip("\n") for line in lines] + out.decode().splitlines()
        return proc.returncode or 0, text, err.decode()

    return list(await asyncio.gather(*(finish(p, s) for p, s in zip(procs, seen, strict=True))))


def value(lines: list[str], key: str) -> str:
    found = [line.split("=", 1)[1] for line in lines if line.startswith(f"{key}=")]
    assert len(found) == 1, (key, lines)
    return found[0]


MORE_STEPS = 25
"""Steps the resized run takes past the checkpoint."""


async def stop_with_checkpoint(world: int, shared: Path) -> Path:
    """``world`` ranks in lockstep, stopped (SIGTERM, as the agent's stop) after their
    first periodic checkpoint: the stop's checkpoint in ``shared``, the same for all."""
    args = ("--sync", "--steps", "1000000", *FAST, "--checkpoint-every", "0.05")
    procs = await start_ranks(world, *args, "--checkpoint-dir", str(shared))
    seen: list[list[str]] = [[] for _ in procs]
    for proc, lines in zip(procs, seen, strict=True):
        assert proc.stdout is not None
        await wait_for_line(proc.stdout, "sync rank=", 10, lines)
    assert procs[0].stdout is not None
    await wait_for_line(procs[0].stdout, "checkpoint step=", 15, seen[0])
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
    steps = set()
    for rank, (code, out, err) in enumerate(await finish_all(procs, seen)):
        assert code == trainer.EXIT_STOPPED, (rank, out, err)
        steps.add(int(value(out, "stopped step")))
    (step,) = steps
    path = shared / f"ckpt-{step:08d}.json"
    assert trainer.read_checkpoint(path) == (step, trainer.state_after(step))
    assert trainer.checkpoint_world_size(path) == world
    return path


@pytest.mark.parametrize(("before", "after"), [(3, 2), (2, 4), (2, 1)])
async def test_a_resized_run_prints_the_uninterrupted_digest(
    tmp_path: Path, before: int, after: int
) -> None:
    shared = tmp_path / "shared"
    ckpt = await stop_with_checkpoint(before, shared)
    loaded = trainer.read_checkpoint(ckpt)
    assert loaded is not None
    total = loaded[0] + MORE_STEPS
    procs = await start_ranks(
        after,
        *("--sync", "--steps", str(total), *FAST),
        MG_RESUME_FROM=str(ckpt),
        MG_CHECKPOINT_DIR=str(shared),
    )
    for rank, (code, out, err) in enumerate(await finish_all(procs, [[] for _ in procs])):
        assert code == 0, (rank, out, err)
        assert out[0] == f"resumed step={loaded[0]} path={ckpt}"
        assert out[1] == f"resized world_size={before}->{after}"
        if after > 1:
            assert f"sync rank={rank} world={after}" in out
        assert out[-1] == f"digest={trainer.digest_after(total)}"


async def test_a_checkpoint_of_the_same_size_or_an_older_one_says_no_resize(
    tmp_path: Path,
) -> None:
    """A resume at the size that wrote it, or from a checkpoint that records none (an
    older trainer's), prints no ``resized`` line and the same digest."""
    same = trainer.write_checkpoint(tmp_path / "same", 9, trainer.state_after(9), 2)
    older = trainer.write_checkpoint(tmp_path / "older", 9, trainer.state_after(9))
    body = older.read_text().replace(', "world_size": 1', "")
    older.write_text(body)
    assert trainer.checkpoint_world_size(older) is None
    for ckpt in (same, older):
        procs = await start_ranks(2, "--sync", *FAST, "--steps", "20", MG_RESUME_FROM=str(ckpt))
        for code, out, err in await finish_all(procs, [[], []]):
            assert code == 0, err
            assert out[0] == f"resumed step=9 path={ckpt}"
            assert not any(line.startswith("resized") for line in out), out
            assert out[-1] == f"digest={trainer.digest_after(20)}"
