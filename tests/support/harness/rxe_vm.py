"""A QEMU VM with a real Soft-RoCE device, for the rdma collector's test: build an
initramfs (busybox, iproute2's ``rdma``, ``ibv_rc_pingpong`` with the rxe provider, the
kernel's modules and rxe_init.sh as /init), boot it under TCG with a deadline, and turn
what the guest sent on its second serial port into sysfs trees on this side.

The VM has no network device at all (``-nic none``): rxe0 sits on a dummy netdev and
the pingpong runs between two processes of the guest.  KVM is not used: nested KVM
fails on these hosts; under TCG a whole run takes ~12 s.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.harness.rxe_kernel import Kernel

QEMU = "qemu-system-x86_64"
INIT = Path(__file__).with_name("rxe_init.sh")
BINARIES = {
    "busybox": "busybox-static",
    "rdma": "iproute2",
    "ibv_rc_pingpong": "ibverbs-utils",
}
"""What goes into the guest, by host command, and the Debian package that has it."""
PROVIDER_GLOB = "/usr/lib/*/libibverbs/librxe-rdmav*.so"
PROVIDER_CONF = Path("/etc/libibverbs.d/rxe.driver")
KERNEL_ARGS = "console=ttyS0 quiet panic=-1 cryptomgr.notests rodata=off acpi=off"
"""``panic=-1`` with ``-no-reboot``: a guest that panics ends QEMU at once (so does the
init's ``reboot -f``).  No crypto self-tests, no read-only-data pass (with its W+X page
walk), no ACPI: the kernel reaches /init in ~3 s instead of ~7 s under TCG."""
BOOT_DEADLINE_S = 120.0
"""The whole VM run: boot, setup, two pingpongs, three readings (~12 s under TCG)."""


class VmSetupError(Exception):
    """The VM could not make an rxe device (the test skips with the message)."""


def missing_tools() -> str | None:
    """Why the VM cannot be built here (what to install), or None."""
    missing = [pkg for cmd, pkg in BINARIES.items() if shutil.which(cmd) is None]
    if shutil.which(QEMU) is None:
        missing.append("qemu-system-x86")
    if not _provider() or not PROVIDER_CONF.is_file():
        missing.append("ibverbs-providers")
    if shutil.which("ldd") is None:
        missing.append("libc-bin")
    if missing:
        return f"not installed: {', '.join(sorted(set(missing)))} (tests/ensure-tools.sh)"
    return None


def _provider() -> Path | None:
    found = sorted(Path("/").glob(PROVIDER_GLOB.lstrip("/")))
    return found[-1] if found else None


def shared_libraries(ldd_output: str) -> list[Path]:
    """The files ``ldd`` names (``libc.so.6 => /lib/...`` and the loader's own line)."""
    paths = re.findall(r"(?:=>\s*)?(/\S+)\s+\(0x[0-9a-f]+\)", ldd_output)
    return [Path(p) for p in paths]


def _libraries(programs: list[Path]) -> set[Path]:
    out: set[Path] = set()
    for program in programs:
        done = subprocess.run(
            ["ldd", str(program)], capture_output=True, text=True, timeout=30, check=False
        )
        out.update(shared_libraries(done.stdout))  # a static binary: "not a dynamic ..."
    return out


def build_initramfs(kernel: Kernel, work: Path) -> Path:
    """The VM's initramfs (an uncompressed newc cpio) under ``work``."""
    root = work / "root"
    for d in ("bin", "lib/modules", "etc/libibverbs.d"):
        (root / d).mkdir(parents=True, exist_ok=True)
    programs = [Path(str(shutil.which(cmd))) for cmd in BINARIES]
    provider = _provider()
    assert provider is not None
    for program in programs:
        shutil.copy(program, root / "bin" / program.name)
    for lib in _libraries([*programs, provider]) | {provider}:
        target = root / lib.relative_to("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(lib.resolve(), target)  # the file behind the soname link
    shutil.copy(PROVIDER_CONF, root / "etc/libibverbs.d" / PROVIDER_CONF.name)
    for module in kernel.modules:
        shutil.copy(module, root / "lib/modules" / module.name)
    (root / "lib/modules/order").write_text("".join(f"{m.name}\n" for m in kernel.modules))
    shutil.copy(INIT, root / "init")
    (root / "init").chmod(0o755)
    names = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    cpio = work / "initrd.cpio"
    with cpio.open("wb") as out:
        subprocess.run(
            [str(root / "bin/busybox"), "cpio", "-o", "-H", "newc"],
            input="\n".join(names).encode() + b"\n",
            stdout=out,
            stderr=subprocess.DEVNULL,
            cwd=root,
            timeout=60,
            check=True,
        )
    return cpio


@dataclass
class VmRun:
    """What one boot produced."""

    console: str
    """The guest's console (ttyS0): the kernel's messages and the pingpong's output."""
    lines: list[str] = field(default_factory=list)
    """The ``@@`` lines of the data port (ttyS1), without the ``@@``."""
    readings: dict[str, Path] = field(default_factory=dict)
    """Each reading's sysfs root (holding ``class/infiniband/rxe0``)."""
    wall_s: float = 0.0

    def value(self, word: str) -> str | None:
        """The rest of the first line that starts with ``word`` (None: no such line)."""
        for line in self.lines:
            head, _, rest = line.partition(" ")
            if head == word:
                return rest
        return None

    def device_made(self) -> bool:
        """Whether the guest made rxe0 and found its GID (the last setup step)."""
        return any(line.startswith("STEP rxe0 ") for line in self.lines)

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.console.splitlines()[-lines:])


def boot(kernel: Kernel, work: Path, iterations: int, deadline_s: float = BOOT_DEADLINE_S) -> VmRun:
    """Boot the VM once and collect its readings.  VmSetupError when the guest could not
    make rxe0 (or never reached its /init); QEMU is killed at the deadline at the latest."""
    initrd = build_initramfs(kernel, work)
    console, data = work / "console.log", work / "data.log"
    args = [
        QEMU, "-accel", "tcg", "-m", "512", "-smp", "1",
        "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
        "-nic", "none",
        "-kernel", str(kernel.image), "-initrd", str(initrd),
        "-append", f"{KERNEL_ARGS} RXE_ITERS={iterations}",
        "-serial", f"file:{console}", "-serial", f"file:{data}",
    ]  # fmt: skip
    started = time.monotonic()
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        try:
            _, err = proc.communicate(timeout=deadline_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            timed_out = True
        else:
            timed_out = False
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    run = VmRun(console=_text(console), wall_s=time.monotonic() - started)
    run.lines, run.readings = decode(_text(data), work / "readings")
    if run.value("STEP") is None:  # not even /init ran: QEMU or the kernel
        why = f"QEMU exited {proc.returncode}" if not timed_out else "deadline"
        raise VmSetupError(
            f"the VM never reached /init ({why}): {err.decode(errors='replace')[-500:]}\n"
            f"{run.tail(10)}"
        )
    if (reason := run.value("FAIL")) is not None:
        if not run.device_made():
            raise VmSetupError(f"in the VM: {reason}\n{run.tail(15)}")
        raise AssertionError(f"in the VM, with rxe0 up: {reason}\n{run.tail()}")
    if timed_out:
        raise AssertionError(f"the VM ran past {deadline_s:.0f}s:\n{run.tail()}")
    return run


def _text(path: Path) -> str:
    return path.read_bytes().decode(errors="replace") if path.exists() else ""


def decode(data: str, dest: Path) -> tuple[list[str], dict[str, Path]]:
    """The ``@@`` lines of the data port, and each ``BEGIN``/``END`` framed reading written
    out as a sysfs tree, ``dest/<name>/class/infiniband/rxe0/<path>`` (``@@F <path>``
    starts a file, each ``|<line>`` is one of its lines; anything else is noise)."""
    lines: list[str] = []
    readings: dict[str, Path] = {}
    files: dict[str, list[str]] | None = None
    current: list[str] = []
    for raw in data.splitlines():
        line = raw.rstrip("\r")
        if line.startswith("|"):
            current.append(line[1:])
            continue
        if not line.startswith("@@"):
            continue
        word, _, rest = line[2:].partition(" ")
        if word == "F" and files is not None:
            current = files.setdefault(rest, [])
            continue
        lines.append(line[2:])
        if word == "BEGIN":
            files, current = {}, []
        elif word == "END" and files is not None:
            readings[rest] = _write_tree(files, dest / rest)
            files, current = None, []
    return lines, readings


def _write_tree(files: dict[str, list[str]], root: Path) -> Path:
    device = root / "class" / "infiniband" / "rxe0"
    for rel, text in files.items():
        path = (device / rel).resolve()
        if not path.is_relative_to(device.resolve()) or rel.startswith("/"):
            raise AssertionError(f"the VM sent a path outside rxe0: {rel!r}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(f"{t}\n" for t in text))
    return root
