"""A bare-metal node for the provisioning tests: a QEMU VM that boots from the network
through its BMC, attaches its root volume over NBD and reports ready.

What is built here (docs/provisioning.md, "The boot chain"):

- the **initramfs** (:func:`build_initramfs`): busybox-static, ``mg-nbd-client`` (a tiny
  static NBD client compiled at test time from provision_guest/nbd_client.c with
  ``gcc -static``), the NIC's and nbd's modules from Debian's cloud kernel
  (:data:`CLOUD`, cached by tests/support/harness/rxe_kernel.py; :data:`GENERIC`, the generic
  kernel with an e1000, is the slower other choice) and provision_guest/
  initramfs_init.sh as ``/init``: DHCP, ``nbdroot=HOST,PORT,NAME`` attached to /dev/nbd0,
  ``switch_root`` to the volume;
- the **base image's directory** (:func:`build_image_dir`): busybox, provision_guest/
  image_init.sh as ``/sbin/init`` (it runs the user data, syncs and posts the ready
  report) and an ``/etc/os-release`` naming the image; the image registry makes the file
  system from it (``mke2fs -d``);
- the **node** (:class:`QemuNode`): ``qemu-system-x86_64 -accel tcg`` with a virtio-net
  NIC (an e1000 for :data:`GENERIC`) of the node's MAC on user-mode networking restricted
  to two forwards: the boot server (the guest's 10.0.2.100:80) and the NBD export server
  (10.0.2.101:10809), both on this host's loopback (``guestfwd=...-cmd:busybox nc
  127.0.0.1 PORT``: one forwarder per connection); its serial console goes to one log file per boot;
- the **BMC** (:func:`start_vm_bmc`): the Redfish emulator (tests/integration/
  redfish_emulator.py) with power hooks: a boot (``On``, ``ForceRestart``, the ``On`` of a
  power cycle) starts the VM, with ``-boot n`` when the boot override says ``Pxe``; the
  power going off (``ForceOff``, the end of a ``GracefulShutdown``) stops it at once,
  like pulling the plug.

KVM is not used: nested KVM makes iPXE stop with an emulation failure on these hosts
(../shared/NOTES.md §10).
"""

from __future__ import annotations

import contextlib
import ctypes
import gzip
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from tests.support.harness.redfish_emulator import (
    CHASSIS,
    Certificate,
    RedfishEmulator,
    RunningEmulator,
    start_emulator,
)
from tests.support.harness.rxe_kernel import Kernel, KernelSpec

QEMU = "qemu-system-x86_64"
GUEST = Path(__file__).with_name("provision_guest")


@dataclass(frozen=True, slots=True)
class GuestKernel:
    """A Debian kernel for the node and the NIC QEMU gives the node to match it."""

    spec: KernelSpec
    nic: str
    """QEMU's ``-device`` model (its iPXE ROM, from ipxe-qemu, does the network boot)."""
    rom: str
    """That ROM's file name (in /usr/lib/ipxe/qemu or /usr/share/qemu)."""


CLOUD = GuestKernel(
    KernelSpec(
        "provision-cloud-kernel",
        ("virtio_pci", "virtio_net", "nbd"),
        unpack_vmlinux=False,
        meta="linux-image-cloud-amd64",
    ),
    nic="virtio-net-pci",
    rom="efi-virtio.rom",
)
"""The default: Debian's cloud kernel as a bzImage (iPXE loads it; LZ4, unpacked in a
blink even under TCG) and what the initramfs loads: virtio-pci and virtio-net (the NIC)
and nbd; ext4 and crc32c are built in."""
GENERIC = GuestKernel(
    KernelSpec(
        "provision-kernel",
        ("e1000", "nbd", "crc32c_generic", "ext4"),
        unpack_vmlinux=False,
    ),
    nic="e1000",
    rom="efi-e1000.rom",
)
"""Debian's generic kernel (XZ: 10-14 s to unpack under TCG) with an e1000 NIC, nbd, and
ext4 with the crc32c its metadata checksums ask the crypto API for (there is no modprobe
in the guest)."""
KERNEL = CLOUD.spec
"""The kernel the tests boot (:data:`CLOUD`)."""
MODULE_ARGS = {"nbd": "nbds_max=1"}
BOOT_IP = "10.0.2.100"
"""The boot server as the guest sees it (port 80)."""
NBD_IP = "10.0.2.101"
NBD_PORT = 10809
"""The NBD export server as the guest sees it."""
BOOT_URL = f"http://{BOOT_IP}"
ROM_DIRS = (Path("/usr/lib/ipxe/qemu"), Path("/usr/share/qemu"))
MEMORY_MB = 256
BANNER_KEY_EVERY_S = 0.25
BANNER_KEYS_FOR_S = 30.0


class GuestBuildError(Exception):
    """The guest's parts could not be built (the message says which and why)."""


def missing_tools(guest: GuestKernel = CLOUD) -> str | None:
    """Why the VM cannot be built or booted here (what to install), or None."""
    missing = []
    if shutil.which(QEMU) is None:
        missing.append("qemu-system-x86")
    if not any((folder / guest.rom).exists() for folder in ROM_DIRS):
        missing.append("ipxe-qemu")
    busybox = shutil.which("busybox")
    if busybox is None or not _static(Path(busybox)):
        missing.append("busybox-static")
    for tool, package in (("qemu-img", "qemu-utils"), ("debugfs", "e2fsprogs")):
        if shutil.which(tool) is None:
            missing.append(package)
    if shutil.which("mke2fs") is None:
        missing.append("e2fsprogs")
    if shutil.which("qemu-storage-daemon") is None:
        missing.append("qemu-system-common")
    if shutil.which("gcc") is None:
        missing.append("gcc")
    if missing:
        return f"not installed: {', '.join(sorted(set(missing)))} (tests/ensure-tools.sh)"
    return None


def _static(program: Path) -> bool:
    """Whether ``program`` runs without shared libraries (what a bare guest needs)."""
    head = program.read_bytes()[:4096]
    return head.startswith(b"\x7fELF") and b"/lib64/ld-linux" not in head


def _run(args: list[str], what: str, timeout_s: float = 120.0, **kw: object) -> None:
    try:
        done = subprocess.run(
            args,
            capture_output=True,
            timeout=timeout_s,
            check=False,
            **kw,  # type: ignore[call-overload]
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise GuestBuildError(f"{what}: {exc}") from None
    if done.returncode != 0:
        tail = (done.stderr or done.stdout or b"").decode(errors="replace").strip()[-800:]
        raise GuestBuildError(f"{what} failed ({done.returncode}): {tail}")


def compile_nbd_client(work: Path) -> Path:
    """``mg-nbd-client``, compiled static from provision_guest/nbd_client.c into
    ``work``; GuestBuildError when gcc (or the static libc) cannot build it."""
    out = work / "mg-nbd-client"
    source = GUEST / "nbd_client.c"
    _run(
        ["gcc", "-static", "-O2", "-Wall", "-Werror", "-o", str(out), str(source)],
        "gcc -static nbd_client.c",
    )
    return out


def module_lines(kernel: Kernel) -> list[str]:
    """The initramfs's /lib/modules/order: each module file with its parameters."""
    lines = []
    for module in kernel.modules:
        args = MODULE_ARGS.get(module.stem, "")
        lines.append(f"{module.name} {args}".strip())
    return lines


def _cpio(root: Path, out: Path) -> None:
    """``root`` as a newc cpio (busybox cpio: there is no cpio binary on these hosts)."""
    names = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    busybox = str(shutil.which("busybox"))
    with out.open("wb") as f:
        subprocess.run(
            [busybox, "cpio", "-o", "-H", "newc"],
            input="\n".join(names).encode() + b"\n",
            stdout=f,
            stderr=subprocess.DEVNULL,
            cwd=root,
            timeout=60,
            check=True,
        )


def build_initramfs(kernel: Kernel, work: Path) -> Path:
    """The VM's initramfs (a gzip-compressed newc cpio) under ``work``."""
    work.mkdir(parents=True, exist_ok=True)
    client = compile_nbd_client(work)
    root = work / "initramfs"
    for d in ("bin", "lib/modules"):
        (root / d).mkdir(parents=True, exist_ok=True)
    shutil.copy(str(shutil.which("busybox")), root / "bin/busybox")
    shutil.copy(client, root / "bin/mg-nbd-client")
    shutil.copy(GUEST / "dhcp_script.sh", root / "bin/dhcp-script")
    for module in kernel.modules:
        shutil.copy(module, root / "lib/modules" / module.name)
    (root / "lib/modules/order").write_text("".join(f"{m}\n" for m in module_lines(kernel)))
    shutil.copy(GUEST / "initramfs_init.sh", root / "init")
    for program in ("init", "bin/dhcp-script", "bin/mg-nbd-client", "bin/busybox"):
        (root / program).chmod(0o755)
    cpio = work / "initrd.cpio"
    _cpio(root, cpio)
    initrd = work / "initrd.gz"
    initrd.write_bytes(gzip.compress(cpio.read_bytes(), compresslevel=6))
    cpio.unlink()
    return initrd


def os_release(image: str) -> str:
    """The test image's /etc/os-release (``MG_IMAGE`` names it in the ready report)."""
    return (
        'NAME="metalguard test image"\n'
        "ID=metalguard-test\n"
        f'PRETTY_NAME="metalguard test image {image}"\n'
        f"MG_IMAGE={image}\n"
    )


def build_image_dir(work: Path, image: str) -> Path:
    """A base image's directory tree (for ``mke2fs -d``): busybox with all its applets as
    links, the image's init, an os-release naming ``image``, empty mount points."""
    root = work / f"image-{image}"
    for d in ("bin", "sbin", "etc", "proc", "sys", "dev", "run", "tmp", "root", "home"):
        (root / d).mkdir(parents=True, exist_ok=True)
    busybox = str(shutil.which("busybox"))
    shutil.copy(busybox, root / "bin/busybox")
    (root / "bin/busybox").chmod(0o755)
    applets = subprocess.run(
        [busybox, "--list"], capture_output=True, text=True, timeout=30, check=True
    ).stdout.split()
    for applet in applets:  # every applet as a link, as `busybox --install -s` makes them
        link = root / "bin" / applet
        if applet != "busybox" and not link.is_symlink():
            link.symlink_to("busybox")
    shutil.copy(GUEST / "image_init.sh", root / "sbin/init")
    (root / "sbin/init").chmod(0o755)
    (root / "etc/os-release").write_text(os_release(image))
    return root


def _die_with_parent() -> None:
    """In the child: SIGKILL it when the test process dies (no VM outlives its test)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def qemu_args(
    *,
    mac: str,
    boot_port: int,
    nbd_port: int,
    console: Path,
    network_boot: bool,
    memory_mb: int = MEMORY_MB,
    nic: str = CLOUD.nic,
    monitor: bool = False,
) -> list[str]:
    """The VM's command line: TCG, one NIC (``nic``: QEMU's device model) with ``mac`` on
    restricted user-mode networking whose only ways out are the two loopback forwards;
    ``monitor``: QEMU's human monitor on stdin/stdout (for :func:`press_through_banner`)."""
    netdev = ",".join(
        [
            "user,id=n0,restrict=on",
            f"guestfwd=tcp:{BOOT_IP}:80-cmd:busybox nc 127.0.0.1 {boot_port}",
            f"guestfwd=tcp:{NBD_IP}:{NBD_PORT}-cmd:busybox nc 127.0.0.1 {nbd_port}",
            f"bootfile={BOOT_URL}/boot.ipxe",
        ]
    )
    args = [
        QEMU, "-accel", "tcg", "-m", str(memory_mb), "-smp", "1",
        "-nodefaults", "-no-user-config", "-display", "none", "-vga", "none", "-no-reboot",
        "-netdev", netdev, "-device", f"{nic},netdev=n0,mac={mac}",
        "-serial", f"file:{console}",
    ]  # fmt: skip
    if network_boot:
        args += ["-boot", "n"]
    if monitor:
        args += ["-monitor", "stdio"]
    return args


def press_through_banner(proc: subprocess.Popen[bytes], console: Path) -> None:
    """Press Enter on the VM's keyboard (QEMU's monitor: ``sendkey ret``) every
    :data:`BANNER_KEY_EVERY_S` until the guest's console says something, the VM ends or
    :data:`BANNER_KEYS_FOR_S` passed: the iPXE ROM of QEMU waits 3 s at its "Press Ctrl-B
    for the iPXE command line" prompt, and any other key ends the wait (the way a
    production iPXE built with ``BANNER_TIMEOUT 0`` starts).  Harmless later: iPXE reads
    only Ctrl-C while it works, and the kernel's console is the serial port."""
    deadline = time.monotonic() + BANNER_KEYS_FOR_S
    with contextlib.suppress(OSError, ValueError):  # the VM ended: its stdin is gone
        assert proc.stdin is not None
        while proc.poll() is None and time.monotonic() < deadline:
            if console.exists() and console.stat().st_size > 0:
                break
            proc.stdin.write(b"sendkey ret\n")
            proc.stdin.flush()
            time.sleep(BANNER_KEY_EVERY_S)
        proc.stdin.close()


@dataclass
class Boot:
    """One power-on of the VM."""

    source: str
    """The BMC's boot source (``Pxe``, ``Hdd``, ...)."""
    console: Path
    started: float
    """time.monotonic() at the power-on."""


@dataclass
class QemuNode:
    """A node's machine: the QEMU process its BMC starts and stops."""

    name: str
    mac: str
    boot_port: int
    nbd_port: int
    logs: Path
    memory_mb: int = MEMORY_MB
    nic: str = CLOUD.nic
    skip_banner: bool = True
    """Press through iPXE's 3 s prompt (:func:`press_through_banner`)."""
    boots: list[Boot] = field(default_factory=list)
    _proc: subprocess.Popen[bytes] | None = None

    def power_on(self, source: str) -> None:
        """Start the VM (stopping a running one first: a reset); from the network when
        ``source`` is ``Pxe``."""
        self.power_off()
        self.logs.mkdir(parents=True, exist_ok=True)
        console = self.logs / f"{self.name}-boot{len(self.boots) + 1}.log"
        args = qemu_args(
            mac=self.mac,
            boot_port=self.boot_port,
            nbd_port=self.nbd_port,
            console=console,
            network_boot=source == "Pxe",
            memory_mb=self.memory_mb,
            nic=self.nic,
            monitor=self.skip_banner,
        )
        stderr = (self.logs / f"{self.name}-qemu.log").open("ab")
        try:
            self._proc = subprocess.Popen(
                args,
                stdin=subprocess.PIPE if self.skip_banner else subprocess.DEVNULL,
                stdout=subprocess.DEVNULL if self.skip_banner else stderr,  # the monitor's
                stderr=stderr,
                preexec_fn=_die_with_parent,
            )
        finally:
            stderr.close()
        self.boots.append(Boot(source, console, time.monotonic()))
        if self.skip_banner:
            threading.Thread(
                target=press_through_banner,
                args=(self._proc, console),
                name=f"{self.name}-banner",
                daemon=True,
            ).start()

    def power_off(self) -> None:
        """Stop the VM at once (SIGKILL: the power is cut; what the guest synced is on its
        volume already)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
        if proc is not None:
            proc.wait(30)

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def console(self, boot: int = -1) -> str:
        """A boot's serial console so far (the last boot's by default)."""
        if not self.boots:
            return ""
        path = self.boots[boot].console
        return path.read_bytes().decode(errors="replace") if path.exists() else ""

    def tail(self, lines: int = 25) -> str:
        """The end of the last boot's console and of QEMU's own messages (diagnostics)."""
        qemu = self.logs / f"{self.name}-qemu.log"
        own = qemu.read_text(errors="replace").strip()[-600:] if qemu.exists() else ""
        console = "\n".join(self.console().splitlines()[-lines:])
        return f"--- {self.name} console (boot {len(self.boots)}):\n{console}\n--- qemu: {own}"


def attach_power(emulator: RedfishEmulator, node: QemuNode) -> None:
    """Make ``emulator`` the BMC of ``node``: its boots start the VM, its power-offs stop
    it; the system starts powered off (no VM runs)."""
    emulator.on_boot = node.power_on
    emulator.on_power_off = node.power_off
    emulator.system["PowerState"] = "Off"
    emulator.docs[CHASSIS]["PowerState"] = "Off"


@dataclass
class VmBmc:
    """A running BMC of a QEMU node."""

    node: QemuNode
    running: RunningEmulator
    runner: web.AppRunner

    async def close(self) -> None:
        """Stop the VM and the BMC's HTTP service."""
        self.node.power_off()
        await self.runner.cleanup()


async def start_vm_bmc(node: QemuNode, certificate: Certificate) -> VmBmc:
    """The Redfish BMC of ``node`` on a loopback port over HTTPS (``shutdown_polls=1``: a
    graceful shutdown is off at the next read of the system)."""
    emulator = RedfishEmulator(shutdown_polls=1)
    attach_power(emulator, node)
    runner, address = await start_emulator(emulator, certificate)
    return VmBmc(node, RunningEmulator(emulator, address, certificate), runner)


def mac_of(index: int) -> str:
    """The MAC of test node ``index`` (1-based): 52:54:00:12:34:<index>."""
    return f"52:54:00:12:34:{index:02x}"
