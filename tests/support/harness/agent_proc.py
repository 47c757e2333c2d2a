"""Run ``metalguard agent run`` as a real child process for tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.support import FIXTURES

METALGUARD = str(Path(sys.executable).parent / "metalguard")
FIXTURE_SYSFS = FIXTURES / "node_exporter" / "sys"
FIXTURE_SMART = FIXTURES / "smartctl"


def write_agent_config(
    path: Path,
    *,
    nats_url: str,
    spool_dir: Path,
    node: str = "n1",
    interval_s: float = 0.2,
    reconnect_max_s: float = 0.5,
) -> Path:
    """An agent config over the fixture tree with short intervals."""
    path.write_text(
        f"""
[node]
region = "r1"
cluster = "c1"
name = "{node}"
uuid = "test-uuid-{node}"

[nats]
servers = ["{nats_url}"]
connect_timeout_s = 1.0
publish_timeout_s = 2.0
reconnect_base_s = 0.1
reconnect_max_s = {reconnect_max_s}

[collect]
interval_s = {interval_s}
enabled = ["edac", "pcie", "hwmon", "smart"]
sysfs = "{FIXTURE_SYSFS}"
smart_json_dir = "{FIXTURE_SMART}"

[collect.intervals]
edac = {interval_s}
pcie = {interval_s}
hwmon = {interval_s}
smart = 5.0

[spool]
dir = "{spool_dir}"
"""
    )
    return path


class AgentProcess:
    """A ``metalguard agent run`` child; stopped by SIGTERM or killed by SIGKILL."""

    def __init__(self, config: Path, env: dict[str, str] | None = None) -> None:
        full_env = {**os.environ, **(env or {})}
        self.proc = subprocess.Popen(
            [METALGUARD, "--log-level", "warning", "agent", "run", "--config", str(config)],
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )

    def terminate(self, timeout: float = 20.0) -> int:
        """SIGTERM and wait; return the exit code."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL: no chance to flush."""
        self.proc.kill()
        self.proc.wait(10)

    def stderr(self) -> str:
        """What the agent logged (after it exited)."""
        return self.proc.stderr.read() if self.proc.stderr else ""

    def close(self) -> None:
        """Make sure the child is gone."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if self.proc.stderr:
            self.proc.stderr.close()


class NotifySocket:
    """A datagram socket standing in for systemd's NOTIFY_SOCKET."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.received: list[str] = []

    def wait_for(self, prefix: str, deadline_s: float) -> str:
        """Block until a datagram starting with ``prefix`` arrives; return it."""
        end = time.monotonic() + deadline_s
        for seen in self.received:
            if seen.startswith(prefix):
                return seen
        while (left := end - time.monotonic()) > 0:
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(4096).decode()
            except TimeoutError:
                break
            self.received.append(data)
            if data.startswith(prefix):
                return data
        raise AssertionError(f"no {prefix!r} within {deadline_s}s; got {self.received}")

    def close(self) -> None:
        """Close the socket."""
        self.sock.close()
