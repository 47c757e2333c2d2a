"""The region's NBD export server: one qemu-storage-daemon driven over QMP, behind the
NBD gate.

Two daemons run in their own sessions, apart from the controller (a controller restart,
or a failover on the same storage host, leaves the booted nodes' root volumes attached):

- ``qemu-storage-daemon --daemonize``: the exports (``blockdev-add`` + ``block-export-add``
  per instance), its NBD server on the unix socket ``<data_dir>/run/nbd.sock`` only;
- the NBD gate (:mod:`nbdgate`) on ``listen_host:listen_port``, relaying to that socket
  and refusing NBD_OPT_LIST: qemu would list every export's (secret) name to anyone.

Their files, in ``<data_dir>/run/``: ``qsd.pid``, ``qmp.sock`` (QMP), ``nbd.sock``;
``gate.pid``, ``gate.json`` (the address it listens on: a controller started with another
address replaces the gate instead of adopting it), ``gate.log`` (refused options, with
the peer's address).

:meth:`ExportServer.start` adopts live daemons (pid file + QMP) or starts them, then
reconciles: the daemon serves exactly the wanted exports (given by the caller: the live
instances), any other is removed (no orphan exports).  A supervisor task notices the QMP
connection dropping or the gate gone: a dead daemon is started again and re-populated
from the wanted exports (:attr:`ExportServer.wanted`: the start's list, then every add
and remove since), a live one reconnected and reconciled, a dead gate started again.
:attr:`ExportServer.restarts` counts daemon restarts, ``gate_restarts`` the gate's.

QMP client: the ``qemu.qmp`` library.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import msgspec
from qemu.qmp import ExecuteError, QMPClient, QMPError, Runstate

from metalguard.controller.provision import nbdplan
from metalguard.controller.provision.tool import StorageError, run_tool
from metalguard.runtime.deadlines import within

log = logging.getLogger(__name__)

BINARY = "qemu-storage-daemon"
GATE_MODULE = "metalguard.controller.provision.nbdgate"
UNIX_PATH_MAX = 107
CHECK_S = 0.5
"""How often the supervisor looks at the gate's pid (the daemon's QMP drop wakes it)."""


class _State(msgspec.Struct):
    listen: str
    pid: int = 0


def _opt(value: str) -> str:
    """A value inside a QEMU option string (a comma is written twice)."""
    return value.replace(",", ",,")


def _pid_alive(pid: int, marker: str = BINARY) -> bool:
    """``pid`` runs and its command line has ``marker`` (a zombie's is empty: not alive)."""
    if pid <= 0:
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return any(marker.encode() in arg for arg in cmdline.split(b"\0")[:3])


def _check_names(wanted: Mapping[str, str]) -> None:
    for name in wanted:
        try:
            nbdplan.check_export_name(name)
        except ValueError as exc:
            raise StorageError(str(exc), "invalid") from None


def _read_pid(path: Path) -> int:
    try:
        return int(path.read_text().strip() or 0)
    except (OSError, ValueError):
        return 0


async def _kill(pid: int, marker: str) -> None:
    """SIGTERM ``pid`` (if it is still ``marker``), SIGKILL after 5 s; until it is gone."""
    if not _pid_alive(pid, marker):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    for _ in range(100):
        if not _pid_alive(pid, marker):
            return
        await asyncio.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    for _ in range(100):
        if not _pid_alive(pid, marker):
            return
        await asyncio.sleep(0.05)


class ExportServer:
    """One qemu-storage-daemon whose exports the NBD gate serves on
    ``listen_host:listen_port``.

    ``wanted`` maps an export name to the volume file it serves.  Every method is a
    coroutine of the running loop; QMP changes are serialised.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        listen_host: str,
        listen_port: int,
        *,
        binary: str = BINARY,
        python: str = sys.executable,
        start_timeout_s: float = 15.0,
        op_timeout_s: float = 15.0,
        restart_backoff_s: tuple[float, float] = (0.2, 5.0),
        on_restart: Callable[[str], None] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.listen_host = listen_host
        self.listen_port = listen_port
        self._binary = binary
        self._python = python
        self._start_timeout = start_timeout_s
        self._op_timeout = op_timeout_s
        self._backoff = restart_backoff_s
        self._on_restart = on_restart
        self._client: QMPClient | None = None
        self._lock = asyncio.Lock()
        self._up = asyncio.Event()
        self._closing = False
        self._supervisor: asyncio.Task[None] | None = None
        self._dirty = True
        """The daemon may not serve :attr:`wanted` (a reconcile failed or is due)."""
        self.wanted: dict[str, str] = {}
        """Export name -> volume path: what the daemon is to serve."""
        self.restarts = 0
        """Times the daemon was found dead and started again (since :meth:`start`)."""
        self.gate_restarts = 0
        """Times the gate was found dead and started again (since :meth:`start`)."""
        self.pid = 0
        """The qemu-storage-daemon's pid."""
        self.gate_pid = 0
        """The NBD gate's pid."""

    # files -------------------------------------------------------------------------

    @property
    def socket_path(self) -> Path:
        """The daemon's QMP socket."""
        return self.run_dir / "qmp.sock"

    @property
    def pid_path(self) -> Path:
        """The daemon's pid file."""
        return self.run_dir / "qsd.pid"

    @property
    def nbd_socket_path(self) -> Path:
        """The daemon's NBD server (only the gate connects to it)."""
        return self.run_dir / "nbd.sock"

    @property
    def gate_pid_path(self) -> Path:
        """The gate's pid file."""
        return self.run_dir / "gate.pid"

    @property
    def _state_path(self) -> Path:
        return self.run_dir / "gate.json"

    @property
    def _listen(self) -> str:
        return f"{self.listen_host}:{self.listen_port}"

    def _read_pid(self) -> int:
        return _read_pid(self.pid_path)

    # lifecycle ---------------------------------------------------------------------

    async def start(self, wanted: Mapping[str, str]) -> nbdplan.Plan:
        """Adopt or start the daemon, serve exactly ``wanted``; the reconcile's plan.

        StorageError when the daemon cannot be started (the binary missing, the port
        taken: its message says which).  A wanted export that cannot be added (its volume
        file gone) is logged and left out of :attr:`wanted`; the others are served.
        """
        _check_names(wanted)
        self._closing = False
        async with self._lock:
            self.wanted = dict(wanted)
            await self._connect_or_spawn()
            await self._ensure_gate()
            result = await self._reconcile()
            self._dirty = False
        self._supervisor = asyncio.create_task(self._supervise(), name="qsd-supervisor")
        return result

    async def close(self, stop_daemon: bool = False) -> None:
        """Stop supervising and disconnect; with ``stop_daemon`` also end the daemon
        (its exports go: the nodes using them lose their root)."""
        self._closing = True
        self._up.clear()
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervisor
            self._supervisor = None
        await self._disconnect()
        if stop_daemon:
            await _kill(self.gate_pid or _read_pid(self.gate_pid_path), GATE_MODULE)
            await _kill(self.pid or self._read_pid(), BINARY)
            for p in (self.pid_path, self.socket_path, self.nbd_socket_path, self._state_path):
                p.unlink(missing_ok=True)
            self.gate_pid_path.unlink(missing_ok=True)

    async def _disconnect(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await client.disconnect()

    async def _connect(self) -> QMPClient:
        client = QMPClient("metalguard-qsd")
        try:
            await within(client.connect(str(self.socket_path)), self._start_timeout)
        except (QMPError, OSError, TimeoutError) as exc:
            with contextlib.suppress(Exception):
                await client.disconnect()
            raise StorageError(f"export server: cannot reach its QMP socket: {exc}") from None
        return client

    async def _connect_or_spawn(self) -> None:
        """Adopt the daemon of the pid file when it is live, else start one.

        A live daemon that does not answer on QMP is a StorageError, never killed: its
        exports are the booted nodes' roots (its one QMP connection may be another
        controller's: only the region's leader may drive it).
        """
        self._up.clear()
        await self._disconnect()
        pid = self._read_pid()
        if _pid_alive(pid):
            try:
                self._client = await self._connect()
            except StorageError as exc:
                raise StorageError(
                    f"{exc.message} (qemu-storage-daemon pid {pid} is running: is another "
                    "controller connected to it?)"
                ) from None
            self.pid = pid
            log.info("export server: adopted qemu-storage-daemon pid %d", pid)
            self._up.set()
            return
        await self._spawn()
        self._client = await self._connect()
        self._up.set()

    def _read_state(self) -> _State | None:
        try:
            return msgspec.json.decode(self._state_path.read_bytes(), type=_State)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            return None

    def _check_socket_paths(self) -> None:
        for sock in (self.socket_path, self.nbd_socket_path):
            if len(str(sock).encode()) > UNIX_PATH_MAX:
                raise StorageError(
                    f"export server: the socket path {str(sock)!r} is too long for a unix "
                    "socket: use a shorter data_dir",
                    "invalid",
                )

    async def _spawn(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._check_socket_paths()
        for p in (self.pid_path, self.socket_path, self.nbd_socket_path):
            p.unlink(missing_ok=True)
        argv = [
            self._binary,
            "--daemonize",
            "--pidfile",
            _opt(str(self.pid_path)),
            "--chardev",
            f"socket,id=qmp0,path={_opt(str(self.socket_path))},server=on,wait=off",
            "--monitor",
            "chardev=qmp0",
            "--nbd-server",
            f"addr.type=unix,addr.path={_opt(str(self.nbd_socket_path))}",
        ]
        await run_tool(argv, self._start_timeout, "export server: starting qemu-storage-daemon")
        self.pid = self._read_pid()
        if not _pid_alive(self.pid):
            raise StorageError("export server: qemu-storage-daemon exited right after starting")
        log.info("export server: qemu-storage-daemon pid %d", self.pid)

    async def _ensure_gate(self) -> bool:
        """Adopt the live gate on our address or start one; True when one was started."""
        pid = self.gate_pid or _read_pid(self.gate_pid_path)
        if _pid_alive(pid, GATE_MODULE):
            state = self._read_state()
            if state is not None and state.listen == self._listen and state.pid == pid:
                self.gate_pid = pid
                return False
            log.warning(
                "export server: the gate (pid %d) listens on %s, %s wanted: replacing",
                pid,
                state.listen if state else "?",
                self._listen,
            )
            await _kill(pid, GATE_MODULE)
        self._state_path.unlink(missing_ok=True)
        argv = [
            self._python,
            "-m",
            GATE_MODULE,
            "--daemonize",
            "--listen-host",
            self.listen_host,
            "--listen-port",
            str(self.listen_port),
            "--upstream",
            str(self.nbd_socket_path),
            "--pidfile",
            str(self.gate_pid_path),
            "--log",
            str(self.run_dir / "gate.log"),
        ]
        await run_tool(
            argv, self._start_timeout, f"export server: starting the NBD gate on {self._listen}"
        )
        self.gate_pid = _read_pid(self.gate_pid_path)
        if not _pid_alive(self.gate_pid, GATE_MODULE):
            raise StorageError("export server: the NBD gate exited right after starting")
        self._state_path.write_bytes(msgspec.json.encode(_State(self._listen, self.gate_pid)))
        log.info("export server: NBD gate pid %d on %s", self.gate_pid, self._listen)
        return True

    # supervision -------------------------------------------------------------------

    async def _supervise(self) -> None:
        delay = self._backoff[0]
        while not self._closing:
            client = self._client
            gate_ok = _pid_alive(self.gate_pid, GATE_MODULE)
            up = client is not None and client.runstate == Runstate.RUNNING
            if client is not None and up and gate_ok and not self._dirty:
                with contextlib.suppress(TimeoutError):
                    await within(client.runstate_changed(), CHECK_S)
                continue
            try:
                async with self._lock:
                    if self._closing:
                        return
                    await self._recover(client, gate_ok)
                delay = self._backoff[0]
            except StorageError as exc:
                log.error("export server: recovery failed (%s); retrying in %.1fs", exc, delay)
                await asyncio.sleep(delay)
                delay = min(self._backoff[1], delay * 2)

    async def _recover(self, client: QMPClient | None, gate_ok: bool) -> None:
        if client is None or client.runstate != Runstate.RUNNING:
            self._up.clear()
            self._dirty = True
            dead = not _pid_alive(self.pid)
            await self._connect_or_spawn()
            if dead:
                self.restarts += 1
                self._notify(f"qemu-storage-daemon died: restarted as pid {self.pid}")
        if self._dirty:
            await self._reconcile()
            self._dirty = False
        if not gate_ok and await self._ensure_gate():
            self.gate_restarts += 1
            self._notify(f"the NBD gate died: restarted as pid {self.gate_pid}")

    def _notify(self, what: str) -> None:
        log.warning("export server: %s", what)
        if self._on_restart is not None:
            self._on_restart(what)

    async def _ready(self) -> QMPClient:
        try:
            await within(self._up.wait(), self._op_timeout)
        except TimeoutError:
            raise StorageError("export server: the daemon is down (restarting)") from None
        assert self._client is not None
        return self._client

    async def _qmp(self, cmd: str, args: Mapping[str, Any] | None = None) -> object:
        client = self._client
        if client is None or client.runstate != Runstate.RUNNING:
            raise StorageError("export server: the daemon is down (restarting)")
        try:
            return await within(client.execute(cmd, args), self._op_timeout)
        except ExecuteError as exc:
            raise StorageError(f"export server: {cmd}: {exc}") from None
        except (QMPError, OSError, EOFError, TimeoutError) as exc:
            raise StorageError(f"export server: {cmd} failed: {exc!r}") from None

    # exports -----------------------------------------------------------------------

    async def _reconcile(self) -> nbdplan.Plan:
        exports = nbdplan.parse_exports(await self._qmp("query-block-exports"))
        nodes = nbdplan.parse_nodes(await self._qmp("query-named-block-nodes", {"flat": True}))
        todo = nbdplan.plan(exports, nodes, self.wanted)
        for eid in todo.remove_exports:
            await self._del_export(eid)
        for node in todo.remove_nodes:
            await self._qmp("blockdev-del", {"node-name": node})
        for name, path in todo.add:
            try:
                await self._add(name, path)
            except StorageError as exc:
                log.error("export server: cannot restore export of %s: %s", path, exc)
                self.wanted.pop(name, None)
        if todo.remove_exports or todo.remove_nodes:
            log.warning(
                "export server: removed unwanted exports %s, nodes %s",
                list(todo.remove_exports),
                list(todo.remove_nodes),
            )
        return todo

    async def reconcile(self, wanted: Mapping[str, str]) -> nbdplan.Plan:
        """Serve exactly ``wanted`` from now on (a new leader's view of the instances)."""
        _check_names(wanted)
        await self._ready()
        async with self._lock:
            self.wanted = dict(wanted)
            self._dirty = True
            result = await self._reconcile()
            self._dirty = False
            return result

    async def _del_export(self, eid: str) -> None:
        await self._qmp("block-export-del", {"id": eid, "mode": "hard"})
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._op_timeout
        while True:
            ids = {e.id for e in nbdplan.parse_exports(await self._qmp("query-block-exports"))}
            if eid not in ids:
                return
            if loop.time() > deadline:
                raise StorageError(f"export server: export {eid} did not go away")
            await asyncio.sleep(0.02)

    async def _add(self, name: str, path: str) -> None:
        await self._qmp("blockdev-add", nbdplan.blockdev_add_args(name, path))
        try:
            await self._qmp("block-export-add", nbdplan.export_add_args(name))
        except StorageError:
            with contextlib.suppress(StorageError):
                await self._qmp("blockdev-del", {"node-name": nbdplan.node_name(name)})
            raise

    async def add(self, name: str, path: str) -> None:
        """Export the volume file ``path`` as NBD export ``name`` (writable).

        Idempotent for the same (name, path); StorageError "conflict" when ``name`` or
        ``path`` is exported already otherwise, "failed" when the daemon refuses.
        """
        try:
            nbdplan.check_export_name(name)
        except ValueError as exc:
            raise StorageError(str(exc), "invalid") from None
        await self._ready()
        async with self._lock:
            current = self.wanted.get(name)
            if current == path:
                return
            if current is not None:
                raise StorageError("export name is in use for another volume", "conflict")
            other = [n for n, p in self.wanted.items() if p == path]
            if other:
                raise StorageError(f"{Path(path).stem!r} is exported already", "conflict")
            await self._add(name, path)
            self.wanted[name] = path

    async def remove(self, name: str) -> None:
        """Stop exporting ``name`` (a client still attached is dropped); idempotent."""
        async with self._lock:
            self.wanted.pop(name, None)
            client = self._client
            if client is None or client.runstate != Runstate.RUNNING:
                return  # the recovery's reconcile leaves it out
            ids = {e.id for e in nbdplan.parse_exports(await self._qmp("query-block-exports"))}
            if nbdplan.export_id(name) in ids:
                await self._del_export(nbdplan.export_id(name))
            nodes = nbdplan.parse_nodes(await self._qmp("query-named-block-nodes", {"flat": True}))
            if nbdplan.node_name(name) in nodes:
                await self._qmp("blockdev-del", {"node-name": nbdplan.node_name(name)})

    async def names(self) -> list[str]:
        """The export names the daemon serves now (not those shutting down)."""
        await self._ready()
        exports = nbdplan.parse_exports(await self._qmp("query-block-exports"))
        names = (nbdplan.name_of_id(e.id) for e in exports if not e.shutting_down)
        return sorted(n for n in names if n is not None)
