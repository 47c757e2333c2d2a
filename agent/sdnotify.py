"""systemd notification protocol (sd_notify) without extra dependencies."""

from __future__ import annotations

import os
import socket


def notify(state: str, env: dict[str, str] | None = None) -> bool:
    """Send ``state`` (e.g. ``READY=1``) to $NOTIFY_SOCKET; False when not under systemd.

    Errors sending are swallowed: a notification is never worth crashing the agent.
    """
    environ = os.environ if env is None else env
    address = environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
    except OSError:
        return False
    return True


def watchdog_interval_s(env: dict[str, str] | None = None) -> float | None:
    """How often to send WATCHDOG=1 (half of WatchdogSec), or None when not asked.

    Honors WATCHDOG_PID: only the process it names should ping.
    """
    environ = os.environ if env is None else env
    usec = environ.get("WATCHDOG_USEC")
    if not usec:
        return None
    pid = environ.get("WATCHDOG_PID")
    if pid and pid != str(os.getpid()):
        return None
    try:
        value = int(usec)
    except ValueError:
        return None
    return value / 1e6 / 2 if value > 0 else None
