"""A uevent monitor for tests: what pyudev's Monitor offers the agent's udev watch
(:class:`metalguard.agent.collectors.udev.MonitorLike`), over one end of a socketpair, so
each pushed uevent makes its descriptor readable as the kernel's netlink socket would."""

from __future__ import annotations

import socket
from dataclasses import dataclass


@dataclass
class Uevent:
    """What pyudev.Device offers the monitor: properties and action."""

    properties: dict[str, str]
    action: str | None


class SocketMonitor:
    """A monitor whose fd is a real socket: each pushed uevent makes it readable."""

    def __init__(self) -> None:
        self.ours, self.theirs = socket.socketpair()
        self.ours.setblocking(False)
        self.pending: list[Uevent] = []

    def push(self, props: dict[str, str]) -> None:
        """Queue one uevent (``props`` as the kernel sends them, ACTION among them)."""
        self.pending.append(Uevent(props, props.get("ACTION")))
        self.theirs.send(b"x")

    def fileno(self) -> int:
        return self.ours.fileno()

    def poll(self, timeout: float | None = None) -> Uevent | None:
        if not self.pending:
            return None
        self.ours.recv(1)
        return self.pending.pop(0)

    def close(self) -> None:
        self.ours.close()
        self.theirs.close()
