"""A NATS cluster of several nats-servers (JetStream clustered) on loopback, as children.

For the tests and benches of a region on NATS's own scale-out (docs/scaling.md): each
server gets free loopback ports (client, route, monitoring), its own store directory
under one temp dir, and a config file whose ``cluster {}`` block routes it to every
other server.  :meth:`NatsCluster.start` returns once every server is ready and
JetStream has a meta leader (``/healthz?js-enabled-only`` is not enough: a fresh
cluster answers ``ok`` before the election), so R3 streams can be created at once.
"""

from __future__ import annotations

import json
import socket
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from metalguard.controller.broker.server import NatsServer, NatsServerError

CLUSTER_NAME = "mg-region"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free now on ``host`` (the server binds it a moment later: a small race)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True, slots=True)
class ServerPorts:
    """One member's loopback ports."""

    client: int
    route: int
    monitor: int


def server_config(name: str, ports: ServerPorts, peers: list[int], store_dir: Path) -> str:
    """The nats-server config of one cluster member (``peers``: every member's route port)."""
    routes = ", ".join(f'"nats-route://127.0.0.1:{p}"' for p in peers if p != ports.route)
    return (
        f'server_name: "{name}"\n'
        f"listen: 127.0.0.1:{ports.client}\n"
        f"http: 127.0.0.1:{ports.monitor}\n"
        f'jetstream {{ store_dir: "{store_dir}" }}\n'
        f'cluster {{ name: "{CLUSTER_NAME}", listen: 127.0.0.1:{ports.route}, '
        f"routes: [{routes}] }}\n"
    )


class NatsCluster:
    """``size`` clustered nats-servers; :attr:`urls` is what clients list in ``servers``."""

    def __init__(self, size: int = 3, *, base_dir: Path | None = None) -> None:
        if size < 1:
            raise ValueError("a cluster has at least one server")
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if base_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="mg-natscluster-")
            base_dir = Path(self._tmp.name)
        self.base_dir = base_dir
        self.ports = [ServerPorts(free_port(), free_port(), free_port()) for _ in range(size)]
        peers = [p.route for p in self.ports]
        self.servers: list[NatsServer] = []
        for i, ports in enumerate(self.ports):
            name = f"n{i + 1}"
            conf = base_dir / f"{name}.conf"
            conf.write_text(server_config(name, ports, peers, base_dir / name / "js"))
            server = NatsServer(config_file=conf)
            server.port = ports.client
            self.servers.append(server)

    @property
    def urls(self) -> list[str]:
        """Every member's client URL (running or not: clients reconnect to the others)."""
        return [f"nats://127.0.0.1:{p.client}" for p in self.ports]

    def start(self, timeout: float = 30.0) -> list[str]:
        """Start every member, wait for JetStream's meta leader with every member current
        (a stream of N replicas can be placed at once); the client URLs."""
        deadline = time.monotonic() + timeout
        try:
            for server in self.servers:
                server.start(max(1.0, deadline - time.monotonic()))
            self.wait_meta_leader(max(1.0, deadline - time.monotonic()), len(self.servers) - 1)
        except NatsServerError:
            self.stop()
            raise
        return self.urls

    def kill(self, index: int) -> None:
        """Stop one member abruptly (SIGKILL): the others carry on (R3 survives one)."""
        server = self.servers[index]
        proc = server._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)
        server.stop()

    def restart(self, index: int, timeout: float = 30.0) -> None:
        """Start a stopped member again (same ports, same store): it catches up by itself."""
        self.servers[index].start(timeout)

    def wait_meta_leader(self, timeout: float, peers: int = 0) -> str:
        """Block until some running member names JetStream's meta leader and (``peers``)
        sees that many other members current; the leader's name."""
        deadline = time.monotonic() + timeout
        while True:
            for server, ports in zip(self.servers, self.ports, strict=True):
                if not server.running:
                    continue
                leader = _meta_leader(ports.monitor, peers)
                if leader:
                    return leader
            if time.monotonic() >= deadline:
                raise NatsServerError(f"no JetStream meta leader within {timeout}s")
            time.sleep(0.1)  # polling a child's HTTP endpoint: no event to wait on

    def stop(self) -> None:
        """Stop every member."""
        for server in self.servers:
            server.stop()

    def close(self) -> None:
        """Stop every member and remove the temp dir."""
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> NatsCluster:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _meta_leader(monitor_port: int, peers: int = 0) -> str:
    """The meta leader's name from a member's ``/jsz`` (empty while there is none, or
    while fewer than ``peers`` other members are current in its view)."""
    url = f"http://127.0.0.1:{monitor_port}/jsz"
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            body = json.loads(resp.read())
    except (OSError, urllib.error.URLError, ValueError):
        return ""
    cluster = body.get("meta_cluster") or {}
    current = [r for r in cluster.get("replicas") or [] if r.get("current")]
    if len(current) < peers:
        return ""
    return str(cluster.get("leader") or "")
