"""sd_notify's datagrams reach a NOTIFY_SOCKET bound in a temp dir, as systemd's would."""

from __future__ import annotations

import socket
from pathlib import Path

from metalguard.agent.sdnotify import notify


def test_notify_sends_datagrams(tmp_path: Path) -> None:
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind(path)
        assert notify("READY=1", {"NOTIFY_SOCKET": path})
        assert server.recv(4096) == b"READY=1"
    assert not notify("READY=1", {})
    assert not notify("READY=1", {"NOTIFY_SOCKET": str(tmp_path / "gone.sock")})
