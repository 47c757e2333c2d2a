"""examples/trainer.py --sync as real processes: the ranks meet every step in a TCP
all-reduce, so a slow rank makes the others wait, a lost peer ends the job instead of
hanging it, and SIGTERM stops every rank at the same step; with the client library, the
steps' timings reach the agent's socket, evaluation and checkpoint steps marked."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from examples import trainer
from tests.support.waiting import wait_for_line, wait_until

TRAINER = str(Path(__file__).parents[2] / "examples" / "trainer.py")
FAST = ("--step-seconds", "0.01", "--no-client")
EXIT_S = 15.0
"""The most a rank may take to end once it should (the runs themselves take < 2 s)."""


def free_port() -> int:
    """A free loopback TCP port (rank 0 binds it again with SO_REUSEADDR)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env(rank: int, world: int, port: int, **extra: str) -> dict[str, str]:
    """The runner's environment for one rank (none of the caller's MG_* variables)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MG_")}
    env.update(
        MG_RANK=str(rank),
        MG_WORLD_SIZE=str(world),
        MG_MASTER_ADDR="127.0.0.1",
        MG_MASTER_PORT=str(port),
        **extra,
    )
    return env


async def start(env: dict[str, str], *args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        TRAINER,
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def start_ranks(
    world: int, *args: str, port: int | None = None, **extra: str
) -> list[asyncio.subprocess.Process]:
    port = free_port() if port is None else port
    return [await start(rank_env(r, world, port, **extra), *args) for r in range(world)]


async def finish(
    proc: asyncio.subprocess.Process, seen: list[str] | None = None
) -> tuple[int, list[str], str]:
    """Wait (at most EXIT_S) for ``proc`` to end: exit status, stdout lines (``seen``
    first), stderr."""
    try:
        out, err = await asyncio.wait_for(proc.communicate(), EXIT_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise AssertionError(f"still running after {EXIT_S}s: {seen}") from None
    lines = [line.rstrip("\n") for line in seen or []] + out.decode().splitlines()
    return proc.returncode or 0, lines, err.decode()


async def finish_all(
    procs: list[asyncio.subprocess.Process], seen: list[list[str]] | None = None
) -> list[tuple[int, list[str], str]]:
    seen = seen or [[] for _ in procs]
    return list(await asyncio.gather(*(finish(p, s) for p, s in zip(procs, seen, strict=True))))


async def until_synced(procs: list[asyncio.subprocess.Process]) -> list[list[str]]:
    """Wait until every rank has met the others (its ``sync`` line); the lines read."""
    seen: list[list[str]] = [[] for _ in procs]
    for proc, lines in zip(procs, seen, strict=True):
        assert proc.stdout is not None
        await wait_for_line(proc.stdout, "sync rank=", 10, lines)
    return seen


def value(lines: list[str], key: str) -> str:
    found = [line.split("=", 1)[1] for line in lines if line.startswith(f"{key}=")]
    assert len(found) == 1, (key, lines)
    return found[0]


def checkpoint_steps(lines: list[str]) -> list[int]:
    return [int(line.split()[1].split("=")[1]) for line in lines if line.startswith("checkpoint ")]


async def test_ranks_in_lockstep_keep_the_digest_through_every_hard_negative(
    tmp_path: Path,
) -> None:
    """Pipeline stages, a heavy stage, evaluation steps, jitter, a whole-job slowdown and
    periodic checkpoints change the timing only; the periodic checkpoints are decided
    together, so every rank writes them at the same steps."""
    flags = (
        *("--pipeline-stages", "3", "--heavy-stage", "2", "--heavy-factor", "1.5"),
        *("--eval-every", "7", "--jitter", "0.2"),
        *("--job-slowdown", "1.3", "--job-slowdown-after-step", "10"),
        *("--checkpoint-every", "0.05"),
    )
    procs = [
        await start(
            rank_env(r, 3, port),
            *("--sync", "--steps", "30", *FAST, *flags),
            *("--checkpoint-dir", str(tmp_path / f"rank{r}")),
        )
        for port in [free_port()]
        for r in range(3)
    ]
    results = await finish_all(procs)
    for rank, (code, out, err) in enumerate(results):
        assert code == 0, err
        assert f"sync rank={rank} world=3" in out
        assert out[-1] == f"digest={trainer.digest_after(30)}"
    steps = [checkpoint_steps(out) for _, out, _ in results]
    assert steps[0], "no periodic checkpoint in 30 steps of >= 10 ms, every 50 ms"
    assert steps[1] == steps[0]
    assert steps[2] == steps[0]
    for rank in range(3):
        for step in steps[0]:
            path = tmp_path / f"rank{rank}" / f"ckpt-{step:08d}.json"
            assert trainer.read_checkpoint(path) == (step, trainer.state_after(step))


async def test_a_world_of_one_syncs_with_nobody(tmp_path: Path) -> None:
    (proc,) = await start_ranks(
        1, "--sync", "--steps", "10", *FAST, "--checkpoint-dir", str(tmp_path)
    )
    code, out, err = await finish(proc)
    assert code == 0, err
    assert out[-1] == f"digest={trainer.digest_after(10)}"
    assert float(value(out, "waited_s")) >= 0


async def test_a_slow_rank_makes_the_others_wait(tmp_path: Path) -> None:
    """Rank 1 computes 4x as long: it arrives last at every all-reduce, so it waits least
    (no timed assert: only the order of the waits)."""
    procs = await start_ranks(
        3,
        *("--sync", "--steps", "25", "--step-seconds", "0.02", "--no-client"),
        *("--slow-rank", "1", "--slow-factor", "4", "--slow-after-step", "2"),
        *("--checkpoint-dir", str(tmp_path)),
    )
    results = await finish_all(procs)
    for code, out, err in results:
        assert code == 0, err
        assert out[-1] == f"digest={trainer.digest_after(25)}"
    waited = [float(value(out, "waited_s")) for _, out, _ in results]
    assert waited[1] < waited[0], waited
    assert waited[1] < waited[2], waited


async def test_every_rank_resumes_from_the_checkpoint(tmp_path: Path) -> None:
    ckpt = trainer.write_checkpoint(tmp_path, 7, trainer.state_after(7))
    procs = await start_ranks(
        3, "--sync", "--steps", "20", *FAST, MG_RESUME_FROM=str(ckpt), MG_CHECKPOINT_DIR="x"
    )
    for code, out, err in await finish_all(procs):
        assert code == 0, err
        assert out[0] == f"resumed step=7 path={ckpt}"
        assert out[-1] == f"digest={trainer.digest_after(20)}"


async def test_ranks_resumed_from_different_steps_refuse_to_meet(tmp_path: Path) -> None:
    port = free_port()
    first = trainer.write_checkpoint(tmp_path / "a", 7, trainer.state_after(7))
    second = trainer.write_checkpoint(tmp_path / "b", 9, trainer.state_after(9))
    args = ("--sync", "--steps", "20", *FAST, "--checkpoint-dir", str(tmp_path))
    procs = [
        await start(rank_env(0, 2, port, MG_RESUME_FROM=str(first)), *args),
        await start(rank_env(1, 2, port, MG_RESUME_FROM=str(second)), *args),
    ]
    (code0, _, err0), (code1, _, err1) = await finish_all(procs)
    assert code0 == trainer.EXIT_RENDEZVOUS
    assert "rank 1 starts from step 9, rank 0 from step 7" in err0
    assert code1 == trainer.EXIT_RENDEZVOUS, err1


async def test_rank_0_unreachable_ends_in_exit_3(tmp_path: Path) -> None:
    (proc,) = [
        await start(
            rank_env(1, 2, free_port()),
            *("--sync", "--steps", "5", *FAST, "--sync-connect-timeout", "0.3"),
            *("--checkpoint-dir", str(tmp_path)),
        )
    ]
    code, out, err = await finish(proc)
    assert code == trainer.EXIT_RENDEZVOUS
    assert "cannot reach rank 0 at 127.0.0.1:" in err
    assert not any(line.startswith("digest=") for line in out)


@pytest.mark.parametrize("victim", [0, 1])
async def test_a_killed_peer_ends_the_others_instead_of_hanging(
    tmp_path: Path, victim: int
) -> None:
    procs = await start_ranks(
        3,
        *("--sync", "--steps", "1000000", *FAST, "--sync-timeout", "30"),
        *("--checkpoint-dir", str(tmp_path)),
    )
    seen = await until_synced(procs)
    procs[victim].send_signal(signal.SIGKILL)  # a dead node: no goodbye
    results = await finish_all(procs, seen)  # well within --sync-timeout: the EOF tells
    assert results[victim][0] == -signal.SIGKILL
    for rank, (code, out, err) in enumerate(results):
        if rank != victim:
            assert code == trainer.EXIT_PEER_LOST, (rank, out, err)
            assert f"sync: rank {rank} at step " in err
            assert "disconnected" in err or "is gone" in err, err


async def test_a_frozen_peer_times_out_the_step(tmp_path: Path) -> None:
    procs = await start_ranks(
        3,
        *("--sync", "--steps", "1000000", *FAST, "--sync-timeout", "1"),
        *("--checkpoint-dir", str(tmp_path)),
    )
    seen = await until_synced(procs)
    procs[1].send_signal(signal.SIGSTOP)  # alive, silent: no EOF
    try:
        (code0, _, err0), (code2, _, err2) = await finish_all([procs[0], procs[2]], seen[::2])
    finally:
        procs[1].send_signal(signal.SIGKILL)
        await procs[1].wait()
    assert code0 == trainer.EXIT_PEER_LOST
    assert "no word from rank(s) [1] within 1s" in err0
    assert code2 == trainer.EXIT_PEER_LOST, err2


@pytest.mark.parametrize("signalled", [(0, 1, 2), (2,)], ids=["every-rank", "one-rank"])
async def test_sigterm_stops_every_rank_at_the_same_step_with_a_checkpoint(
    tmp_path: Path, signalled: tuple[int, ...]
) -> None:
    """The agent stops every member; SIGTERM on one rank alone stops them all as well (the
    stop is all-reduced), each with a checkpoint of the same step."""
    procs = [
        await start(
            rank_env(r, 3, port),
            *("--sync", "--steps", "1000000", *FAST),
            *("--checkpoint-dir", str(tmp_path / f"rank{r}")),
        )
        for port in [free_port()]
        for r in range(3)
    ]
    seen = await until_synced(procs)
    for rank in signalled:
        with contextlib.suppress(ProcessLookupError):
            procs[rank].send_signal(signal.SIGTERM)
    results = await finish_all(procs, seen)
    stopped = set()
    for rank, (code, out, err) in enumerate(results):
        assert code == trainer.EXIT_STOPPED, (rank, out, err)
        step = int(value(out, "stopped step"))
        assert step >= 1
        assert trainer.read_checkpoint(tmp_path / f"rank{rank}" / f"ckpt-{step:08d}.json") == (
            step,
            trainer.state_after(step),
        )
        stopped.add(step)
    assert len(stopped) == 1, stopped


async def test_the_client_library_reports_timings_with_marked_steps(tmp_path: Path) -> None:
    """Two pipeline stages in lockstep, an evaluation step in 4 and periodic checkpoints:
    each rank sends ``timing`` windows (0.2 s) with its role and marked steps counted."""
    path = tmp_path / "wl.sock"
    received: dict[int, list[dict[str, object]]] = {}
    ended: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        messages: list[dict[str, object]] = []
        received[len(received)] = messages
        while line := await reader.readline():
            messages.append(json.loads(line))
        ended.append(len(messages))
        writer.close()

    server = await asyncio.start_unix_server(serve, path=str(path))
    try:
        procs = await start_ranks(
            2,
            *("--sync", "--steps", "60", "--step-seconds", "0.01"),
            *("--pipeline-stages", "2", "--eval-every", "4", "--checkpoint-every", "0.1"),
            *("--checkpoint-dir", str(tmp_path / "ckpt")),
            MG_WORKLOAD_SOCKET=str(path),
            MG_TIMING_WINDOW_S="0.2",
        )
        for code, out, err in await finish_all(procs):
            assert code == 0, err
            assert out[-1] == f"digest={trainer.digest_after(60)}"
        await wait_until(lambda: len(ended) == 2, 5, "both ranks' connections to close")
    finally:
        server.close()
        await server.wait_closed()

    by_rank = {
        int(str(msgs[0]["rank"])): msgs
        for msgs in received.values()
        if msgs and msgs[0].get("op") == "hello"
    }
    assert sorted(by_rank) == [0, 1]
    for rank, msgs in by_rank.items():
        timings = [m for m in msgs if m["op"] == "timing"]
        assert timings, msgs
        assert all(m["role"] == [rank] for m in timings)
        assert any(int(str(m["marked"])) > 0 for m in timings), timings
        assert any(int(str(m["steps"])) > 0 for m in timings), timings
        assert any(m["op"] == "checkpoint_done" for m in msgs)


# --- the compute factors, without processes -------------------------------------------
def factors(**flags: object) -> Namespace:
    args = trainer.parse_args(["--steps", "1"])
    for key, val in flags.items():
        setattr(args, key, val)
    return args


def test_jitter_is_the_same_for_every_rank_and_bounded() -> None:
    draws = [trainer.jitter_factor(step, 0.1) for step in range(500)]
    assert draws == [trainer.jitter_factor(step, 0.1) for step in range(500)]
    assert all(0.9 <= d <= 1.1 for d in draws)
    assert max(draws) - min(draws) > 0.15  # it does vary
    args = factors(jitter=0.1)
    assert {trainer.compute_factor(args, rank, 17) for rank in range(4)} == {
        trainer.jitter_factor(17, 0.1)
    }


def test_compute_factors_by_design_and_injected() -> None:
    plain = factors()
    assert trainer.compute_factor(plain, 1, 5) == 1.0
    slow = factors(slow_rank=1, slow_factor=1.1, slow_after_step=3)
    assert [trainer.compute_factor(slow, 1, s) for s in (2, 3)] == [1.0, 1.1]
    assert trainer.compute_factor(slow, 0, 3) == 1.0
    assert trainer.compute_factor(slow, 1, 3, slow=False) == 1.0  # --faults-only-fresh
    heavy = factors(pipeline_stages=2, heavy_stage=1, heavy_factor=1.3)
    assert [trainer.compute_factor(heavy, r, 0) for r in range(4)] == [1.0, 1.3, 1.0, 1.3]
    evals = factors(eval_every=4)
    assert [s for s in range(12) if trainer.compute_factor(evals, 0, s) == 3.0] == [3, 7, 11]
    job = factors(job_slowdown=1.2, job_slowdown_after_step=5)
    assert [trainer.compute_factor(job, r, s) for r, s in ((0, 4), (0, 5), (3, 9))] == [
        1.0,
        1.2,
        1.2,
    ]


@pytest.mark.parametrize(
    "argv",
    [
        ["--pipeline-stages", "0"],
        ["--heavy-stage", "1"],
        ["--jitter", "1"],
        ["--slow-factor", "0"],
        ["--eval-every", "-1"],
    ],
)
def test_bad_flags_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        trainer.parse_args(["--steps", "1", *argv])
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err
