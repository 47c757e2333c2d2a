"""The agent as a real process: systemd protocol, publishing, outages, restarts."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest
from nats.js.api import ConsumerConfig, DeliverPolicy

from metalguard.agent.spool import Spool
from metalguard.controller.broker.server import NatsServer
from metalguard.controller.state.streams import ensure_streams
from metalguard.proto.codec import decode
from metalguard.proto.subjects import DEFAULT_SUBJECTS, TelemetrySubject
from metalguard.proto.telemetry import TelemetryBatch
from tests.support.harness.agent_proc import AgentProcess, NotifySocket, write_agent_config
from tests.support.waiting import wait_for_value, wait_until

SUBJECTS = DEFAULT_SUBJECTS


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[NotifySocket]:
    sock = NotifySocket(tmp_path / "notify.sock")
    yield sock
    sock.close()


async def _setup_streams(url: str) -> None:
    nc = await nats.connect(url)
    try:
        await ensure_streams(nc.jetstream())
    finally:
        await nc.close()


async def _read_batches(url: str, node: str) -> list[TelemetryBatch]:
    """Every batch of ``node`` currently in the stream, in stream order."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        subject = SUBJECTS.telemetry("r1", "c1", node)
        info = await js.stream_info(SUBJECTS.stream_telemetry)
        sub = await js.subscribe(
            subject, ordered_consumer=True, config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
        )
        batches: list[TelemetryBatch] = []
        try:
            while True:
                try:
                    msg = await sub.next_msg(timeout=1.0)
                except nats.errors.TimeoutError:
                    break
                batches.append(decode(msg.data, TelemetryBatch))
                if msg.metadata.sequence.stream >= info.state.last_seq:
                    break
        finally:
            await sub.unsubscribe()
        return batches
    finally:
        await nc.close()


def _spooled_seqs(spool_dir: Path) -> list[int]:
    """Seqs of the telemetry batches in an agent's spool (the agent must be stopped)."""
    spool = Spool(spool_dir, max_bytes=1 << 30)
    try:
        return [
            int(s.entry.msg_id.rsplit(":", 1)[1])
            for s in spool.peek(len(spool))
            if isinstance(SUBJECTS.parse(s.entry.subject), TelemetrySubject)
        ]
    finally:
        spool.close()


async def _wait_for_seq(
    url: str, node: str, at_least: int, deadline_s: float
) -> list[TelemetryBatch]:
    return await wait_for_value(
        lambda: _read_batches(url, node),
        lambda batches: bool(batches) and max(b.seq for b in batches) >= at_least,
        deadline_s,
        f"seq {at_least} of {node} in the stream",
    )


def test_sd_notify_ready_watchdog_status_and_clean_stop(
    tmp_path: Path, nats_url: str, notify_socket: NotifySocket
) -> None:
    config = write_agent_config(
        tmp_path / "agent.toml", nats_url=nats_url, spool_dir=tmp_path / "spool"
    )
    agent = AgentProcess(
        config, env={"NOTIFY_SOCKET": notify_socket.path, "WATCHDOG_USEC": "1000000"}
    )
    try:
        notify_socket.wait_for("READY=1", 20)
        ready_at = len(notify_socket.received)
        notify_socket.wait_for("STATUS=", 5)
        # WatchdogSec=1s: a ping must come within the interval after READY
        start = time.monotonic()
        while True:
            msg = notify_socket.wait_for("WATCHDOG=1", 1.0)
            if notify_socket.received.index(msg) >= ready_at - 1:
                break
            notify_socket.received.remove(msg)
        assert time.monotonic() - start <= 1.0
        assert agent.terminate(20) == 0
        notify_socket.wait_for("STOPPING=1", 5)
    finally:
        agent.close()


def test_bad_config_exits_2_naming_file_and_key(tmp_path: Path) -> None:
    config = tmp_path / "agent.toml"
    config.write_text("[collect]\ninterval_s = 'often'\n")
    agent = AgentProcess(config)
    try:
        assert agent.proc.wait(20) == 2
        err = agent.stderr()
        assert str(config) in err
        assert "collect.interval_s" in err
    finally:
        agent.close()


async def test_agent_publishes_fixture_batches(tmp_path: Path, nats_url: str) -> None:
    await _setup_streams(nats_url)
    config = write_agent_config(
        tmp_path / "agent.toml",
        nats_url=nats_url,
        spool_dir=tmp_path / "spool",
        node="pub1",
    )
    agent = AgentProcess(config)
    try:
        batches = await _wait_for_seq(nats_url, "pub1", 3, 30)
        assert agent.terminate(20) == 0
    finally:
        agent.close()
    seqs = [b.seq for b in batches]
    assert seqs == sorted(set(seqs))
    last = batches[-1]
    assert last.node.uuid == "test-uuid-pub1"
    assert last.edac
    assert last.edac[0].ue_count == 5
    nvme = next(d for d in last.pcie if d.address == "0000:01:00.0")
    assert nvme.downgraded
    assert {r.collector for b in batches for r in b.collectors} >= {"edac", "pcie", "hwmon"}


async def test_sighup_reload_keeps_running_and_rejects_bad_config(
    tmp_path: Path, nats_url: str, notify_socket: NotifySocket
) -> None:
    await _setup_streams(nats_url)
    path = tmp_path / "agent.toml"
    write_agent_config(path, nats_url=nats_url, spool_dir=tmp_path / "spool", node="hup1")
    agent = AgentProcess(path, env={"NOTIFY_SOCKET": notify_socket.path})
    try:
        notify_socket.wait_for("READY=1", 20)
        path.write_text(path.read_text() + "\n[bogus]\n")
        agent.proc.send_signal(1)  # SIGHUP
        rejected = notify_socket.wait_for("STATUS=config reload rejected", 10)
        assert "bogus" in rejected
        before = max(b.seq for b in await _wait_for_seq(nats_url, "hup1", 1, 20))
        await _wait_for_seq(nats_url, "hup1", before + 2, 20)
        assert agent.terminate(20) == 0
    finally:
        agent.close()


@pytest.mark.slow
async def test_outage_with_agent_killed_loses_nothing(
    tmp_path: Path, fresh_server: NatsServer
) -> None:
    """Server down; the agent spools, is killed -9, restarts; server back: every seq once."""
    url = fresh_server.url
    await _setup_streams(url)
    config = write_agent_config(
        tmp_path / "agent.toml", nats_url=url, spool_dir=tmp_path / "spool", node="kill1"
    )
    agent = AgentProcess(config)
    try:
        before = await _wait_for_seq(url, "kill1", 3, 30)
        await asyncio.to_thread(fresh_server.stop)
        spool = tmp_path / "spool" / "queue"
        seq_file = tmp_path / "spool" / "seq"
        down_at = int(seq_file.read_text())
        await wait_until(
            lambda: int(seq_file.read_text()) >= down_at + 12, 30, "the agent to spool 12 batches"
        )
        agent.kill()
        agent.close()
        spooled = _spooled_seqs(spool)
        assert len(spooled) >= 10
        agent = AgentProcess(config)
        killed_at = int(seq_file.read_text())
        await wait_until(
            lambda: int(seq_file.read_text()) >= killed_at + 5, 30, "the restarted agent to spool"
        )
        await asyncio.to_thread(fresh_server.start)
        last = int(seq_file.read_text())
        after = await _wait_for_seq(url, "kill1", last, 60)
        assert agent.terminate(20) == 0
    finally:
        agent.close()
    seqs = [b.seq for b in after]
    assert len(seqs) == len(set(seqs)), "a batch was stored twice"
    assert seqs == sorted(seqs), "batches out of order"
    assert seqs[: len(before)] == [b.seq for b in before]
    assert set(spooled) <= set(seqs), f"spooled batches lost: {sorted(set(spooled) - set(seqs))}"
    # Only a batch in flight at the very moment of SIGKILL (between reserving its seq and
    # reaching the spool) may be missing; everything else arrived, once and in order.
    missing = set(range(seqs[0], seqs[-1] + 1)) - set(seqs)
    assert len(missing) <= 1, f"gaps: {sorted(missing)}"
    assert missing <= {max(spooled) + 1}, f"gaps: {sorted(missing)}"
