"""docs/events.md's subscriber example (examples/subscriber.py), run as a user would run it
against a headless ``metalguard demo`` whose scenario isolates one node."""

from __future__ import annotations

import asyncio
import re
import signal
import sys
from pathlib import Path

from tests.support.waiting import wait_for_line

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "subscriber.py"
DOC = REPO / "docs" / "events.md"
METALGUARD = Path(sys.executable).parent / "metalguard"
FAULTY = "r1c1k1n2"
SCENARIO = f'[[fault]]\nat = 1\nnode = "{FAULTY}"\nkind = "ecc_ue"\n'
START_S = 40.0
RUN_S = 60.0


async def _run(*args: str, timeout_s: float) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(EXAMPLE),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    return proc.returncode or 0, out.decode()


async def test_the_example_receives_the_demo_s_events(tmp_path: Path) -> None:
    scenario = tmp_path / "s.toml"
    scenario.write_text(SCENARIO, encoding="utf-8")
    demo = await asyncio.create_subprocess_exec(
        str(METALGUARD), "--log-level", "warning", "demo", "--headless",
        "--duration", "60", "--racks", "1", "--nodes-per-rack", "2",
        "--scenario", str(scenario), "--http", "127.0.0.1:0",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    assert demo.stdout is not None
    seen: list[str] = []
    try:
        await wait_for_line(demo.stdout, "NATS at ", START_S, seen)
        url = re.search(r"nats://\S+", seen[-1])
        assert url is not None, seen[-1]
        server = url.group()
        # every decision (replayed from the stream first, then live), until the isolation
        isolated = "mg.ctl.r1.node.isolated"
        # the reader keeps the demo's pipe from filling while the example runs
        reader = asyncio.create_task(_drain(demo.stdout, seen))
        rc, out = await _run(
            "--server", server, "--subject", isolated, "--all", "--count", "1",
            "--timeout", "45", timeout_s=RUN_S,
        )  # fmt: skip
        assert rc == 0, out + "".join(seen)
        assert f"subscribed to {isolated}" in out
        line = out.splitlines()[-1]
        assert line.startswith(f"controller_event node.isolated {FAULTY}: "), line
        assert "uncorrectable" in line
        # nothing on a subject without events: exit 1 at the timeout
        rc, out = await _run(
            "--server", server, "--subject", "mg.ctl.nowhere.>", "--timeout", "1", timeout_s=RUN_S
        )
        assert rc == 1, out
    finally:
        if demo.returncode is None:
            demo.send_signal(signal.SIGINT)
            try:
                await asyncio.wait_for(demo.wait(), 20)
            except TimeoutError:
                demo.kill()
                await demo.wait()
    assert demo.returncode == 0, "".join(seen)
    await reader


async def _drain(stream: asyncio.StreamReader, seen: list[str]) -> None:
    while line := await stream.readline():
        seen.append(line.decode())


def test_the_doc_includes_the_example_verbatim() -> None:
    assert EXAMPLE.read_text(encoding="utf-8").strip() in DOC.read_text(encoding="utf-8")
