"""A Debian kernel and some of its modules for the QEMU VM tests, kept in a cache that
outlives test runs.

Debian's generic kernel (``linux-image-amd64``'s dependency) builds ``rdma_rxe`` (the
Soft-RoCE VM, tests/support/harness/rxe_vm.py) as a module; the cloud kernel
(``linux-image-cloud-amd64``'s: what the provisioning VM, tests/support/harness/provision_vm.py,
boots) builds no ``rdma_rxe`` and no ``e1000``, but ``virtio_net`` and ``nbd`` as modules
and ext4 in.  The package is downloaded once per :class:`KernelSpec`
with ``apt-get download`` and only what the VM boots is kept: the kernel and the modules
the VM loads, in dependency order (the package ships no ``modules.dep``: the order comes
from each module's ``.modinfo``).  The kernel is kept either as its ELF ``vmlinux``
(unpacked from the bzImage: QEMU's ``-kernel`` starts it through the PVH entry point
without the slow decompression under emulation) or as the bzImage itself (what a network
boot loader such as iPXE loads).
The cache is ``$METALGUARD_TEST_CACHE``, else ``$XDG_CACHE_HOME/metalguard-test``, else
``~/.cache/metalguard-test``; a cached kernel is used as it is, without apt.
"""

from __future__ import annotations

import json
import lzma
import os
import re
import shutil
import struct
import subprocess
import tarfile
import tempfile
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

META_PACKAGE = "linux-image-amd64"
ROOT_MODULES = ("crc32_generic", "dummy", "rdma_rxe")
"""What the rxe VM loads: Soft-RoCE, a netdev for it, and the crc32 its ICRC needs (asked
of the crypto API, which would call a modprobe the VM does not have)."""

MANIFEST = "kernel.json"
APT_TIMEOUT_S = 300.0
EXTRACT_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class KernelSpec:
    """What one VM needs of the kernel package: where it is cached, the modules it loads
    (with their dependencies) and the form of the kernel image."""

    store: str
    """The cache's sub-directory (one per spec: each keeps its own modules)."""
    roots: tuple[str, ...]
    unpack_vmlinux: bool = True
    """Keep the ELF ``vmlinux`` unpacked from the bzImage (for ``-kernel``); False: keep
    the bzImage as ``vmlinuz`` (for a boot loader)."""
    meta: str = META_PACKAGE
    """The meta package whose kernel image dependency is fetched."""


RXE = KernelSpec("rxe-kernel", ROOT_MODULES)
"""The Soft-RoCE VM's kernel (tests/support/harness/rxe_vm.py)."""


class NoKernelError(Exception):
    """No usable kernel here; the message says why (the test skips with it)."""


@dataclass(frozen=True, slots=True)
class Kernel:
    """A cached kernel: its image and the modules to load, in order."""

    package: str
    image: Path
    modules: tuple[Path, ...]


def cache_root() -> Path:
    """The directory that survives between test runs."""
    if explicit := os.environ.get("METALGUARD_TEST_CACHE"):
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "metalguard-test"


def ensure_kernel(cache: Path, spec: KernelSpec = RXE) -> Kernel:
    """The cached kernel of ``spec``, fetched and unpacked first when there is none;
    NoKernelError when it cannot be had (no apt, no network, no such module in the
    package)."""
    store = cache / spec.store
    cached = sorted(store.glob(f"*/{MANIFEST}"))
    if cached:
        return _load(cached[-1].parent)
    package = kernel_package(spec.meta)
    store.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=store, prefix=".partial-") as work:
        deb = _download(package, Path(work))
        staged = Path(work) / "kernel"
        _unpack(deb, staged, spec)
        deb.unlink()
        final = store / package
        if not final.exists():
            staged.rename(final)  # atomic: a half-written kernel is never "cached"
    return _load(final)


def _load(folder: Path) -> Kernel:
    manifest = json.loads((folder / MANIFEST).read_text())
    return Kernel(
        package=manifest["package"],
        image=folder / manifest["image"],
        modules=tuple(folder / "modules" / m for m in manifest["modules"]),
    )


def _run(args: list[str], timeout_s: float, cwd: Path | None = None) -> str:
    """A command's stdout; NoKernelError naming it when it is missing, fails or hangs."""
    if shutil.which(args[0]) is None:
        raise NoKernelError(f"{args[0]} not found (a Debian host with apt is needed)")
    try:
        done = subprocess.run(
            args, cwd=cwd, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        raise NoKernelError(f"{' '.join(args)} took more than {timeout_s:.0f}s") from None
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise NoKernelError(f"{' '.join(args)} failed ({done.returncode}): {' / '.join(tail)}")
    return done.stdout


def kernel_package(meta: str = META_PACKAGE) -> str:
    """The versioned image package ``meta`` depends on (NoKernelError else)."""
    out = _run(["apt-cache", "depends", meta], 60)
    return package_from_depends(out, meta)


def package_from_depends(apt_cache_output: str, meta: str = META_PACKAGE) -> str:
    """``linux-image-6.1.0-50-amd64`` from ``apt-cache depends linux-image-amd64``."""
    match = re.search(r"^\s*Depends:\s*(linux-image-[\w.+-]+)\s*$", apt_cache_output, re.M)
    if match is None:
        raise NoKernelError(f"no kernel image among the dependencies of {meta}")
    return match[1]


def _download(package: str, folder: Path) -> Path:
    _run(["apt-get", "download", "-q", package], APT_TIMEOUT_S, cwd=folder)
    debs = sorted(folder.glob(f"{package}_*.deb"))
    if not debs:
        raise NoKernelError(f"apt-get download {package} left no .deb")
    return debs[0]


def _members(deb: Path) -> Iterator[tuple[tarfile.TarInfo, IO[bytes] | None]]:
    """The package's files, streamed from ``dpkg-deb --fsys-tarfile`` (never unpacked
    whole: the generic kernel's modules take 400 MB)."""
    if shutil.which("dpkg-deb") is None:
        raise NoKernelError("dpkg-deb not found")
    proc = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(deb)], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
            for info in tar:
                yield info, tar.extractfile(info) if info.isfile() else None
    except tarfile.TarError as exc:
        raise NoKernelError(f"{deb.name} does not unpack: {exc}") from None
    finally:
        proc.kill()
        proc.wait(EXTRACT_TIMEOUT_S)


def _unpack(deb: Path, dest: Path, spec: KernelSpec) -> None:
    """Keep the image and the modules the VM loads (two streaming passes: the first
    learns every module's dependencies, the second copies the ones needed)."""
    (dest / "modules").mkdir(parents=True)
    depends: dict[str, tuple[str, ...]] = {}
    member_of: dict[str, str] = {}
    image = ""
    for info, data in _members(deb):
        if data is None:
            continue
        if re.fullmatch(r"\./boot/vmlinuz-.*", info.name):
            image = _write_image(data.read(), dest, spec.unpack_vmlinux)
        elif info.name.endswith(".ko"):
            name, deps = modinfo_depends(data.read())
            name = name or Path(info.name).stem.replace("-", "_")
            depends[name] = deps
            member_of[name] = info.name
    if not image:
        raise NoKernelError(f"{deb.name} holds no /boot/vmlinuz-*")
    order = load_order(spec.roots, depends)
    wanted = {member_of[m]: m for m in order}
    for info, data in _members(deb):
        if data is not None and info.name in wanted:
            (dest / "modules" / f"{wanted[info.name]}.ko").write_bytes(data.read())
    manifest = {
        "package": deb.name.split("_")[0],
        "image": image,
        "modules": [f"{m}.ko" for m in order],
    }
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=1))


def _write_image(bzimage: bytes, dest: Path, unpack: bool) -> str:
    """Store the ELF vmlinux unpacked from a bzImage (``unpack``), or the bzImage itself
    when not asked to or when its payload is in a compression this cannot undo; the
    stored file's name."""
    vmlinux = vmlinux_from_bzimage(bzimage) if unpack else None
    if vmlinux is not None:
        (dest / "vmlinux").write_bytes(vmlinux)
        return "vmlinux"
    (dest / "vmlinuz").write_bytes(bzimage)
    return "vmlinuz"


def vmlinux_from_bzimage(bzimage: bytes) -> bytes | None:
    """The ELF kernel inside a bzImage (boot protocol 2.08+: payload_offset and
    payload_length in the setup header), for xz and gzip payloads; None otherwise."""
    if len(bzimage) < 0x250 or bzimage[0x202:0x206] != b"HdrS":
        return None
    setup_sects = bzimage[0x1F1] or 4
    offset, length = struct.unpack_from("<II", bzimage, 0x248)
    start = (setup_sects + 1) * 512 + offset
    payload = bzimage[start : start + length]
    try:
        if payload.startswith(b"\xfd7zXZ\x00"):
            out = lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(payload)
        elif payload.startswith(b"\x1f\x8b"):
            out = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(payload)
        else:
            return None
    except (lzma.LZMAError, zlib.error):
        return None
    return out if out.startswith(b"\x7fELF") else None


def modinfo(ko: bytes) -> dict[str, str]:
    """The ``key=value`` strings of a module's ``.modinfo`` section (ELF64 little-endian;
    empty for anything else)."""
    if ko[:6] != b"\x7fELF\x02\x01":
        return {}
    shoff = struct.unpack_from("<Q", ko, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", ko, 0x3A)

    def section(index: int) -> tuple[int, int, int]:
        name, _type, _flags, _addr, off, size = struct.unpack_from(
            "<IIQQQQ", ko, shoff + index * shentsize
        )
        return name, off, size

    _, str_off, _ = section(shstrndx)
    for index in range(shnum):
        name, off, size = section(index)
        end = ko.index(b"\0", str_off + name)
        if ko[str_off + name : end] == b".modinfo":
            fields = (f.decode(errors="replace") for f in ko[off : off + size].split(b"\0"))
            return dict(f.split("=", 1) for f in fields if "=" in f)
    return {}


def modinfo_depends(ko: bytes) -> tuple[str, tuple[str, ...]]:
    """A module's name ("" when it does not say) and the modules it needs."""
    info = modinfo(ko)
    deps = tuple(d for d in info.get("depends", "").split(",") if d)
    return info.get("name", ""), deps


def load_order(roots: tuple[str, ...], depends: Mapping[str, tuple[str, ...]]) -> list[str]:
    """``roots`` and everything they need, each after its dependencies; NoKernelError
    naming a module the package does not have."""
    order: list[str] = []

    def visit(name: str, path: tuple[str, ...]) -> None:
        if name in order:
            return
        if name not in depends:
            needed_by = f" (needed by {path[-1]})" if path else ""
            raise NoKernelError(f"the kernel package has no module {name}{needed_by}")
        if name in path:
            raise NoKernelError(f"module dependency cycle: {' -> '.join((*path, name))}")
        for dep in depends[name]:
            visit(dep, (*path, name))
        order.append(name)

    for root in roots:
        visit(root, ())
    return order
