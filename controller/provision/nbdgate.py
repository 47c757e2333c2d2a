"""The NBD gate: the region's NBD port, in front of qemu-storage-daemon's unix socket.

qemu's NBD server answers NBD_OPT_LIST with the name of every export, and an export's
name is the only secret between a node and the volume behind it.  The gate passes the
option haggling through one option at a time, answers NBD_OPT_LIST (and STARTTLS) itself
with NBD_REP_ERR_POLICY (logged with the peer's address), and once an export is
attached (NBD_OPT_GO acknowledged, or NBD_OPT_EXPORT_NAME) relays bytes both ways.

It runs as its own daemon (``python -m metalguard.controller.provision.nbdgate
--daemonize ...``, started by :mod:`exports`), so a controller restart leaves attached
nodes attached.  Standard library only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import logging.handlers
import os
import signal
import struct
import sys
from collections.abc import Sequence

from metalguard.controller.provision import nbdplan
from metalguard.runtime.deadlines import within

log = logging.getLogger("metalguard.nbdgate")

IHAVEOPT = 0x49484156454F5054
REPLY_MAGIC = 0x3E889045565A9
MAX_OPTION_BYTES = 64 * 1024
"""Longer option data (a name is at most 4096 bytes) ends the connection."""
HANDSHAKE_TIMEOUT_S = 30.0
"""The whole option haggling must end within this (a stalled client is dropped)."""
CHUNK = 256 * 1024


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        data = await reader.read(CHUNK)
        if not data:
            return
        writer.write(data)
        await writer.drain()


async def _haggle(
    cr: asyncio.StreamReader,
    cw: asyncio.StreamWriter,
    ur: asyncio.StreamReader,
    uw: asyncio.StreamWriter,
    peer: str,
) -> bool:
    """Relay the handshake; True once transmission starts, False when it ends without."""
    cw.write(await ur.readexactly(18))  # NBDMAGIC, IHAVEOPT, handshake flags
    await cw.drain()
    uw.write(await cr.readexactly(4))  # client flags
    while True:
        header = await cr.readexactly(16)
        magic, option, length = struct.unpack(">QII", header)
        if magic != IHAVEOPT or length > MAX_OPTION_BYTES:
            log.warning("%s: bad option (magic %#x, %d bytes): dropped", peer, magic, length)
            return False
        data = await cr.readexactly(length)
        refusal = nbdplan.gate_refusal(option)
        if refusal is not None:
            log.warning("%s: refused option %d (%s)", peer, option, refusal)
            msg = refusal.encode()
            cw.write(
                struct.pack(">QIII", REPLY_MAGIC, option, nbdplan.NBD_REP_ERR_POLICY, len(msg))
                + msg
            )
            await cw.drain()
            continue
        uw.write(header + data)
        await uw.drain()
        if option == nbdplan.NBD_OPT_EXPORT_NAME:
            return True  # the daemon answers with the export (or hangs up): plain bytes
        while True:
            rheader = await ur.readexactly(20)
            _magic, _opt, rtype, rlen = struct.unpack(">QIII", rheader)
            cw.write(rheader + await ur.readexactly(rlen))
            await cw.drain()
            if nbdplan.reply_is_final(rtype):
                break
        if nbdplan.starts_transmission(option, rtype):
            return True
        if option == nbdplan.NBD_OPT_ABORT:
            return False


async def handle(upstream: str, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
    """One client: haggle through the gate, then relay until either side hangs up."""
    addr = cw.get_extra_info("peername")
    peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
    uw: asyncio.StreamWriter | None = None
    try:
        ur, uw = await asyncio.open_unix_connection(upstream)
        attached = await within(_haggle(cr, cw, ur, uw, peer), HANDSHAKE_TIMEOUT_S)
        if attached:
            pumps = [asyncio.ensure_future(_pump(cr, uw)), asyncio.ensure_future(_pump(ur, cw))]
            _done, pending = await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            for p in pending:
                p.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
    except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
        log.info("%s: connection ended: %r", peer, exc)
    finally:
        for w in (cw, uw):
            if w is not None:
                w.close()
                with contextlib.suppress(Exception):
                    await w.wait_closed()


async def serve(host: str, port: int, upstream: str, ready: int | None) -> None:
    """Listen on ``host:port`` until SIGTERM; write b"ready" to fd ``ready`` once bound."""
    server = await asyncio.start_server(
        lambda r, w: handle(upstream, r, w), host, port, reuse_address=True
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        os.write(ready, b"ready")
        os.close(ready)
    log.info("NBD gate on %s:%d -> %s", host, port, upstream)
    async with server:
        await stop.wait()


def _detach(log_file: str | None) -> None:
    fd = os.open(os.devnull, os.O_RDWR)
    for std in (0, 1, 2):
        os.dup2(fd, std)
    os.close(fd)
    if log_file:
        handler = logging.handlers.RotatingFileHandler(log_file, maxBytes=1 << 20, backupCount=2)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)


def main(argv: Sequence[str] | None = None) -> int:
    """``nbdgate --listen-host H --listen-port P --upstream SOCK [--pidfile F] [--log F]
    [--daemonize]``: with --daemonize the parent exits 0 once the port is bound (1 with
    the reason on stderr when it cannot be)."""
    ap = argparse.ArgumentParser(prog="nbdgate", description=__doc__.split("\n")[0])
    ap.add_argument("--listen-host", required=True)
    ap.add_argument("--listen-port", type=int, required=True)
    ap.add_argument("--upstream", required=True, help="qemu-storage-daemon's NBD unix socket")
    ap.add_argument("--pidfile")
    ap.add_argument("--log")
    ap.add_argument("--daemonize", action="store_true")
    args = ap.parse_args(argv)
    ready: int | None = None
    if args.daemonize:
        r, w = os.pipe()
        if os.fork() > 0:
            os.close(w)
            with os.fdopen(r, "rb") as f:
                said = f.read()
            if said == b"ready":
                return 0
            sys.stderr.write(said.decode(errors="replace") or "nbdgate: exited while starting\n")
            return 1
        os.close(r)
        os.setsid()
        ready = w
    try:
        if args.pidfile:
            with open(args.pidfile, "w") as f:
                f.write(f"{os.getpid()}\n")
        if ready is not None:
            _detach(args.log)
        else:
            logging.basicConfig(level=logging.INFO)
        asyncio.run(serve(args.listen_host, args.listen_port, args.upstream, ready))
    except OSError as exc:
        msg = f"nbdgate: cannot listen on {args.listen_host}:{args.listen_port}: {exc}\n"
        if ready is not None:
            with contextlib.suppress(OSError):
                os.write(ready, msg.encode())
        else:
            sys.stderr.write(msg)
        return 1
    finally:
        if args.pidfile:
            with contextlib.suppress(OSError):
                os.unlink(args.pidfile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
