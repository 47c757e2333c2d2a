"""examples/trainer.py as real processes: the digest depends only on the steps completed."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import pytest

from examples import trainer
from tests.support.waiting import wait_for_line

TRAINER = str(Path(__file__).parents[2] / "examples" / "trainer.py")


async def _run(*args: str, env: dict[str, str] | None = None) -> tuple[int, list[str]]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        TRAINER,
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, out.decode().splitlines()


async def test_interrupted_and_resumed_gives_the_uninterrupted_digest(tmp_path: Path) -> None:
    code, plain = await _run("--steps", "40", "--step-seconds", "0.001", "--checkpoint-dir", "x")
    assert code == 0
    assert plain[-1] == f"digest={trainer.digest_after(40)}"

    ckpt = tmp_path / "ckpt"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        TRAINER,
        "--steps",
        "40",
        "--step-seconds",
        "0.05",
        "--checkpoint-dir",
        str(ckpt),
        "--checkpoint-every",
        "0.1",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert proc.stdout is not None
    seen: list[str] = []
    await wait_for_line(proc.stdout, "checkpoint step=", 20, seen)
    proc.send_signal(signal.SIGKILL)  # a dead node: no goodbye
    await proc.wait()
    newest = trainer.newest_checkpoint(ckpt)
    assert newest is not None
    loaded = trainer.read_checkpoint(newest)
    assert loaded is not None
    step = loaded[0]
    assert 0 < step < 40

    # MG_RESUME_FROM is the default of --resume, as the runner sets it
    code, resumed = await _run(
        "--steps", "40", "--step-seconds", "0.001", env={"MG_RESUME_FROM": str(newest)}
    )
    assert code == 0
    assert resumed[0] == f"resumed step={step} path={newest}"
    assert resumed[-1] == plain[-1]


async def test_resume_auto_takes_the_newest_valid_checkpoint(tmp_path: Path) -> None:
    trainer.write_checkpoint(tmp_path, 5, trainer.state_after(5))
    trainer.write_checkpoint(tmp_path, 9, trainer.state_after(9))
    (tmp_path / "ckpt-00000012.json").write_text('{"step": 12, "state": "00", "check": "x"}')
    code, out = await _run(
        "--steps",
        "15",
        "--step-seconds",
        "0",
        "--checkpoint-dir",
        str(tmp_path),
        "--resume",
        "auto",
    )
    assert code == 0
    assert out[0].startswith("resumed step=9 ")
    assert out[-1] == f"digest={trainer.digest_after(15)}"


async def test_sigterm_checkpoints_and_exits_143(tmp_path: Path) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        TRAINER,
        "--steps",
        "100000",
        "--step-seconds",
        "0.01",
        "--checkpoint-dir",
        str(tmp_path),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert proc.stdout is not None
    seen: list[str] = []
    await wait_for_line(proc.stdout, "start step=0", 10, seen)
    proc.send_signal(signal.SIGTERM)
    await wait_for_line(proc.stdout, "stopped step=", 10, seen)
    assert await proc.wait() == trainer.EXIT_STOPPED
    step = int(seen[-1].split("=")[1])
    assert trainer.read_checkpoint(tmp_path / f"ckpt-{step:08d}.json") == (
        step,
        trainer.state_after(step),
    )


async def test_crash_flag_exits_1_and_faults_only_fresh_lets_a_resume_pass(
    tmp_path: Path,
) -> None:
    flags = ("--crash-at-step", "6", "--checkpoint-dir", str(tmp_path), "--step-seconds", "0")
    code, out = await _run("--steps", "10", "--checkpoint-every", "0.0001", *flags)
    assert code == 1
    assert out[-1] == "crash step=6"
    # always crashes: a resume from its own checkpoint crashes again
    code, _ = await _run("--steps", "10", "--resume", "auto", *flags)
    assert code == 1
    code, out = await _run("--steps", "10", "--resume", "auto", "--faults-only-fresh", *flags)
    assert code == 0
    assert out[-1] == f"digest={trainer.digest_after(10)}"


@pytest.mark.parametrize("rank", ["0", "1"])
async def test_hang_flag_stops_advancing_on_its_rank_only(tmp_path: Path, rank: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        TRAINER,
        "--steps",
        "30",
        "--step-seconds",
        "0",
        "--hang-at-step",
        "4",
        "--fault-rank",
        "1",
        "--checkpoint-dir",
        str(tmp_path),
        env={"MG_RANK": rank},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert proc.stdout is not None
    seen: list[str] = []
    if rank == "1":
        await wait_for_line(proc.stdout, "hang step=4", 10, seen)
        assert proc.returncode is None
        proc.send_signal(signal.SIGTERM)
        assert await proc.wait() == trainer.EXIT_STOPPED
    else:
        await wait_for_line(proc.stdout, "digest=", 10, seen)
        assert await proc.wait() == 0
