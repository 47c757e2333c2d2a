"""The ``smart`` collector: disk health from ``smartctl --json``.

Either reads saved outputs (``smart_json_dir``: every ``*.json`` in it) or runs
smartctl: ``--scan-open --json`` to find devices (falling back to a sysfs listing), then
``--json -a`` per device as a subprocess, bounded in time and in concurrency.  Parsing is
in :mod:`agent.collectors.smart_parse`; this module only does I/O.  Nothing here raises
for a bad disk, a missing smartctl or garbage output: each becomes a CollectorError.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from metalguard.agent.collectors.base import BatchField, Collected, CollectorSettings, register
from metalguard.agent.collectors.smart_parse import (
    ScanEntry,
    SmartJsonError,
    devices_from_sysfs,
    interpret_output,
    parse_scan,
    smartctl_args,
    with_permission_hint,
)
from metalguard.proto.telemetry import CollectorError, SmartDevice

NAME = "smart"
REAP_TIMEOUT_S = 5.0
"""How long to wait for a killed smartctl to go; one stuck in the kernel (D state on a
hung disk) cannot be killed, and the collector must not hang with it."""


class SmartctlError(Exception):
    """smartctl could not be run to completion; the message says why."""


class SmartctlNotFoundError(SmartctlError):
    """The smartctl executable does not exist."""


@dataclass(frozen=True, slots=True)
class ProcessResult:
    """A finished process: exit code and everything it printed."""

    returncode: int
    stdout: bytes
    stderr: bytes


Runner = Callable[[Sequence[str], float], Awaitable[ProcessResult]]
"""Runs argv with a timeout in seconds; raises :class:`SmartctlError` if it cannot."""


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL the process and anything it started (it leads its own session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    except PermissionError:
        proc.kill()


async def run_process(argv: Sequence[str], timeout_s: float) -> ProcessResult:
    """Run ``argv`` to completion within ``timeout_s``; on timeout (or cancellation) kill
    its whole process group.  Raises :class:`SmartctlError` naming the cause."""
    program = argv[0]
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
    except FileNotFoundError:
        msg = f"smartctl not found: install smartmontools ({program!r})"
        raise SmartctlNotFoundError(msg) from None
    except PermissionError:
        raise SmartctlError(f"smartctl not executable: {program!r} (permission denied)") from None
    except OSError as exc:
        raise SmartctlError(f"smartctl could not start: {program!r}: {exc}") from None
    try:
        async with asyncio.timeout(timeout_s):
            stdout, stderr = await proc.communicate()
    except TimeoutError:
        _kill_group(proc)
        try:
            async with asyncio.timeout(REAP_TIMEOUT_S):
                await proc.wait()
        except TimeoutError:
            raise SmartctlError(
                f"smartctl timed out after {timeout_s:g} s and survived SIGKILL "
                f"(stuck in the kernel?): {' '.join(argv[1:])}"
            ) from None
        raise SmartctlError(
            f"smartctl timed out after {timeout_s:g} s (killed): {' '.join(argv[1:])}"
        ) from None
    except BaseException:
        _kill_group(proc)
        raise
    return ProcessResult(proc.returncode if proc.returncode is not None else -1, stdout, stderr)


def _first_line(*texts: bytes) -> str:
    for text in texts:
        line = text.decode(errors="replace").strip().splitlines()
        if line:
            return line[0][:200]
    return "no output"


DeviceResult = tuple[SmartDevice | None, CollectorError | None]


@register(NAME, default_interval_s=300)
class SmartCollector:
    """Reads SMART health of every disk; see the module docstring."""

    name: str = NAME
    field: BatchField = "smart"

    def __init__(self, settings: CollectorSettings, *, runner: Runner = run_process) -> None:
        self._settings = settings
        self._runner = runner

    def _error(self, message: str, path: str = "") -> CollectorError:
        return CollectorError(collector=self.name, path=path, message=message)

    async def collect(self) -> Collected:
        """One reading per disk, plus an error entry per disk or file that gave none."""
        if self._settings.smart_json_dir is not None:
            results = await self._from_json_dir(self._settings.smart_json_dir)
        else:
            results = await self._from_smartctl()
        items = tuple(d for d, _ in results if d is not None)
        errors = tuple(e for _, e in results if e is not None)
        return Collected(field=self.field, items=items, errors=errors)

    async def _from_json_dir(self, directory: Path) -> list[DeviceResult]:
        if not await asyncio.to_thread(directory.is_dir):
            return [(None, self._error("smart_json_dir is not a directory", str(directory)))]
        try:
            files = await asyncio.to_thread(lambda: sorted(directory.glob("*.json")))
        except OSError as exc:
            return [(None, self._error(f"cannot list smart_json_dir: {exc}", str(directory)))]
        return [await self._read_json_file(path) for path in files]

    async def _read_json_file(self, path: Path) -> DeviceResult:
        try:
            data = await asyncio.to_thread(path.read_bytes)
            outcome = interpret_output(data, fallback_name=path.stem)
        except OSError as exc:
            return None, self._error(f"cannot read: {exc.strerror or exc}", str(path))
        except SmartJsonError as exc:
            return None, self._error(f"{path.name}: {exc}", str(path))
        error = self._error(outcome.error, str(path)) if outcome.error else None
        return outcome.device, error

    async def _from_smartctl(self) -> list[DeviceResult]:
        entries, results = await self.discover()
        if entries is None:
            return results
        limit = asyncio.Semaphore(max(1, self._settings.smart_concurrency))

        async def bounded(entry: ScanEntry) -> DeviceResult:
            async with limit:
                return await self.query(entry)

        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(bounded(entry)) for entry in entries]
        return results + [task.result() for task in tasks]

    async def discover(self) -> tuple[list[ScanEntry] | None, list[DeviceResult]]:
        """Devices to query (None if smartctl is missing) and errors met on the way.

        ``--scan-open`` first; if it fails or finds nothing, the sysfs listing.  Devices
        that ``--scan-open`` could not open become errors instead of queries.
        """
        settings = self._settings
        results: list[DeviceResult] = []
        entries: list[ScanEntry] = []
        argv = [settings.smartctl, "--scan-open", "--json"]
        try:
            proc = await self._runner(argv, settings.smart_timeout_s)
        except SmartctlNotFoundError as exc:
            return None, [(None, self._error(str(exc)))]
        except SmartctlError as exc:
            results.append((None, self._error(f"device scan failed: {exc}")))
        else:
            try:
                entries = parse_scan(proc.stdout)
            except SmartJsonError as exc:
                why = f"{exc}: {_first_line(proc.stderr, proc.stdout)}"
                results.append((None, self._error(f"device scan printed no JSON ({why})")))
        if not entries:
            entries = await asyncio.to_thread(self._sysfs_devices)
        for entry in entries:
            if entry.open_error:
                msg = with_permission_hint(f"open failed: {entry.open_error}")
                results.append((None, self._error(msg, entry.name)))
        return [e for e in entries if not e.open_error], results

    def _sysfs_devices(self) -> list[ScanEntry]:
        def listing(path: Path) -> list[str]:
            try:
                return os.listdir(path)
            except OSError:
                return []

        sysfs = self._settings.sysfs
        return devices_from_sysfs(listing(sysfs / "class" / "nvme"), listing(sysfs / "block"))

    async def query(self, entry: ScanEntry) -> DeviceResult:
        """Run ``smartctl --json -a`` on one device and interpret what it printed."""
        argv = smartctl_args(self._settings.smartctl, entry)
        try:
            proc = await self._runner(argv, self._settings.smart_timeout_s)
        except SmartctlError as exc:
            return None, self._error(str(exc), entry.name)
        try:
            outcome = interpret_output(
                proc.stdout, fallback_name=entry.name, returncode=proc.returncode
            )
        except SmartJsonError as exc:
            msg = (
                f"smartctl printed no JSON (exit status {proc.returncode}; {exc}; "
                f"--json needs smartmontools >= 7.0): {_first_line(proc.stderr, proc.stdout)}"
            )
            return None, self._error(msg, entry.name)
        error = self._error(outcome.error, entry.name) if outcome.error else None
        return outcome.device, error
