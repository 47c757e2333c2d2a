"""The ``metalguard`` console script as a user runs it: demo, help, version, setup."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client

from metalguard import __version__
from metalguard.controller.state.streams import StreamSettings, bucket_configs
from metalguard.proto.base import NodeIdentity
from metalguard.proto.codec import decode, encode
from metalguard.proto.subjects import Subjects
from metalguard.proto.telemetry import TelemetryBatch

METALGUARD = Path(sys.executable).parent / "metalguard"
SMALL_FLEET = ("--racks", "1", "--nodes-per-rack", "2", "--http", "127.0.0.1:0")
"""The protocol test needs the server, not a 32-node fleet (tests/integration/
test_fleet_e2e.py covers the fleet)."""
URL_RE = re.compile(r"nats://[0-9A-Za-z.\-\[\]:]+:\d+")
START_DEADLINE_S = 30.0
"""The demo starts nats-server and creates the streams within this."""
STOP_DEADLINE_S = 20.0
CLI_DEADLINE_S = 30.0


# --- processes, read from /proc --------------------------------------------------------------


@dataclass(frozen=True)
class Proc:
    """A process as /proc/<pid>/stat shows it; (pid, start) names it uniquely."""

    pid: int
    comm: str
    state: str
    ppid: int
    start: int


def read_proc(pid: int) -> Proc | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # "pid (comm) state ppid ..." where comm may itself hold spaces and parentheses
    head, _, rest = stat.rpartition(")")
    fields = rest.split()
    return Proc(
        pid=pid,
        comm=head.partition("(")[2],
        state=fields[0],
        ppid=int(fields[1]),
        start=int(fields[19]),
    )


def children(ppid: int, comm: str) -> list[Proc]:
    found = []
    for entry in Path("/proc").iterdir():
        p = read_proc(int(entry.name)) if entry.name.isdigit() else None
        if p is not None and p.ppid == ppid and p.comm == comm:
            found.append(p)
    return found


def still_there(p: Proc) -> bool:
    """The very same process (not a reused pid) still exists, zombie or not."""
    now = read_proc(p.pid)
    return now is not None and now.start == p.start


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(METALGUARD), *args],
        capture_output=True,
        text=True,
        timeout=CLI_DEADLINE_S,
        check=False,
    )


# --- metalguard demo -------------------------------------------------------------------------


async def read_until_url(proc: asyncio.subprocess.Process, deadline: float, seen: list[str]) -> str:
    """Read the demo's stdout line by line until it prints the NATS URL."""
    assert proc.stdout is not None
    loop = asyncio.get_running_loop()
    while True:
        remaining = deadline - loop.time()
        if remaining <= 0:
            pytest.fail(f"no nats:// URL within {START_DEADLINE_S}s; stdout so far: {seen}")
        try:
            raw = await asyncio.wait_for(proc.stdout.readline(), remaining)
        except TimeoutError:
            continue  # reported by the deadline check above
        if not raw:
            pytest.fail(f"demo exited ({await proc.wait()}) before printing a URL: {seen}")
        line = raw.decode().rstrip()
        seen.append(line)
        if "nats://" in line:
            match = URL_RE.search(line)
            assert match, f"unparsable URL line {line!r}"
            return match.group()


async def talk_to_demo(url: str) -> None:
    """What a newcomer does with the demo's URL: core pub/sub and a JetStream publish."""
    client: Client = await asyncio.wait_for(nats.connect(url, max_reconnect_attempts=1), 10)
    try:
        sub = await client.subscribe("demo.hello")
        await client.publish("demo.hello", b"hi")
        assert (await sub.next_msg(timeout=5)).data == b"hi"

        s = Subjects()
        js = client.jetstream(timeout=5)
        batch = TelemetryBatch(
            node=NodeIdentity(region="eu", cluster="c1", node="n1"), seq=1, ts=1.0
        )
        ack = await js.publish(
            s.telemetry("eu", "c1", "n1"), encode(batch), headers={"Nats-Msg-Id": "n1-1"}
        )
        assert ack.stream == s.stream_telemetry
        assert ack.seq == 1
        stored = await js.get_msg(s.stream_telemetry, ack.seq)
        assert stored.data is not None
        assert decode(stored.data) == batch
        for name in (s.stream_events, s.stream_control, s.stream_dead_letter):
            assert (await js.stream_info(name)).config.name == name
        for kv in bucket_configs(s, StreamSettings()):
            await js.key_value(kv.bucket)  # raises if the demo did not create it
    finally:
        await client.close()


async def test_demo_prints_a_url_serves_it_and_stops_cleanly_on_sigint(tmp_path: Path) -> None:
    stderr_path = tmp_path / "demo.stderr"
    loop = asyncio.get_running_loop()
    servers: list[Proc] = []
    seen: list[str] = []
    with stderr_path.open("wb") as stderr:
        proc = await asyncio.create_subprocess_exec(
            str(METALGUARD),
            "demo",
            *SMALL_FLEET,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=stderr,
        )
    try:
        url = await read_until_url(proc, loop.time() + START_DEADLINE_S, seen)
        servers = children(proc.pid, "nats-server")
        assert len(servers) == 1, f"expected one nats-server child of the demo, got {servers}"
        await talk_to_demo(url)

        proc.send_signal(signal.SIGINT)
        try:
            code = await asyncio.wait_for(proc.wait(), STOP_DEADLINE_S)
        except TimeoutError:
            pytest.fail(f"demo still running {STOP_DEADLINE_S}s after SIGINT")
        assert proc.stdout is not None
        rest = (await proc.stdout.read()).decode()
        assert code == 0, f"exit {code}; stderr:\n{stderr_path.read_text()}"
        assert "stopped" in rest
        left = [p for p in servers if still_there(p)]
        assert not left, f"nats-server left behind by the demo: {left}"
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        for p in servers:  # the demo's child, started by this test: never leave it
            if still_there(p):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)


# --- help, version, setup ----------------------------------------------------------------------


def test_version() -> None:
    result = run_cli("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"metalguard {__version__}"


@pytest.mark.parametrize(
    "command",
    [
        [],
        ["agent"],
        ["agent", "run"],
        ["agent", "collect"],
        ["controller"],
        ["controller", "setup"],
        ["demo"],
    ],
    ids=lambda c: " ".join(["metalguard", *c]),
)
def test_help_on_every_level(command: list[str]) -> None:
    result = run_cli(*command, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: " + " ".join(["metalguard", *command]))
    assert "--help" in result.stdout


def test_no_subcommand_is_a_usage_error() -> None:
    result = run_cli()
    assert result.returncode == 2
    assert "usage: metalguard" in result.stderr


async def run_cli_async(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        str(METALGUARD),
        *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), CLI_DEADLINE_S)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_controller_setup_creates_the_streams(nats_url: str, nc: Client) -> None:
    s = Subjects(f"cli{uuid.uuid4().hex[:10]}")
    names = [s.stream_telemetry, s.stream_events, s.stream_control, s.stream_dead_letter]
    js = nc.jetstream(timeout=5)
    try:
        for _ in range(2):  # idempotent
            code, out, err = await run_cli_async(
                "controller", "setup", "--nats", nats_url, "--prefix", s.prefix
            )
            assert code == 0, err
            for name in names:
                assert name in out
        for name in names:
            assert (await js.stream_info(name)).config.name == name
    finally:
        for name in names:
            with contextlib.suppress(Exception):
                await js.delete_stream(name)
        for kv in bucket_configs(s, StreamSettings()):
            with contextlib.suppress(Exception):
                await js.delete_key_value(kv.bucket)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def test_controller_setup_reports_an_unreachable_server() -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    code, _out, err = await run_cli_async("controller", "setup", "--nats", url)
    assert code == 1
    assert f"cannot connect to {url}" in err


async def test_controller_setup_rejects_a_bad_prefix() -> None:
    code, _out, err = await run_cli_async("controller", "setup", "--prefix", "a.b")
    assert code == 2
    assert "'a.b'" in err
