"""Is a directory fit to mount the dataset cache on? And clearing a dead mount.

A cache process killed with SIGKILL cannot unmount: the kernel keeps its FUSE mount,
and every access to it fails with ENOTCONN ("Transport endpoint is not connected").
:func:`check_mountpoint` tells that apart from a live mount (in use: refused) and from
a plain directory; :func:`clear_dead_mount` detaches the dead one lazily
(``fusermount3 -uz``, else ``umount -l``) so the next mount can take its place.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
from enum import Enum

DEAD_ERRNOS = (errno.ENOTCONN, errno.ECONNABORTED)
"""What stat(2) of a FUSE mount whose process died answers."""


class MountpointError(Exception):
    """The mountpoint cannot be used (its message says why and what to do)."""


class State(Enum):
    """What :func:`check_mountpoint` found."""

    FREE = "free"
    """An existing directory, not a mount point: ready."""
    DEAD = "dead"
    """A FUSE mount whose process is gone (ENOTCONN): clear it first."""


def check_mountpoint(path: str) -> State:
    """FREE or DEAD; MountpointError for a missing path, a non-directory or a live mount."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise MountpointError(f"mountpoint {path}: no such directory (create it first)") from None
    except OSError as e:
        if e.errno in DEAD_ERRNOS:
            return State.DEAD
        raise MountpointError(f"mountpoint {path}: {e.strerror or e}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise MountpointError(f"mountpoint {path}: not a directory")
    if os.path.ismount(path):
        try:  # statfs always asks the file system (stat may answer from cached attributes)
            os.statvfs(path)
        except OSError as e:
            if e.errno in DEAD_ERRNOS:
                return State.DEAD
        raise MountpointError(
            f"mountpoint {path}: in use (something is mounted there; "
            f"unmount it or pick another directory)"
        )
    return State.FREE


def clear_dead_mount(path: str) -> str:
    """Lazily unmount the dead mount at ``path``; return the command that did it.

    MountpointError when no tool succeeds or ``path`` is still not a free directory."""
    attempts = []
    for tool, args in (("fusermount3", ["-uz"]), ("fusermount", ["-uz"]), ("umount", ["-l"])):
        exe = shutil.which(tool)
        if exe is None:
            continue
        command = [exe, *args, path]
        result = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
        if result.returncode == 0:
            if check_mountpoint(path) is State.FREE:
                return " ".join([tool, *args, path])
            attempts.append(f"{tool}: still not free")
            continue
        attempts.append(f"{tool}: {result.stderr.strip() or f'exit {result.returncode}'}")
    tried = "; ".join(attempts) or "no fusermount3, fusermount or umount found"
    raise MountpointError(f"mountpoint {path}: a dead FUSE mount could not be cleared ({tried})")


def is_within(path: str, directory: str) -> bool:
    """Whether ``path`` is ``directory`` or inside it (both resolved)."""
    p = os.path.realpath(path)
    d = os.path.realpath(directory)
    return p == d or p.startswith(d.rstrip("/") + "/")
