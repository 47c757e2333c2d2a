"""The agent's end of the client library's unix socket: newline-delimited JSON."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

log = logging.getLogger(__name__)

MAX_LINE = 64 * 1024
"""A longer line closes the connection (a client library never sends one)."""


class ChannelPeer:
    """One connected workload process."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self.member_key: str | None = None
        """The job id its ``hello`` named (set by the runner)."""
        self.closed = False

    async def send(self, msg: dict[str, object]) -> None:
        """Send one message; a dead peer is closed, not raised."""
        if self.closed:
            return
        try:
            self._writer.write(json.dumps(msg).encode() + b"\n")
            await self._writer.drain()
        except (ConnectionError, OSError):
            self.close()

    def close(self) -> None:
        """Close the connection."""
        if not self.closed:
            self.closed = True
            self._writer.close()


OnMessage = Callable[[ChannelPeer, dict[str, object]], Awaitable[None]]
OnGone = Callable[[ChannelPeer], None]


class Channel:
    """A unix stream server; each decoded object goes to ``on_message`` in order."""

    def __init__(self, path: str, on_message: OnMessage, on_gone: OnGone) -> None:
        self.path = path
        self._on_message = on_message
        self._on_gone = on_gone
        self._server: asyncio.AbstractServer | None = None
        self._peers: set[ChannelPeer] = set()

    async def start(self) -> None:
        """Bind the socket (a stale file from a previous run is replaced)."""
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._server = await asyncio.start_unix_server(self._serve, self.path, limit=MAX_LINE)

    async def close(self) -> None:
        """Stop accepting, close every peer, remove the socket file."""
        if self._server is not None:
            self._server.close()
            for peer in list(self._peers):
                peer.close()
            await self._server.wait_closed()
            self._server = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = ChannelPeer(writer)
        self._peers.add(peer)
        try:
            while not peer.closed:
                try:
                    line = await reader.readline()
                except (ValueError, ConnectionError, OSError):
                    break  # over-long line or a reset
                if not line:
                    break
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                if isinstance(msg, dict):
                    await self._on_message(peer, msg)
        finally:
            self._peers.discard(peer)
            peer.close()
            self._on_gone(peer)
