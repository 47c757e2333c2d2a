"""The event-loop lag on /metrics, on real processes: ``metalguard controller run`` with
its HTTP API and ``metalguard agent run`` with ``[metrics] listen``; both still stop on
SIGTERM (exit 0)."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import aiohttp
import pytest

from metalguard.agent.config import ConfigError, parse_config
from metalguard.proto.subjects import Subjects
from tests.support.harness.agent_proc import AgentProcess, write_agent_config
from tests.support.harness.controller_proc import controller_toml, running_controller, stop_cleanly
from tests.support.waiting import wait_for_line, wait_for_value

DEADLINE_S = 30.0
LAG = "metalguard_event_loop_lag_seconds "


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def scrape(url: str) -> str:
    try:
        async with aiohttp.ClientSession() as http, http.get(url) as response:
            return await response.text() if response.status == 200 else ""
    except aiohttp.ClientError:
        return ""


def figure(text: str, name: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(name + " "))
    return float(line.split()[-1])


async def test_the_controller_serves_its_loop_lag(
    nats_url: str, subjects: Subjects, tmp_path: Path
) -> None:
    port = free_port()
    config = tmp_path / "controller.toml"
    config.write_text(
        controller_toml(nats_url, subjects.prefix, f'[http]\nlisten = "127.0.0.1:{port}"\n')
    )
    async with running_controller(config) as proc:
        assert proc.stderr is not None
        seen: list[str] = []
        await wait_for_line(proc.stderr, "running", DEADLINE_S, seen)
        drain = asyncio.create_task(proc.stderr.read())
        text = await wait_for_value(
            lambda: scrape(f"http://127.0.0.1:{port}/metrics"),
            lambda t: LAG in t and samples(t) >= 2,
            DEADLINE_S,
            "the lag gauge",
        )
        print("controller lag:", figure(text, "metalguard_event_loop_lag_seconds"), "p99:",
              figure(text, "metalguard_event_loop_lag_p99_seconds"))  # fmt: skip
        assert figure(text, "metalguard_event_loop_lag_seconds") >= 0.0
        assert "metalguard_nodes{" in text  # the other gauges are still there
        assert figure(text, "metalguard_job_bad_events_total") == 0.0  # listener counts
        assert "metalguard_federation_bad_messages_total" not in text  # no [federation]
        await stop_cleanly(proc, seen, DEADLINE_S, drain)


async def test_the_agent_serves_its_loop_lag_and_counters(nats_url: str, tmp_path: Path) -> None:
    port = free_port()
    config = write_agent_config(
        tmp_path / "agent.toml", nats_url=nats_url, spool_dir=tmp_path / "spool"
    )
    config.write_text(config.read_text() + f'\n[metrics]\nlisten = "127.0.0.1:{port}"\n')
    agent = AgentProcess(config)
    try:
        text = await wait_for_value(
            lambda: scrape(f"http://127.0.0.1:{port}/metrics"),
            lambda t: LAG in t and samples(t) >= 2 and sent(t) >= 1,
            DEADLINE_S,
            "the agent's lag gauge and a batch published or spooled",
        )
        print("agent lag:", figure(text, "metalguard_event_loop_lag_seconds"))
        assert figure(text, "metalguard_agent_nats_connected") == 1.0
        assert "metalguard_event_loop_lag_p99_seconds" in text
        assert await asyncio.to_thread(agent.terminate) == 0, agent.stderr()
    finally:
        agent.close()


def samples(text: str) -> float:
    """Lag samples taken so far (0 before the first timer fired)."""
    return figure(text, "metalguard_event_loop_lag_histogram_seconds_count")


def sent(text: str) -> float:
    """Batches the agent published, or spooled (no stream for them on this server)."""
    return figure(text, "metalguard_agent_published_total") + figure(
        text, "metalguard_agent_spooled_total"
    )


def test_the_metrics_listen_address_is_checked_at_load() -> None:
    with pytest.raises(ConfigError, match=r"metrics\.listen"):
        parse_config('[metrics]\nlisten = "http://127.0.0.1:9464"\n', "agent.toml")
    assert parse_config('[metrics]\nlisten = "[::1]:9464"\n').metrics.listen == "[::1]:9464"
