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

With ``inside=True`` the same boot then runs the agent's ``iommu`` collector INSIDE the
guest, on its real /sys and /proc (``GuestSnapshot.inside``): virtiofsd shares the host's
root file system read-only (a read-only bind in a mount namespace of its own) as a
``vhost-user-fs-pci`` function on the root bus (00:03.0 here: every other BDF and group
stays as it was, the share gets a group of its own with the IOMMU), the init loads
virtio-pci and virtiofs from the cloud kernel's package (:data:`INSIDE_KERNEL`; that
kernel has no 9p), mounts it at /host and runs this host's Python on
iommu_guest/collect.py through the host's dynamic loader, with the repository and the
venv's site-packages on its path: nothing is installed in the guest.  That adds ~3-4 s
to a boot (the imports take ~2 s under TCG); the guest gets 512 MiB, shared with
virtiofsd (a memfd backend).

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
import shlex
import shutil
import struct
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from metalguard.proto.iommu import IommuPosture
from tests.support.harness.provision_vm import CLOUD, _cpio, _die_with_parent, _static
from tests.support.harness.rxe_kernel import (
    Kernel,
    KernelSpec,
    NoKernelError,
    cache_root,
    ensure_kernel,
)

QEMU = "qemu-system-x86_64"
INIT = Path(__file__).with_name("iommu_guest") / "init"
KERNEL = CLOUD.spec
"""The provisioning VM's kernel (one cached copy for both): Debian's cloud kernel as a
bzImage (LZ4: unpacked at once even under TCG), CONFIG_INTEL_IOMMU built in."""
KERNEL_ARGS = "console=ttyS0 quiet panic=-1 cryptomgr.notests rodata=off no_timer_check"
"""No ``acpi=off`` (unlike rxe_vm): the DMAR table and the MCFG (the extended config
space) are ACPI's.  ``panic=-1`` with ``-no-reboot``: a panic ends QEMU at once.
``no_timer_check``: under TCG on a loaded host the IO-APIC timer check can miss its
window, and with interrupt remapping on the kernel then panics ("timer doesn't work
through Interrupt-remapped IO-APIC"; seen in a CI run beside a CPU hog)."""
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
COLLECT = Path(__file__).with_name("iommu_guest") / "collect.py"
"""The collector's run inside the guest (``inside=True``)."""
INSIDE_KERNEL = KernelSpec(
    "iommu-virtiofs-kernel",
    ("virtio_pci", "virtiofs"),
    unpack_vmlinux=False,
    meta="linux-image-cloud-amd64",
)
"""The same cloud kernel with what mounts the host's root: virtio-pci, fuse and virtiofs
(Debian's cloud kernel builds no 9p at all: ``# CONFIG_NET_9P is not set``; it has
``CONFIG_VIRTIO_FS=m``).  A store of its own (downloaded once, like :data:`KERNEL`)."""
VIRTIOFSD = (Path("/usr/lib/qemu/virtiofsd"), Path("/usr/libexec/virtiofsd"))
"""QEMU 7.2's C virtiofsd (qemu-system-common), or the Rust one where it is packaged."""
HOST_TAG = "hostfs"
INSIDE_MEMORY_MB = 512
"""virtiofs (vhost-user) needs the guest's memory shared with virtiofsd (a memfd backend);
the host's Python needs more than the snapshot's 256 MiB."""
INSIDE_TIMEOUT_S = 150
"""The guest's limit on the Python run (busybox ``timeout``)."""
INSIDE_DEVICE = f"vhost-user-fs-pci,chardev={HOST_TAG},tag={HOST_TAG},bus=pcie.0"
"""On the root bus, after the tested topology: a function of its own there (00:0N.0, a
group of its own, a mass storage class that is no GPU or NIC), every other BDF as
without it."""
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
    ``done``; with ``inside``: ``modules``, ``mount``, ``inside`` before ``done``)."""
    inside: IommuPosture | None = None
    """The posture the agent's collector computed INSIDE the guest, on its real /sys and
    /proc (``snapshot(inside=True)``); None when not asked for or not had (``inside_why``)."""
    inside_problems: tuple[str, ...] = ()
    """What read_iommu could not read in the guest."""
    inside_groups: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """The IOMMU groups read_iommu read in the guest."""
    inside_timings: dict[str, float] = field(default_factory=dict)
    """The in-guest Python's own ``import_s`` and ``run_s``."""
    inside_why: str = ""
    """Why ``inside`` is None although asked for: ``skip: ...`` (something needed is
    missing here) or ``error: ...`` (the guest's run failed)."""


class _InsideOut(msgspec.Struct):
    """collect.py's output."""

    posture: IommuPosture
    problems: list[str] = []
    groups: dict[str, list[str]] = {}
    import_s: float = 0.0
    run_s: float = 0.0


@dataclass(frozen=True, slots=True)
class InsidePlan:
    """What running the collector inside the guest needs from this host."""

    kernel: Kernel
    virtiofsd: Path
    env: dict[str, str]
    """/inside.env of the initramfs (the guest's paths: ``/host`` + the host's)."""


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


def _interpreter(program: Path) -> str | None:
    """An ELF64 program's PT_INTERP (its dynamic loader), or None."""
    try:
        data = program.read_bytes()
    except OSError:
        return None
    if data[:6] != b"\x7fELF\x02\x01":
        return None
    phoff = struct.unpack_from("<Q", data, 0x20)[0]
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    for index in range(phnum):
        p_type, _flags, p_offset, _vaddr, _paddr, p_filesz = struct.unpack_from(
            "<IIQQQQ", data, phoff + index * phentsize
        )
        if p_type == 3:  # PT_INTERP
            return data[p_offset : p_offset + p_filesz].rstrip(b"\0").decode()
    return None


def inside_plan() -> InsidePlan | str:
    """What the in-guest collector run needs (the guest's kernel with virtiofs, virtiofsd,
    ``unshare``, this interpreter, its loader and the repository, all as real paths under
    the host's root), or why it cannot be had here.  The first call may download the
    kernel package (apt, once: cache_root())."""
    virtiofsd = next((p for p in VIRTIOFSD if os.access(p, os.X_OK)), None)
    if virtiofsd is None:
        return f"no virtiofsd ({' or '.join(map(str, VIRTIOFSD))}: qemu-system-common)"
    if shutil.which("unshare") is None:
        return "no unshare (util-linux): the read-only view of / for virtiofsd needs it"
    python = Path(os.path.realpath(sys.executable))
    loader = _interpreter(python)
    if loader is None:
        return f"{python}: not a dynamically linked ELF64 program"
    package = Path(os.path.realpath(Path(msgspec.__file__).parent.parent))
    import metalguard

    repo = Path(os.path.realpath(Path(metalguard.__file__).parent.parent))
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    multiarch = sysconfig.get_config_var("MULTIARCH") or "x86_64-linux-gnu"
    libs = [f"/lib/{multiarch}", f"/usr/lib/{multiarch}", libdir]
    libs = list(dict.fromkeys(os.path.realpath(d) for d in libs if d and os.path.isdir(d)))
    home = os.path.realpath(sys.base_prefix)
    needed = {"python": python, "loader": Path(os.path.realpath(loader)), "home": Path(home)}
    needed |= {"repository": repo, "site-packages": package}
    needed |= {f"library directory {d}": Path(d) for d in libs}
    root_device = os.stat("/").st_dev
    for what, path in needed.items():
        if not path.exists():
            return f"no {what} at {path}"
        if path.stat().st_dev != root_device:  # the read-only bind of / does not have it
            return f"the {what} ({path}) is not on the root file system"
    try:
        kernel = ensure_kernel(cache_root(), INSIDE_KERNEL)
    except NoKernelError as exc:
        return f"no guest kernel with virtiofs: {exc}"

    def host(path: object) -> str:
        return f"/host{path}"

    env = {
        "MG_TAG": HOST_TAG,
        "MG_LOADER": host(needed["loader"]),
        "MG_PYTHON": host(python),
        "MG_PYTHONHOME": host(home),
        "MG_PYTHONPATH": ":".join(host(p) for p in (repo, package)),
        "MG_LIBRARY_PATH": ":".join(host(p) for p in libs),
        "MG_TIMEOUT": str(INSIDE_TIMEOUT_S),
    }
    return InsidePlan(kernel=kernel, virtiofsd=virtiofsd, env=env)


def build_initramfs(work: Path, plan: InsidePlan | None = None) -> Path:
    """The guest's initramfs (an uncompressed newc cpio: busybox and the init; with a
    ``plan``, the modules, collect.py and /inside.env for the in-guest run)."""
    root = work / "initramfs"
    shutil.rmtree(root, ignore_errors=True)
    (root / "bin").mkdir(parents=True, exist_ok=True)
    shutil.copy(str(shutil.which("busybox")), root / "bin/busybox")
    shutil.copy(INIT, root / "init")
    for program in ("init", "bin/busybox"):
        (root / program).chmod(0o755)
    if plan is not None:
        (root / "lib/modules").mkdir(parents=True)
        for module in plan.kernel.modules:
            shutil.copy(module, root / "lib/modules" / module.name)
        order = "".join(f"{m.name}\n" for m in plan.kernel.modules)
        (root / "lib/modules/order").write_text(order)
        shutil.copy(COLLECT, root / "collect.py")
        lines = (f"{k}={shlex.quote(v)}\n" for k, v in plan.env.items())
        (root / "inside.env").write_text("".join(lines))
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
    host_socket: Path | None = None,
) -> list[str]:
    """The guest's command line (its console on ``console``, its data port on ``data``;
    with ``host_socket``, virtiofsd's: the host's root as virtiofs ``hostfs`` on the root
    bus, the guest's memory shared with virtiofsd)."""
    append = f"{KERNEL_ARGS} {iommu_args}" if iommu else KERNEL_ARGS
    machine, memory, share = "q35", MEMORY_MB, []
    if host_socket is not None:
        memory = INSIDE_MEMORY_MB
        machine = "q35,memory-backend=mem"
        share = [
            "-object", f"memory-backend-memfd,id=mem,size={memory}M,share=on",
            "-chardev", f"socket,id={HOST_TAG},path={host_socket}",
            "-device", INSIDE_DEVICE,
        ]  # fmt: skip
    return [
        QEMU, "-machine", machine, "-accel", "tcg", "-m", str(memory), "-smp", "1",
        "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot", "-nic", "none",
        *(IOMMU_DEVICE if iommu else []), *devices, *share,
        "-kernel", str(kernel.image), "-initrd", str(initrd), "-append", append,
        "-serial", f"file:{console}", "-serial", f"file:{data}",
    ]  # fmt: skip


VIRTIOFSD_SCRIPT = (
    'mount --bind / "$1" && mount -o remount,bind,ro "$1" && '
    'exec "$2" --socket-path="$3" -o source="$1" -o cache=auto -o sandbox=chroot'
)
"""In a mount namespace of its own (``unshare``): a read-only bind of the host's root
file system (its own mounts only, not /proc, /sys or /dev), which virtiofsd shares.  The
C virtiofsd has no read-only option: the bind makes it so on the host's side, and the
guest mounts it ``ro`` too."""


def start_virtiofsd(
    virtiofsd: Path, folder: Path, timeout_s: float = 15.0
) -> tuple[subprocess.Popen[bytes], Path]:
    """virtiofsd sharing the host's root read-only on ``folder/sock`` (it dies with this
    process, and ends when QEMU disconnects); RuntimeError when its socket does not come
    up (the process is killed then)."""
    mount_point, socket, log = folder / "root", folder / "sock", folder / "virtiofsd.log"
    mount_point.mkdir(exist_ok=True)
    args = [
        "unshare", "--mount", "--propagation", "private",
        "sh", "-c", VIRTIOFSD_SCRIPT, "sh", str(mount_point), str(virtiofsd), str(socket),
    ]  # fmt: skip
    with log.open("wb") as err:
        proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=err,
            stderr=err,
            preexec_fn=_die_with_parent,
        )
    deadline = time.monotonic() + timeout_s
    while not socket.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop(proc)
            why = f"exited {proc.returncode}" if proc.returncode is not None else "no socket"
            raise RuntimeError(f"virtiofsd: {why}: {_text(log).strip()[-400:]}")
        time.sleep(0.05)
    return proc, socket


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def snapshot(
    work: Path,
    *,
    iommu: bool,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    devices: list[str] = DEVICES,
    iommu_args: str = IOMMU_ARGS,
    name: str = "",
    inside: bool = False,
) -> GuestSnapshot:
    """Boot the guest once (with the emulated IOMMU or without; ``devices``: the PCI
    topology, ``iommu_args``: the kernel's IOMMU arguments) and rebuild what it sent under
    ``work/<name>/`` (default ``iommu`` or ``no-iommu``).  With ``inside``, the same boot
    then runs the agent's collector in the guest on its own /sys and /proc (the host's
    Python over virtiofs: :func:`inside_plan`): ``GuestSnapshot.inside``, or
    ``inside_why`` when it could not.  QEMU is killed at ``timeout_s`` at the latest (and
    dies with this process, as virtiofsd does); GuestError when the guest's data is not
    whole."""
    name = name or ("iommu" if iommu else "no-iommu")
    work = work / name
    work.mkdir(parents=True, exist_ok=True)
    plan = inside_plan() if inside else None
    skipped = f"skip: {plan}" if isinstance(plan, str) else ""
    plan = plan if isinstance(plan, InsidePlan) else None
    kernel = plan.kernel if plan is not None else ensure_kernel(cache_root(), KERNEL)
    initrd = build_initramfs(work, plan)
    console, data = work / "console.log", work / "data.log"
    for old in (console, data):
        old.unlink(missing_ok=True)
    share = Path(tempfile.mkdtemp(prefix="mg-vfs-"))  # short: a socket path's limit is 108
    virtiofsd: subprocess.Popen[bytes] | None = None
    proc: subprocess.Popen[bytes] | None = None
    timed_out = False
    started = time.monotonic()
    try:
        host_socket = None
        if plan is not None:
            try:
                virtiofsd, host_socket = start_virtiofsd(plan.virtiofsd, share)
            except RuntimeError as exc:
                skipped, plan = f"skip: {exc}", None
                initrd = build_initramfs(work)  # the plain guest, with the same kernel
        args = qemu_args(
            kernel, initrd, console, data, iommu=iommu, devices=devices,
            iommu_args=iommu_args, host_socket=host_socket,
        )  # fmt: skip
        (work / "qemu.args").write_text(" ".join(args) + "\n")
        started = time.monotonic()
        proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=_die_with_parent,
        )
        try:
            _, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.kill()
            _, err = proc.communicate()
    finally:
        if proc is not None:
            _stop(proc)
        if virtiofsd is not None:
            _stop(virtiofsd)
            shutil.copy(share / "virtiofsd.log", work / "virtiofsd.log")
        shutil.rmtree(share, ignore_errors=True)
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
    posture, inside_why, found = None, skipped, None
    if plan is not None:
        found, inside_why = _inside_output(decoded)
        posture = found.posture if found is not None else None
    return GuestSnapshot(
        root=work / "root",
        groups=decoded.groups,
        cmdline=decoded.blobs.get("/proc/cmdline", b"").decode(errors="replace").strip(),
        dmesg_iommu=decoded.blobs.get("dmesg_iommu", b"").decode(errors="replace"),
        wall_s=wall_s,
        console=console_text,
        timings=decoded.timings,
        inside=posture,
        inside_problems=tuple(found.problems) if found is not None else (),
        inside_groups=(
            {g: tuple(sorted(m)) for g, m in found.groups.items()} if found is not None else {}
        ),
        inside_timings=(
            {"import_s": found.import_s, "run_s": found.run_s} if found is not None else {}
        ),
        inside_why=inside_why,
    )


def _inside_output(decoded: Decoded) -> tuple[_InsideOut | None, str]:
    """collect.py's output from the guest, or why there is none (``error: ...``)."""
    stderr = decoded.blobs.get("inside_err", b"").decode(errors="replace").strip()[-1500:]
    if decoded.inside is None:
        return None, "error: the guest's init never reported its in-guest run"
    if decoded.inside != "0":
        return None, f"error: in-guest run: {decoded.inside}; stderr: {stderr}"
    try:
        return msgspec.json.decode(decoded.blobs.get("inside", b""), type=_InsideOut), ""
    except msgspec.DecodeError as exc:
        return None, f"error: in-guest output: {exc}; stderr: {stderr}"


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
    inside: str | None = None
    """``@@INSIDE``'s word: the in-guest Python's exit status, or ``fail <what>``."""
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
        elif word == "INSIDE":
            out.inside = rest
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
