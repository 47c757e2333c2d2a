"""Full-jitter backoff, the guarded task, and the connector's retry schedule (no server)."""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any
from urllib.parse import urlparse

import pytest
from nats.aio.client import Client, Server

from metalguard.agent.backoff import Backoff, guarded_task
from metalguard.agent.connection import Connection, NatsSettings


class SleepRecorder:
    """An injected sleep that records the delays and returns at once."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)
        await asyncio.sleep(0)


def expected_delays(seed: int, base: float, cap: float, n: int) -> list[float]:
    rng = random.Random(seed)
    return [rng.uniform(0, min(cap, base * 2**i)) for i in range(n)]


def test_full_jitter_delays_are_reproducible_and_capped() -> None:
    backoff = Backoff(base_s=0.5, cap_s=4.0, rng=random.Random(7))
    delays = [backoff.delay(i) for i in range(8)]
    assert delays == expected_delays(7, 0.5, 4.0, 8)
    assert [backoff.ceiling(i) for i in range(5)] == [0.5, 1.0, 2.0, 4.0, 4.0]
    assert all(0 <= d <= backoff.ceiling(i) for i, d in enumerate(delays))
    assert backoff.ceiling(10_000) == 4.0  # no overflow


def test_backoff_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="base_s"):
        Backoff(base_s=0, cap_s=1)
    with pytest.raises(ValueError, match="base_s"):
        Backoff(base_s=2, cap_s=1)


async def test_guarded_task_logs_a_crash_and_restarts(caplog: pytest.LogCaptureFixture) -> None:
    runs = 0

    async def body() -> None:
        nonlocal runs
        runs += 1
        if runs < 3:
            raise RuntimeError(f"boom {runs}")

    sleep = SleepRecorder()
    with caplog.at_level(logging.ERROR, logger="metalguard.agent.backoff"):
        task = guarded_task("t", body, backoff=Backoff(1, 8, random.Random(1)), sleep=sleep)
        await asyncio.wait_for(task, 5)
    assert runs == 3
    assert sleep.delays == expected_delays(1, 1, 8, 2)
    assert caplog.text.count("task t crashed") == 2


class FakeClient(Client):
    """connect() fails ``failures`` times (shared counter), then succeeds; or hangs."""

    plan: list[str] = []
    made: list[FakeClient] = []

    def __init__(self) -> None:
        super().__init__()
        self.closed = False
        self.ok = False
        FakeClient.made.append(self)

    async def connect(self, **options: Any) -> None:  # type: ignore[override]
        assert options["max_reconnect_attempts"] == -1
        assert options["pending_size"] == 0
        assert callable(options["reconnect_to_server_handler"])
        step = FakeClient.plan.pop(0)
        if step == "hang":
            await asyncio.Event().wait()
        if step == "refuse":
            raise ConnectionRefusedError(111, "Connection refused")
        self.ok = True

    @property
    def is_connected(self) -> bool:
        return self.ok and not self.closed

    async def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake_client() -> type[FakeClient]:
    FakeClient.plan = []
    FakeClient.made = []
    return FakeClient


async def test_first_connect_retries_with_full_jitter(fake_client: type[FakeClient]) -> None:
    fake_client.plan = ["refuse"] * 4 + ["ok"]
    sleep = SleepRecorder()
    states: list[bool] = []
    conn = Connection(
        NatsSettings(servers=("nats://127.0.0.1:1",), first_connect_timeout_s=1),
        backoff=Backoff(0.5, 4.0, random.Random(42)),
        sleep=sleep,
        client_factory=fake_client,
        on_state=states.append,
    )
    assert await conn.start() is False
    await asyncio.wait_for(conn.wait_connected(), 5)
    assert sleep.delays == expected_delays(42, 0.5, 4.0, 4)
    assert states == [True]
    assert conn.attempts == 0
    assert [c.closed for c in fake_client.made] == [True] * 4 + [False]
    await conn.close()
    assert states == [True, False]
    assert fake_client.made[-1].closed


async def test_a_hanging_first_connect_is_bounded(fake_client: type[FakeClient]) -> None:
    fake_client.plan = ["hang", "ok"]
    conn = Connection(
        NatsSettings(first_connect_timeout_s=0.05),
        backoff=Backoff(0.01, 0.01, random.Random(0)),
        client_factory=fake_client,
    )
    assert await asyncio.wait_for(conn.start(), 5) is False
    assert fake_client.made[0].closed
    await asyncio.wait_for(conn.wait_connected(), 5)
    await conn.close()


async def test_close_stops_the_retries(fake_client: type[FakeClient]) -> None:
    fake_client.plan = ["refuse"] * 1000
    three_retries = asyncio.Event()
    sleep = SleepRecorder()

    async def counting_sleep(delay: float) -> None:
        await sleep(delay)
        if len(sleep.delays) >= 3:
            three_retries.set()

    conn = Connection(
        NatsSettings(),
        backoff=Backoff(0.001, 0.001, random.Random(0)),
        sleep=counting_sleep,
        client_factory=fake_client,
    )
    assert await conn.start() is False
    await asyncio.wait_for(three_retries.wait(), 5)
    await conn.close()
    made = len(fake_client.made)
    for _ in range(10):
        await asyncio.sleep(0)
    assert len(fake_client.made) == made
    assert not conn.connected.is_set()
    assert all(c.closed for c in fake_client.made)


def test_reconnect_hook_picks_least_failed_server_with_jitter() -> None:
    conn = Connection(NatsSettings(), backoff=Backoff(0.5, 30, random.Random(3)))
    servers = [Server(urlparse("nats://a:4222"), 2), Server(urlparse("nats://b:4222"), 1)]
    server, delay = conn._pick_server(servers, {})
    assert server is servers[1]
    assert delay == random.Random(3).uniform(0, 1.0)  # ceiling for 1 failure: 0.5 * 2
