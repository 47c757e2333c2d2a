"""Running the storage tools (qemu-img, mke2fs) as asyncio subprocesses, and StorageError.

Every failure of the storage layer is a :class:`StorageError` with a message meant for
the operator (the tool's own last stderr lines included) and a ``kind`` the service maps
to an HTTP status.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
from collections.abc import Sequence
from typing import Literal

from metalguard.runtime.deadlines import within

ErrorKind = Literal["invalid", "not_found", "conflict", "failed"]
"""invalid: bad input (400); not_found: no such image/volume/export (404); conflict: it
exists already, or is in use (409); failed: the tool or the daemon failed (502)."""

STDERR_TAIL = 600
"""Characters of a tool's stderr quoted in an error message."""


class StorageError(Exception):
    """A storage operation failed; ``str(exc)`` is a clear message, ``kind`` its class."""

    def __init__(self, message: str, kind: ErrorKind = "failed") -> None:
        super().__init__(message)
        self.message = message
        self.kind: ErrorKind = kind

    @property
    def status(self) -> int:
        """The HTTP status this error maps to."""
        return {"invalid": 400, "not_found": 404, "conflict": 409, "failed": 502}[self.kind]


class ToolError(StorageError):
    """The tool ran and exited with a failure status (its stderr is in the message)."""

    def __init__(self, message: str, returncode: int) -> None:
        super().__init__(message, "failed")
        self.returncode = returncode


def _tail(text: str) -> str:
    text = text.strip()
    return text if len(text) <= STDERR_TAIL else "..." + text[-STDERR_TAIL:]


async def _reap(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    await proc.wait()


async def run_tool(
    argv: Sequence[str], timeout_s: float, what: str, ok_codes: tuple[int, ...] = (0,)
) -> str:
    """Run ``argv`` to completion; its stdout, or StorageError naming ``what`` on failure.

    An exit status outside ``ok_codes`` is a failure (``qemu-img check`` exits 3 for
    leaked clusters only, which is harmless).

    A missing binary, a non-zero exit and a timeout are all StorageError ("failed"); the
    child is killed and reaped on a timeout or a cancellation, never left behind.
    """
    env = dict(os.environ, LC_ALL="C")
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
    except OSError as exc:
        raise StorageError(f"{what}: cannot run {argv[0]}: {exc}") from exc
    try:
        out, err = await within(proc.communicate(), timeout_s)
    except TimeoutError:
        await _reap(proc)
        raise StorageError(f"{what}: {argv[0]} timed out after {timeout_s:g}s") from None
    except asyncio.CancelledError:
        await asyncio.shield(_reap(proc))
        raise
    if proc.returncode not in ok_codes:
        detail = _tail(err.decode(errors="replace")) or "(no message)"
        raise ToolError(
            f"{what}: {shlex.join(argv[:2])} exited {proc.returncode}: {detail}",
            proc.returncode or 0,
        )
    return out.decode(errors="replace")
