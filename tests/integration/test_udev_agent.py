"""The real agent publishes kernel uevents of a veth pair as NodeEvents within 2 s."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from metalguard.proto.codec import decode
from metalguard.proto.events import NodeEvent
from metalguard.proto.subjects import Subjects
from tests.support.harness.agent_proc import AgentProcess, NotifySocket, write_agent_config

DEADLINE_S = 2.0


def _libudev_missing() -> bool:
    try:
        import pyudev

        pyudev.Context()
    except (ImportError, OSError):
        return True
    return False


pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="creating a veth pair needs root"),
    pytest.mark.skipif(shutil.which("ip") is None, reason="needs iproute2's ip"),
    pytest.mark.skipif(_libudev_missing(), reason="pyudev cannot load libudev.so.1 (libudev1)"),
]


def _ip(*args: str, check: bool = True) -> None:
    subprocess.run(["ip", *args], check=check, capture_output=True, timeout=10)


async def _collect(
    events: asyncio.Queue[NodeEvent], kind: str, devices: set[str], started: float
) -> dict[str, float]:
    """Seconds from ``started`` until each of ``devices`` had a ``kind`` event."""
    seen: dict[str, float] = {}
    end = started + DEADLINE_S
    while set(seen) != devices:
        left = end - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no {kind} for {devices - set(seen)} within {DEADLINE_S}s")
        try:
            event = await asyncio.wait_for(events.get(), left)
        except TimeoutError:
            continue
        if event.kind == kind and event.source == "udev" and event.device in devices:
            seen.setdefault(event.device, time.monotonic() - started)
    return seen


async def test_veth_add_and_remove_reach_nats_within_2s(
    tmp_path: Path, nats_url: str, nc: Client, subjects: Subjects
) -> None:
    config = write_agent_config(
        tmp_path / "agent.toml",
        nats_url=nats_url,
        spool_dir=tmp_path / "spool",
        node="udev1",
    )
    text = config.read_text().replace("[nats]\n", f'[nats]\nprefix = "{subjects.prefix}"\n', 1)
    config.write_text(text + '\n[events]\nudev = true\nudev_subsystems = ["net"]\n')
    events: asyncio.Queue[NodeEvent] = asyncio.Queue()

    async def on_event(msg: Msg) -> None:
        events.put_nowait(decode(msg.data, NodeEvent))

    sub = await nc.subscribe(subjects.all_of("evt"), cb=on_event)
    await nc.flush()
    notify = NotifySocket(tmp_path / "notify.sock")
    agent = AgentProcess(config, env={"NOTIFY_SOCKET": notify.path})
    suffix = uuid.uuid4().hex[:6]
    a, b = f"mgu{suffix}a", f"mgu{suffix}b"
    try:
        # READY=1 comes after the uevent socket is open: nothing later is missed
        await asyncio.to_thread(notify.wait_for, "READY=1", 20)
        started = time.monotonic()
        await asyncio.to_thread(_ip, "link", "add", a, "type", "veth", "peer", "name", b)
        added = await _collect(events, "device_added", {a, b}, started)
        started = time.monotonic()
        await asyncio.to_thread(_ip, "link", "del", a)
        removed = await _collect(events, "device_removed", {a, b}, started)
        print(f"veth add -> event: {max(added.values()):.3f}s; del -> event: "
              f"{max(removed.values()):.3f}s")  # fmt: skip
        assert agent.terminate(20) == 0
    finally:
        await asyncio.to_thread(_ip, "link", "del", a, check=False)
        await sub.unsubscribe()
        agent.close()
        notify.close()
