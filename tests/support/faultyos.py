"""Fault injection at the OS-call boundary of :class:`agent.sysfs.SysfsReader`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from metalguard.agent.sysfs import OsCalls


@dataclass
class FaultyOs:
    """Real os.open/read/close, except that paths ending in a given suffix fail.

    ``open_errors`` fail the open, ``read_errors`` fail every read, ``pread_errors`` fail
    every ``pread`` (a kept descriptor: kernfs answers ENODEV once its attribute is
    removed) and ``list_errors`` fail listing a directory, with that errno.
    Records the bytes each read asked for and returned, the paths it was asked to open
    and to list,
    the preads, and the fds left open.  The tables may be changed between scans.
    """

    open_errors: dict[str, int] = field(default_factory=dict)
    read_errors: dict[str, int] = field(default_factory=dict)
    pread_errors: dict[str, int] = field(default_factory=dict)
    list_errors: dict[str, int] = field(default_factory=dict)
    requested: list[int] = field(default_factory=list)
    returned: list[int] = field(default_factory=list)
    opened: list[str] = field(default_factory=list)
    listed: list[str] = field(default_factory=list)
    preads: list[str] = field(default_factory=list)
    open_fds: dict[int, str] = field(default_factory=dict)

    def calls(self) -> OsCalls:
        """The OsCalls to give the reader."""
        return OsCalls(
            open=self._open,
            read=self._read,
            close=self._close,
            listdir=self._listdir,
            pread=self._pread,
        )

    @staticmethod
    def _match(path: str, table: Mapping[str, int]) -> int | None:
        for suffix, err in table.items():
            if path.endswith(suffix):
                return err
        return None

    def _open(self, path: str, flags: int) -> int:
        self.opened.append(path)
        err = self._match(path, self.open_errors)
        if err is not None:
            raise OSError(err, os.strerror(err), path)
        fd = os.open(path, flags)
        self.open_fds[fd] = path
        return fd

    def _read(self, fd: int, size: int) -> bytes:
        self.requested.append(size)
        err = self._match(self.open_fds.get(fd, ""), self.read_errors)
        if err is not None:
            raise OSError(err, os.strerror(err))
        data = os.read(fd, size)
        self.returned.append(len(data))
        return data

    def _pread(self, fd: int, size: int, offset: int) -> bytes:
        path = self.open_fds.get(fd, "")
        self.preads.append(path)
        err = self._match(path, self.pread_errors) or self._match(path, self.read_errors)
        if err is not None:
            raise OSError(err, os.strerror(err))
        return os.pread(fd, size, offset)

    def _close(self, fd: int) -> None:
        self.open_fds.pop(fd, None)
        os.close(fd)

    def _listdir(self, path: str) -> list[str]:
        self.listed.append(path)
        err = self._match(path, self.list_errors)
        if err is not None:
            raise OSError(err, os.strerror(err), path)
        return os.listdir(path)
