"""Pure helpers around qemu-img and mke2fs: names, command lines, parsing their JSON.

Nothing here runs a process or touches a file: :mod:`images` and :mod:`volumes` do the
I/O. Problems are ``ValueError`` with a clear message (the callers wrap them into
StorageError).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

IMAGE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")
"""proto.provision.ImageName: also a file name, so no '/' and no leading '.'."""
VOLUME_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}\Z")
"""proto.provision.VolumeName."""
TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}\Z")
"""proto.provision.TenantName."""

QCOW2_MAGIC = b"QFI\xfb"
SECTOR = 512
MIN_DIR_IMAGE_BYTES = 4 * 1024 * 1024
"""The smallest file system :func:`mke2fs_argv` is asked to make (ext4 with a journal)."""
MAX_DIR_IMAGE_BYTES = 16 * 1024**4
"""16 TiB: a sanity bound (the raw file is sparse, only the data takes space)."""

Format = Literal["qcow2", "raw"]


def check_name(kind: str, name: str, pattern: re.Pattern[str]) -> str:
    """``name`` if it matches ``pattern`` (one of the *_NAME above), else ValueError."""
    if not isinstance(name, str) or not pattern.match(name):
        raise ValueError(
            f"invalid {kind} name {name!r}: it must match {pattern.pattern[1:-2]} "
            "(letters, digits and '_', '-'"
            + ("" if pattern is TENANT_NAME else ", '.'")
            + ", starting with a letter or digit)"
        )
    return name


def sniff_format(head: bytes) -> Format:
    """The format of an uploaded file from its first bytes: qcow2 by its magic, else raw.

    qemu-img is never left to probe an untrusted file (a probed vmdk/vpc/... could name
    other files of the host): anything that is not qcow2 is opened as raw bytes.
    """
    return "qcow2" if head[:4] == QCOW2_MAGIC else "raw"


@dataclass(frozen=True)
class ImageInfo:
    """What ``qemu-img info --output=json`` says of one image file."""

    format: str
    virtual_size: int
    actual_size: int
    backing_file: str = ""
    backing_format: str = ""
    data_file: str = ""
    encrypted: bool = False
    corrupt: bool = False
    dirty: bool = False
    cluster_size: int = 0


def _int(doc: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = doc.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"qemu-img info: {key!r} is not a non-negative integer: {value!r}")
    return value


def parse_info(text: str | bytes) -> ImageInfo:
    """Parse ``qemu-img info --output=json`` (one image, not ``--backing-chain``)."""
    try:
        doc = msgspec.json.decode(text)
    except msgspec.DecodeError as exc:
        raise ValueError(f"qemu-img info: not JSON: {exc}") from None
    if isinstance(doc, list):  # --backing-chain: the top image comes first
        doc = doc[0] if doc else None
    if not isinstance(doc, dict):
        raise ValueError("qemu-img info: expected a JSON object")
    fmt = doc.get("format")
    if not isinstance(fmt, str) or not fmt:
        raise ValueError("qemu-img info: no 'format'")
    specific = doc.get("format-specific") or {}
    data = specific.get("data") if isinstance(specific, dict) else None
    data = data if isinstance(data, dict) else {}
    return ImageInfo(
        format=fmt,
        virtual_size=_int(doc, "virtual-size"),
        actual_size=_int(doc, "actual-size", 0),
        backing_file=str(doc.get("backing-filename") or ""),
        backing_format=str(doc.get("backing-filename-format") or ""),
        data_file=str(data.get("data-file") or ""),
        encrypted=bool(doc.get("encrypted", False)),
        corrupt=bool(data.get("corrupt", False)),
        dirty=bool(doc.get("dirty-flag", False)),
        cluster_size=_int(doc, "cluster-size", 0),
    )


def check_upload(info: ImageInfo, expected: Format, file_size: int) -> None:
    """ValueError listing every reason an uploaded file cannot be a base image.

    A base must stand alone (no backing file, no external data file: either could make
    the storage host read another of its files), be unencrypted, not flagged corrupt,
    present a non-empty disk and, as raw, be a whole number of 512-byte sectors
    (``file_size``: qemu-img rounds a raw file's virtual size up, hiding a stray tail).
    """
    problems: list[str] = []
    if info.format != expected:
        problems.append(f"qemu-img reads it as {info.format}, expected {expected}")
    if info.backing_file:
        problems.append(f"it has a backing file ({info.backing_file!r}); upload a flat image")
    if info.data_file:
        problems.append(f"it has an external data file ({info.data_file!r})")
    if info.encrypted:
        problems.append("it is encrypted")
    if info.corrupt:
        problems.append("qcow2 marks it corrupt")
    if info.virtual_size == 0:
        problems.append("its disk is empty (virtual size 0)")
    elif expected == "raw" and file_size % SECTOR:
        problems.append(f"as a raw disk its size {file_size} is not a multiple of {SECTOR} bytes")
    if problems:
        raise ValueError("not a usable base image: " + "; ".join(problems))


def parse_check(text: str | bytes) -> tuple[int, int]:
    """``(corruptions, check_errors)`` from ``qemu-img check --output=json``."""
    try:
        doc = msgspec.json.decode(text)
    except msgspec.DecodeError as exc:
        raise ValueError(f"qemu-img check: not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ValueError("qemu-img check: expected a JSON object")
    return _int(doc, "corruptions", 0), _int(doc, "check-errors", 0)


def check_dir_size(size_bytes: int) -> int:
    """The file system size for a directory image, rounded up to a whole MiB."""
    if isinstance(size_bytes, bool) or not isinstance(size_bytes, int):
        raise ValueError(f"size_bytes must be an integer, not {size_bytes!r}")
    if size_bytes < MIN_DIR_IMAGE_BYTES:
        raise ValueError(
            f"size_bytes {size_bytes} is too small: at least {MIN_DIR_IMAGE_BYTES} (4 MiB)"
        )
    if size_bytes > MAX_DIR_IMAGE_BYTES:
        raise ValueError(f"size_bytes {size_bytes} is over the limit of {MAX_DIR_IMAGE_BYTES}")
    mib = 1024 * 1024
    return -(-size_bytes // mib) * mib


def mke2fs_argv(raw_file: str, directory: str, label: str) -> list[str]:
    """Make an ext4 file system in ``raw_file`` (already sized) populated from ``directory``.

    The root directory is owned by root whoever runs it; ``-F`` because the target is a
    regular file, ``-q`` for a quiet run (errors still go to stderr).
    """
    return [
        "mke2fs",
        "-q",
        "-F",
        "-t",
        "ext4",
        "-L",
        label[:16],
        "-E",
        "root_owner=0:0",
        "-d",
        directory,
        raw_file,
    ]


def convert_argv(src: str, src_format: Format, dst: str) -> list[str]:
    """Convert ``src`` (its format given, never probed) into a standalone qcow2 ``dst``."""
    return ["qemu-img", "convert", "-q", "-f", src_format, "-O", "qcow2", src, dst]


def info_argv(path: str, fmt: Format, force_share: bool = False) -> list[str]:
    """``qemu-img info`` as JSON, the format given (``-U``: read an image that is in use)."""
    return ["qemu-img", "info", *(["-U"] if force_share else []), "--output=json", "-f", fmt, path]


def check_argv(path: str) -> list[str]:
    """``qemu-img check`` of a qcow2 file, as JSON (exit 0 clean, 3 leaks only)."""
    return ["qemu-img", "check", "--output=json", "-f", "qcow2", path]


def overlay_argv(backing: str, dst: str) -> list[str]:
    """A copy-on-write qcow2 overlay ``dst`` over the qcow2 ``backing``.

    ``backing`` is written into the overlay as given: relative paths are resolved from
    the overlay's directory, so a data dir can move as a whole.
    """
    return ["qemu-img", "create", "-q", "-f", "qcow2", "-b", backing, "-F", "qcow2", dst]
