"""The checkpoint client library (metalguard.agent.workload.client) against the agent's
real socket end (its Channel on a unix socket in a temp dir)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from metalguard.agent.workload import client
from metalguard.agent.workload.channel import Channel, ChannelPeer
from tests.support.waiting import wait_until


async def test_client_library_speaks_to_the_agent_socket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    got: list[dict[str, object]] = []
    peers: list[ChannelPeer] = []

    async def on_message(peer: ChannelPeer, msg: dict[str, object]) -> None:
        peers.append(peer)
        got.append(msg)

    channel = Channel(str(tmp_path / "wl.sock"), on_message, lambda _peer: None)
    await channel.start()
    monkeypatch.setenv("MG_JOB_ID", "j1")
    try:
        wl = client.connect(channel.path, handle_sigusr1=False)
        assert wl.connected
        wl.report_progress(7)
        await wait_until(lambda: len(got) == 2, 5, "hello and progress")
        assert got[0]["op"] == "hello"
        assert got[0]["job_id"] == "j1"
        assert got[1] == {"op": "progress", "step": 7}
        assert not wl.checkpoint_requested()
        await peers[0].send({"op": "checkpoint", "request_id": "r1"})
        await wait_until(wl.checkpoint_requested, 5, "the request to reach the client")
        wl.checkpoint_done(8, "/c/ckpt-00000008.json")
        await wait_until(lambda: len(got) == 3, 5, "the answer")
        assert got[2] == {
            "op": "checkpoint_done",
            "step": 8,
            "path": "/c/ckpt-00000008.json",
            "request_id": "r1",
        }
        assert not wl.checkpoint_requested()
        wl.close()
    finally:
        await channel.close()
    assert not await asyncio.to_thread(os.path.exists, channel.path)
