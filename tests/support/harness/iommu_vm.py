"""A QEMU q35 guest whose PCI topology and IOMMU groups come back as a sysfs/procfs tree,
for the tests of what reads them (IOMMU groups, ACS, the PCIe hierarchy).

The guest boots Debian's cloud kernel (the provisioning VM's, shared cache:
tests/support/harness/rxe_kernel.py; it has the Intel IOMMU driver built in) straight
from ``-kernel`` with an initramfs of busybox and iommu_guest/init, under TCG (nested
KVM is not used on these hosts), with or without an emulated VT-d unit
(``-device intel-iommu`` and ``intel_iommu=on iommu=nopt``).  Behind the root complex:

- root port ``rp1`` (00:01.0) -> switch upstream port ``up1`` (01:00.0) -> downstream
  ports ``dn1`` (02:00.0) and ``dn2`` (02:01.0) -> an e1000e on each (03:00.0, 04:00.0);
- root port ``rp2`` (00:02.0) -> a ``virtio-vga`` (05:00.0, class 0x030000: the "GPU",
  a PCIe endpoint; QEMU's plain ``VGA`` would be a conventional PCI function with 256
  bytes of config space and no capabilities at all).

No driver binds to anything: sysfs's config files and IOMMU groups need none.  The
guest's init reads its sysfs and sends it over the second serial port; :func:`decode`
rebuilds it under ``<work>/<name>/``: ``proc/cmdline``, ``sys/devices/pci0000:00/...``
(each function's directory under its bridge's, with ``config`` (all of it, as root
reads it), ``class``, ``vendor``, ``device``, ... and the ``iommu_group`` link),
``sys/bus/pci/devices/<bdf>``, ``sys/class/iommu/<unit>`` and
``sys/kernel/iommu_groups/<n>/{type,devices/<bdf>}``; every link is the kernel's own,
relative one.  A boot takes 7-13 s (the guest's init is done ~6 s after the start).

What the guest shows (QEMU 7.2, Debian's 6.1 kernel): the root ports have an ACS
extended capability (at 0x148; capability 0x005f, control 0x001d with the IOMMU, where
the kernel enables SV/RR/CR/UF, 0x0000 without), the switch's ports none, so each e1000e
shares its group with the downstream port above it.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.harness.provision_vm import CLOUD, _cpio, _die_with_parent, _static
from tests.support.harness.rxe_kernel import (
    Kernel,
    NoKernelError,
    cache_root,
    ensure_kernel,
)

QEMU = "qemu-system-x86_64"
INIT = Path(__file__).with_name("iommu_guest") / "init"
KERNEL = CLOUD.spec
"""The provisioning VM's kernel (one cached copy for both): Debian's cloud kernel as a
bzImage (LZ4: unpacked at once even under TCG), CONFIG_INTEL_IOMMU built in."""
KERNEL_ARGS = "console=ttyS0 quiet panic=-1 cryptomgr.notests rodata=off"
"""No ``acpi=off`` (unlike rxe_vm): the DMAR table and the MCFG (the extended config
space) are ACPI's.  ``panic=-1`` with ``-no-reboot``: a panic ends QEMU at once."""
IOMMU_ARGS = "intel_iommu=on iommu=nopt"
IOMMU_DEVICE = ["-device", "intel-iommu"]
"""First on the command line: QEMU wants the IOMMU before the PCI devices it covers."""
DEVICES = [
    "-device", "pcie-root-port,id=rp1,chassis=1,slot=1",
    "-device", "x3130-upstream,id=up1,bus=rp1",
    "-device", "xio3130-downstream,id=dn1,bus=up1,chassis=2,slot=0",
    "-device", "xio3130-downstream,id=dn2,bus=up1,chassis=3,slot=1",
    "-device", "e1000e,id=nic1,bus=dn1,romfile=",
    "-device", "e1000e,id=nic2,bus=dn2,romfile=",
    "-device", "pcie-root-port,id=rp2,chassis=4,slot=2",
    "-device", "virtio-vga,id=gpu,bus=rp2,romfile=",
]  # fmt: skip
"""The emulated topology (no option ROMs: nothing boots from them, and no firmware
package is needed)."""
DIRECT_DEVICES = [
    "-device", "pcie-root-port,id=rp1,chassis=1,slot=1",
    "-device", "e1000e,id=nic1,bus=rp1,romfile=",
    "-device", "pcie-root-port,id=rp2,chassis=2,slot=2",
    "-device", "e1000e,id=nic2,bus=rp2,romfile=",
    "-device", "pcie-root-port,id=rp3,chassis=3,slot=3",
    "-device", "virtio-vga,id=gpu,bus=rp3,romfile=",
]  # fmt: skip
"""Each device behind a root port of its own (no switch): root ports with ACS, so the
kernel gives each device a group of its own."""
MEMORY_MB = 256
DEFAULT_TIMEOUT_S = 240.0
TREE_TOPS = ("sys", "proc")
"""The only top directories a path the guest sends may be under."""


class GuestError(Exception):
    """The guest did not send a whole snapshot (the message has its console's end)."""


@dataclass(frozen=True, slots=True)
class GuestSnapshot:
    """What one boot of the guest sent."""

    root: Path
    """The rebuilt tree: ``root/sys/...``, ``root/proc/cmdline``."""
    groups: dict[str, tuple[str, ...]]
    """The guest kernel's IOMMU groups: group number -> its devices' BDFs, sorted (what
    ``ls /sys/kernel/iommu_groups/*/devices`` lists); empty without an IOMMU."""
    cmdline: str
    """The guest's /proc/cmdline, stripped."""
    dmesg_iommu: str
    """``dmesg | grep -i -e DMAR -e IOMMU`` in the guest."""
    wall_s: float = 0.0
    """The boot's wall time, QEMU's start to its end."""
    console: str = field(default="", repr=False)
    """The guest's console (ttyS0)."""
    timings: dict[str, float] = field(default_factory=dict)
    """The guest's uptime after each step of its init (``init``, ``pci``, ``groups``,
    ``done``)."""


def missing() -> str | None:
    """Why the guest cannot be booted here (what to install, or why there is no kernel),
    or None.  The first call may download the kernel (apt, once: cache_root())."""
    absent = []
    if shutil.which(QEMU) is None:
        absent.append("qemu-system-x86")
    busybox = shutil.which("busybox")
    if busybox is None or not _static(Path(busybox)):
        absent.append("busybox-static")
    if absent:
        return f"not installed: {', '.join(absent)} (tests/ensure-tools.sh)"
    try:
        ensure_kernel(cache_root(), KERNEL)
    except NoKernelError as exc:
        return f"no guest kernel: {exc}"
    return None


def build_initramfs(work: Path) -> Path:
    """The guest's initramfs (an uncompressed newc cpio: busybox and the init)."""
    root = work / "initramfs"
    (root / "bin").mkdir(parents=True, exist_ok=True)
    shutil.copy(str(shutil.which("busybox")), root / "bin/busybox")
    shutil.copy(INIT, root / "init")
    for program in ("init", "bin/busybox"):
        (root / program).chmod(0o755)
    cpio = work / "initrd.cpio"
    _cpio(root, cpio)
    return cpio


def qemu_args(
    kernel: Kernel,
    initrd: Path,
    console: Path,
    data: Path,
    *,
    iommu: bool,
    devices: list[str] = DEVICES,
    iommu_args: str = IOMMU_ARGS,
) -> list[str]:
    """The guest's command line (its console on ``console``, its data port on ``data``)."""
    append = f"{KERNEL_ARGS} {iommu_args}" if iommu else KERNEL_ARGS
    return [
        QEMU, "-machine", "q35", "-accel", "tcg", "-m", str(MEMORY_MB), "-smp", "1",
        "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot", "-nic", "none",
        *(IOMMU_DEVICE if iommu else []), *devices,
        "-kernel", str(kernel.image), "-initrd", str(initrd), "-append", append,
        "-serial", f"file:{console}", "-serial", f"file:{data}",
    ]  # fmt: skip


def snapshot(
    work: Path,
    *,
    iommu: bool,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    devices: list[str] = DEVICES,
    iommu_args: str = IOMMU_ARGS,
    name: str = "",
) -> GuestSnapshot:
    """Boot the guest once (with the emulated IOMMU or without; ``devices``: the PCI
    topology, ``iommu_args``: the kernel's IOMMU arguments) and rebuild what it sent under
    ``work/<name>/`` (default ``iommu`` or ``no-iommu``).  QEMU is killed at ``timeout_s``
    at the latest (and dies with this process); GuestError when the guest's data is not
    whole."""
    name = name or ("iommu" if iommu else "no-iommu")
    work = work / name
    work.mkdir(parents=True, exist_ok=True)
    kernel = ensure_kernel(cache_root(), KERNEL)
    initrd = build_initramfs(work)
    console, data = work / "console.log", work / "data.log"
    args = qemu_args(
        kernel, initrd, console, data, iommu=iommu, devices=devices, iommu_args=iommu_args
    )
    (work / "qemu.args").write_text(" ".join(args) + "\n")
    started = time.monotonic()
    proc = subprocess.Popen(
        args,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=_die_with_parent,
    )
    timed_out = False
    try:
        try:
            _, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.kill()
            _, err = proc.communicate()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    wall_s = time.monotonic() - started
    console_text = _text(console)
    shutil.rmtree(work / "root", ignore_errors=True)  # a fresh tree, not an earlier one's
    try:
        decoded = decode(_text(data), work / "root")
    except ValueError as exc:
        raise GuestError(f"{name} guest sent a bad record: {exc}\n{_tail(console_text)}") from None
    if not decoded.done:
        why = f"killed after {timeout_s:.0f}s" if timed_out else f"QEMU exited {proc.returncode}"
        stderr = err.decode(errors="replace").strip()[-800:]
        raise GuestError(
            f"{name} guest did not finish its snapshot ({why}); QEMU: {stderr}\n"
            f"{_tail(console_text)}"
        )
    if decoded.failures:
        raise GuestError(f"{name} guest: {'; '.join(decoded.failures)}\n{_tail(console_text)}")
    return GuestSnapshot(
        root=work / "root",
        groups=decoded.groups,
        cmdline=decoded.blobs.get("/proc/cmdline", b"").decode(errors="replace").strip(),
        dmesg_iommu=decoded.blobs.get("dmesg_iommu", b"").decode(errors="replace"),
        wall_s=wall_s,
        console=console_text,
        timings=decoded.timings,
    )


def _text(path: Path) -> str:
    return path.read_bytes().decode(errors="replace") if path.exists() else ""


def _tail(console: str, lines: int = 25) -> str:
    return "--- console:\n" + "\n".join(console.splitlines()[-lines:])


@dataclass
class Decoded:
    """The data port's records, with the tree written."""

    groups: dict[str, tuple[str, ...]] = field(default_factory=dict)
    blobs: dict[str, bytes] = field(default_factory=dict)
    """Each ``@@F`` file's and ``@@X`` blob's bytes, by its guest path or name."""
    timings: dict[str, float] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    done: bool = False


_RECORD = re.compile(r"@@(\w+)(?: (.*))?")


def decode(data: str, root: Path) -> Decoded:
    """Parse the guest's data port (the records iommu_guest/init documents) and write its
    tree under ``root``; ValueError on a path outside sys/ and proc/, a link that leads
    out of ``root`` or base64 that does not decode."""
    out = Decoded()
    root.mkdir(parents=True, exist_ok=True)
    blob: str | None = None
    chunks: list[str] = []
    for raw in data.splitlines():
        line = raw.rstrip("\r")
        match = _RECORD.fullmatch(line)
        if blob is not None:
            if match is None:
                chunks.append(line.strip())
                continue
            if match[1] != "E":
                raise ValueError(f"{blob}: {line!r} before its @@E")
            try:
                content = base64.b64decode("".join(chunks), validate=True)
            except binascii.Error as exc:
                raise ValueError(f"{blob}: {exc}") from None
            out.blobs[blob] = content
            if blob.startswith("/"):
                copy = _inside(root, blob)
                copy.parent.mkdir(parents=True, exist_ok=True)
                copy.write_bytes(content)
            blob, chunks = None, []
            continue
        if match is None:
            continue  # noise (there is none on ttyS1, but be lenient)
        word, rest = match[1], match[2] or ""
        if word in ("F", "X"):
            blob, chunks = rest, []
        elif word == "D":
            _inside(root, rest).mkdir(parents=True, exist_ok=True)
        elif word == "L":
            path, _, link_target = rest.partition(" ")
            _link(root, path, link_target)
        elif word == "G":
            number, *members = rest.split()
            out.groups[number] = tuple(sorted(members))
        elif word == "TIME":
            step, _, seconds = rest.partition(" ")
            out.timings[step] = float(seconds)
        elif word == "FAIL":
            out.failures.append(rest)
        elif word == "DONE":
            out.done = True
    if blob is not None:
        out.done = False  # cut off inside a file
    return out


def _inside(root: Path, guest_path: str) -> Path:
    """``root``'s copy of the guest's absolute ``guest_path`` (under sys/ or proc/)."""
    parts = guest_path.split("/")
    if (
        not guest_path.startswith("/")
        or len(parts) < 3
        or parts[1] not in TREE_TOPS
        or any(p in ("", ".", "..") for p in parts[1:])
    ):
        raise ValueError(f"not a sysfs/procfs path: {guest_path!r}")
    return root.joinpath(*parts[1:])


def _link(root: Path, guest_path: str, target: str) -> None:
    """The guest's symlink, its target as the guest's readlink gave it (relative)."""
    path = _inside(root, guest_path)
    if not target or target.startswith("/"):
        raise ValueError(f"{guest_path}: not a relative link target: {target!r}")
    lands = os.path.normpath(os.path.join(path.parent, target))
    if not Path(lands).is_relative_to(root):
        raise ValueError(f"{guest_path} -> {target} leads out of the tree")
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink():
        path.unlink()
    path.symlink_to(target)
