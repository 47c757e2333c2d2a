"""A small NBD client speaking the real protocol (the NBD protocol document, "fixed
newstyle"), for the storage tests: handshake, NBD_OPT_GO / NBD_OPT_EXPORT_NAME /
NBD_OPT_LIST, then NBD_CMD_READ / WRITE / FLUSH / DISC with simple replies.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from dataclasses import dataclass

NBDMAGIC = 0x4E42444D41474943
IHAVEOPT = 0x49484156454F5054
REPLY_MAGIC = 0x3E889045565A9
REQUEST_MAGIC = 0x25609513
SIMPLE_REPLY_MAGIC = 0x67446698

FLAG_FIXED_NEWSTYLE = 1
FLAG_NO_ZEROES = 2

OPT_EXPORT_NAME = 1
OPT_ABORT = 2
OPT_LIST = 3
OPT_GO = 7

REP_ACK = 1
REP_SERVER = 2
REP_INFO = 3
REP_ERR = 1 << 31
REP_ERRORS = {
    REP_ERR + 1: "unsupported",
    REP_ERR + 2: "policy",
    REP_ERR + 3: "invalid",
    REP_ERR + 4: "platform",
    REP_ERR + 5: "tls required",
    REP_ERR + 6: "unknown export",
    REP_ERR + 7: "shutdown",
    REP_ERR + 8: "block size required",
    REP_ERR + 9: "too big",
}
INFO_EXPORT = 0

CMD_READ = 0
CMD_WRITE = 1
CMD_DISC = 2
CMD_FLUSH = 3

TFLAG_READ_ONLY = 2


class NbdError(Exception):
    """The server refused an option or failed a command."""


class NbdRefusedError(NbdError):
    """An option was refused: ``code`` (REP_ERR + n), ``reason`` its name."""

    def __init__(self, code: int, message: str) -> None:
        self.code = code
        self.reason = REP_ERRORS.get(code, hex(code))
        super().__init__(f"NBD option refused: {self.reason}: {message}")


@dataclass
class NbdClient:
    """One NBD connection in the transmission phase (see :func:`connect`)."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    size: int
    flags: int
    _handle: int = 0

    @property
    def read_only(self) -> bool:
        """The server exports it read-only."""
        return bool(self.flags & TFLAG_READ_ONLY)

    async def _request(self, cmd: int, offset: int, length: int, data: bytes = b"") -> bytes:
        self._handle += 1
        self.writer.write(
            struct.pack(">IHHQQI", REQUEST_MAGIC, 0, cmd, self._handle, offset, length) + data
        )
        await self.writer.drain()
        magic, error, handle = struct.unpack(">IIQ", await self.reader.readexactly(16))
        if magic != SIMPLE_REPLY_MAGIC or handle != self._handle:
            raise NbdError(f"bad reply: magic {magic:#x} handle {handle}")
        if error:
            raise NbdError(f"command {cmd} at {offset}+{length} failed: errno {error}")
        return await self.reader.readexactly(length) if cmd == CMD_READ else b""

    async def read(self, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset``."""
        return await self._request(CMD_READ, offset, length)

    async def write(self, offset: int, data: bytes) -> None:
        """Write ``data`` at ``offset``."""
        await self._request(CMD_WRITE, offset, len(data), data)

    async def flush(self) -> None:
        """Ask the server to make the writes so far durable."""
        await self._request(CMD_FLUSH, 0, 0)

    async def close(self) -> None:
        """NBD_CMD_DISC, then close the socket."""
        with contextlib.suppress(ConnectionError, OSError):
            self.writer.write(struct.pack(">IHHQQI", REQUEST_MAGIC, 0, CMD_DISC, 0, 0, 0))
            await self.writer.drain()
        self.writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await self.writer.wait_closed()


async def _handshake(
    host: str, port: int, unix: str = ""
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    if unix:
        reader, writer = await asyncio.open_unix_connection(unix)
    else:
        reader, writer = await asyncio.open_connection(host, port)
    magic, opt_magic, flags = struct.unpack(">QQH", await reader.readexactly(18))
    if magic != NBDMAGIC or opt_magic != IHAVEOPT or not flags & FLAG_FIXED_NEWSTYLE:
        writer.close()
        raise NbdError(f"not a fixed-newstyle NBD server (flags {flags:#x})")
    writer.write(struct.pack(">I", FLAG_FIXED_NEWSTYLE | (flags & FLAG_NO_ZEROES)))
    return reader, writer


def _option(writer: asyncio.StreamWriter, opt: int, data: bytes) -> None:
    writer.write(struct.pack(">QII", IHAVEOPT, opt, len(data)) + data)


async def _reply(reader: asyncio.StreamReader, opt: int) -> tuple[int, bytes]:
    magic, ropt, rtype, length = struct.unpack(">QIII", await reader.readexactly(20))
    if magic != REPLY_MAGIC or ropt != opt:
        raise NbdError(f"bad option reply: magic {magic:#x} option {ropt}")
    return rtype, await reader.readexactly(length)


async def connect(host: str, port: int, name: str, unix: str = "") -> NbdClient:
    """Attach export ``name`` with NBD_OPT_GO (on ``unix``, a socket path, when given);
    NbdRefusedError when the server says no."""
    reader, writer = await _handshake(host, port, unix)
    raw = name.encode()
    _option(writer, OPT_GO, struct.pack(">I", len(raw)) + raw + struct.pack(">H", 0))
    await writer.drain()
    size = flags = -1
    try:
        while True:
            rtype, data = await _reply(reader, OPT_GO)
            if rtype == REP_ACK:
                break
            if rtype == REP_INFO:
                (info,) = struct.unpack(">H", data[:2])
                if info == INFO_EXPORT:
                    size, flags = struct.unpack(">QH", data[2:12])
            elif rtype & REP_ERR:
                raise NbdRefusedError(rtype, data.decode(errors="replace"))
            else:
                raise NbdError(f"unexpected reply type {rtype:#x} to NBD_OPT_GO")
    except BaseException:
        writer.close()
        raise
    if size < 0:
        writer.close()
        raise NbdError("NBD_OPT_GO acknowledged without NBD_INFO_EXPORT")
    return NbdClient(reader, writer, size, flags)


async def connect_export_name(host: str, port: int, name: str) -> NbdClient:
    """Attach export ``name`` the old way (NBD_OPT_EXPORT_NAME): an unknown name makes
    the server hang up (NbdError)."""
    reader, writer = await _handshake(host, port)
    _option(writer, OPT_EXPORT_NAME, name.encode())
    await writer.drain()
    try:
        size, flags = struct.unpack(">QH", await reader.readexactly(10))
    except asyncio.IncompleteReadError:
        writer.close()
        raise NbdError(f"server closed the connection: export {name!r} refused") from None
    # with NO_ZEROES negotiated (we echo the server's flag) no 124 zero bytes follow
    return NbdClient(reader, writer, size, flags)


async def list_exports(host: str, port: int, unix: str = "") -> list[str]:
    """The export names the server lists (NBD_OPT_LIST); [] when it refuses to list."""
    reader, writer = await _handshake(host, port, unix)
    names: list[str] = []
    try:
        _option(writer, OPT_LIST, b"")
        await writer.drain()
        while True:
            rtype, data = await _reply(reader, OPT_LIST)
            if rtype == REP_ACK:
                break
            if rtype == REP_SERVER:
                (n,) = struct.unpack(">I", data[:4])
                names.append(data[4 : 4 + n].decode())
            elif rtype & REP_ERR:
                break
        _option(writer, OPT_ABORT, b"")
        await writer.drain()
    finally:
        writer.close()
    return names


async def list_exports_unix(path: str) -> list[str]:
    """:func:`list_exports` of a server on the unix socket ``path``."""
    return await list_exports("", 0, unix=path)
