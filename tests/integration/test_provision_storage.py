"""Provisioning storage for real: qemu-img images and overlays, one qemu-storage-daemon
serving NBD exports, read and written with the Python NBD client (nbd_client.py)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import signal
import socket
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from metalguard.controller.provision.storage import QemuStorage, StorageError
from tests.support.harness import nbd_client
from tests.support.waiting import wait_for_value, wait_until

TOOLS = ("qemu-img", "qemu-storage-daemon", "mke2fs")
MISSING = [t for t in TOOLS if shutil.which(t) is None]
pytestmark = pytest.mark.skipif(
    bool(MISSING),
    reason=f"not installed: {', '.join(MISSING)} (qemu-utils, qemu-system-common, e2fsprogs: "
    "tests/ensure-tools.sh)",
)

MIB = 1024 * 1024
EXPORT_A = "tenantA-export-secret-0001"
EXPORT_B = "tenantB-export-secret-0002"
BLOCK = 4096
OFFSET = 20 * MIB  # past the file system's metadata at the start


def free_port() -> int:
    """A free loopback TCP port (bound again by the daemon soon after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(*argv: str) -> str:
    """Run a tool to completion (a quick one: qemu-img, debugfs); its stdout."""
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def gone(pid: int) -> bool:
    """``pid`` has exited (a zombie waiting for its reaper counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def entries(directory: Path) -> list[str]:
    """The files in ``directory`` (hidden work files included)."""
    return sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []


@pytest.fixture
def rootfs(tmp_path: Path) -> Path:
    """A small directory tree to build an image from."""
    root = tmp_path / "rootfs"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "motd").write_text("hello from the base image\n")
    (root / "sbin").mkdir()
    (root / "sbin" / "init").write_text("#!/bin/sh\necho ready\n")
    (root / "sbin" / "init").chmod(0o755)
    return root


@pytest.fixture
async def storage(tmp_path: Path) -> AsyncIterator[QemuStorage]:
    st = QemuStorage(tmp_path / "data", listen_host="127.0.0.1", listen_port=free_port())
    await st.start()
    try:
        yield st
    finally:
        await st.close(stop_daemon=True)


@pytest.fixture
async def two_volumes(storage: QemuStorage, rootfs: Path) -> QemuStorage:
    """Image ``base`` and volumes vol-a (tenant a) and vol-b (tenant b) over it."""
    await storage.images.add_from_dir("base", rootfs, 32 * MIB)
    await storage.create_volume("vol-a", "a", "base")
    await storage.create_volume("vol-b", "b", "base")
    return storage


async def attach(st: QemuStorage, name: str) -> nbd_client.NbdClient:
    return await nbd_client.connect(st.nbd_host, st.nbd_port, name)


async def test_image_from_directory_and_copy_on_write_volume(
    storage: QemuStorage, rootfs: Path
) -> None:
    image = await storage.images.add_from_dir("base", rootfs, 32 * MIB)
    path = storage.images.path("base")
    assert image.format == "qcow2"
    assert image.virtual_size == 32 * MIB
    assert image.size_bytes == path.stat().st_size
    assert image.sha256 == sha256(path)
    assert image.source == f"dir:{rootfs}"
    assert path.stat().st_mode & 0o777 == 0o444
    assert storage.images.get("base") == image
    assert storage.images.list() == [image]
    # the file system holds the directory (debugfs reads it without a mount)
    raw = path.with_name("check.raw")
    run("qemu-img", "convert", "-O", "raw", str(path), str(raw))
    if shutil.which("debugfs"):
        assert run("debugfs", "-R", "cat /etc/motd", str(raw)) == "hello from the base image\n"
    raw.unlink()

    vol = await storage.create_volume("vol-a", "a", "base")
    assert (vol.name, vol.tenant, vol.image) == ("vol-a", "a", "base")
    assert 0 < vol.size_bytes < MIB, f"a fresh overlay takes {vol.size_bytes} bytes"
    info = run("qemu-img", "info", "--output=json", str(storage.volumes.path("vol-a")))
    assert '"backing-filename": "../images/base.qcow2"' in info
    assert await storage.list_volumes() == [vol]


async def test_uploaded_qcow2_and_raw_images(storage: QemuStorage, tmp_path: Path) -> None:
    raw = tmp_path / "disk.raw"
    raw.write_bytes(b"\x00" * MIB)
    qcow = tmp_path / "disk.qcow2"
    run("qemu-img", "convert", "-O", "qcow2", str(raw), str(qcow))

    up_q = await storage.images.add_file("up-qcow2", qcow)
    up_r = await storage.images.add_file("up-raw", raw)
    assert (up_q.virtual_size, up_r.virtual_size) == (MIB, MIB)
    assert (up_q.source, up_r.source) == ("upload:disk.qcow2", "upload:disk.raw")
    assert qcow.exists()
    assert raw.exists()
    for name in ("up-qcow2", "up-raw"):
        head = storage.images.path(name).read_bytes()[:4]
        assert head == b"QFI\xfb", "every stored base is qcow2"
    assert [i.name for i in storage.images.list()] == ["up-qcow2", "up-raw"]

    await storage.images.delete("up-raw")
    assert storage.images.get("up-raw") is None
    assert entries(storage.images.dir) == ["up-qcow2.json", "up-qcow2.qcow2"]


async def test_exports_write_read_and_tenant_isolation(two_volumes: QemuStorage) -> None:
    st = two_volumes
    base_sum = sha256(st.images.path("base"))
    info_a = await st.export("vol-a", EXPORT_A)
    await st.export("vol-b", EXPORT_B)
    assert (info_a.host, info_a.port, info_a.name) == ("127.0.0.1", st.nbd_port, EXPORT_A)
    assert await st.list_exports() == sorted([EXPORT_A, EXPORT_B])
    assert await st.export("vol-a", EXPORT_A) == info_a  # idempotent

    a = await attach(st, EXPORT_A)
    b = await attach(st, EXPORT_B)
    try:
        assert a.size == b.size == 32 * MIB
        assert not a.read_only
        # both see the base's file system (its superblock) before anyone writes
        assert await a.read(1024, 1024) == await b.read(1024, 1024)
        secret = b"tenant A was here".ljust(BLOCK, b"\x01")
        await a.write(OFFSET, secret)
        await a.flush()
        assert await a.read(OFFSET, BLOCK) == secret
        assert await b.read(OFFSET, BLOCK) == b"\x00" * BLOCK, "B sees A's write"
    finally:
        await a.close()
        await b.close()

    a2 = await attach(st, EXPORT_A)  # a new connection reads what was written
    assert await a2.read(OFFSET, BLOCK) == secret
    await a2.close()

    with pytest.raises(nbd_client.NbdRefusedError) as refused:
        await attach(st, EXPORT_A[:-1] + "X")
    assert refused.value.reason == "unknown export"
    with pytest.raises(nbd_client.NbdError):
        await nbd_client.connect_export_name(st.nbd_host, st.nbd_port, "no-such-export-name")

    await st.unexport(EXPORT_A)
    await st.unexport(EXPORT_A)  # idempotent
    assert await st.list_exports() == [EXPORT_B]
    with pytest.raises(nbd_client.NbdRefusedError):
        await attach(st, EXPORT_A)

    # the write is on A's overlay, and only there; the base never changed
    assert sha256(st.images.path("base")) == base_sum
    vols = {v.name: v for v in await st.list_volumes()}
    assert vols["vol-a"].size_bytes > vols["vol-b"].size_bytes
    raw = st.data_dir / "a.raw"
    run("qemu-img", "convert", "-O", "raw", str(st.volumes.path("vol-a")), str(raw))
    with raw.open("rb") as f:
        f.seek(OFFSET)
        assert f.read(BLOCK) == secret
    raw.unlink()


async def test_export_refusals(two_volumes: QemuStorage) -> None:
    st = two_volumes
    await st.export("vol-a", EXPORT_A)
    with pytest.raises(StorageError, match="exported already") as exc:
        await st.export("vol-a", EXPORT_B)  # one export per volume
    assert exc.value.status == 409
    with pytest.raises(StorageError, match="another volume") as exc:
        await st.export("vol-b", EXPORT_A)
    assert exc.value.status == 409
    with pytest.raises(StorageError, match="no volume 'nope'") as exc:
        await st.export("nope", EXPORT_B)
    assert exc.value.status == 404
    with pytest.raises(StorageError, match="invalid export name") as exc:
        await st.export("vol-b", "short")
    assert exc.value.status == 400
    with pytest.raises(StorageError, match="unexport it first") as exc:
        await st.delete_volume("vol-a")
    assert exc.value.status == 409
    with pytest.raises(StorageError, match="base of volumes vol-a, vol-b") as exc:
        await st.images.delete("base")
    assert exc.value.status == 409
    assert await st.list_exports() == [EXPORT_A]

    await st.unexport(EXPORT_A)
    await st.delete_volume("vol-a")
    assert [v.name for v in await st.list_volumes()] == ["vol-b"]
    assert entries(st.volumes.dir) == ["vol-b.json", "vol-b.qcow2"]
    with pytest.raises(StorageError) as exc:
        await st.delete_volume("vol-a")
    assert exc.value.status == 404
    await st.delete_volume("vol-a", missing_ok=True)


async def test_daemon_killed_is_restarted_and_repopulated(two_volumes: QemuStorage) -> None:
    st = two_volumes
    await st.export("vol-a", EXPORT_A)
    await st.export("vol-b", EXPORT_B)
    a = await attach(st, EXPORT_A)
    data = b"survives a daemon crash".ljust(BLOCK, b"\x02")
    await a.write(OFFSET, data)
    await a.flush()
    await a.close()

    old = st.server.pid
    os.kill(old, signal.SIGKILL)
    await wait_until(lambda: st.server.restarts == 1, 20, "the daemon restarted")
    assert st.server.pid != old
    exports = await wait_for_value(
        st.list_exports, lambda names: len(names) == 2, 20, "the exports re-populated"
    )
    assert exports == sorted([EXPORT_A, EXPORT_B])
    a = await attach(st, EXPORT_A)
    assert await a.read(OFFSET, BLOCK) == data
    await a.close()


async def test_start_adopts_the_daemon_and_removes_unwanted_exports(
    two_volumes: QemuStorage,
) -> None:
    st = two_volumes
    await st.export("vol-a", EXPORT_A)
    await st.export("vol-b", EXPORT_B)
    pid = st.server.pid
    await st.close()  # the controller goes; the daemon and its exports stay

    again = QemuStorage(st.data_dir, listen_host="127.0.0.1", listen_port=st.nbd_port)
    try:
        removed = await again.start({EXPORT_A: "vol-a", "gone-volume-export-1": "vol-zz"})
        assert removed == sorted([EXPORT_B, "gone-volume-export-1"])
        assert again.server.pid == pid, "a live daemon is adopted, not replaced"
        assert await again.list_exports() == [EXPORT_A]
        assert again.exported_volumes() == {EXPORT_A: "vol-a"}
        a = await attach(again, EXPORT_A)
        await a.close()
        with pytest.raises(nbd_client.NbdRefusedError):
            await attach(again, EXPORT_B)
    finally:
        await again.close(stop_daemon=True)
    await wait_until(lambda: gone(pid), 10, "the daemon stopped")


async def test_another_listen_address_replaces_the_gate_only(two_volumes: QemuStorage) -> None:
    st = two_volumes
    await st.export("vol-a", EXPORT_A)
    pid, gate = st.server.pid, st.server.gate_pid
    await st.close()
    moved = QemuStorage(st.data_dir, listen_host="127.0.0.1", listen_port=free_port())
    try:
        assert await moved.start({EXPORT_A: "vol-a"}) == []
        assert moved.server.pid == pid, "the exports' daemon is kept"
        assert moved.server.gate_pid != gate
        a = await attach(moved, EXPORT_A)
        await a.close()
    finally:
        await moved.close(stop_daemon=True)
    await wait_until(lambda: gone(pid) and gone(gate), 10, "the daemons stopped")


async def test_export_names_are_never_listed(two_volumes: QemuStorage) -> None:
    """qemu answers NBD_OPT_LIST with every export's name; the gate refuses it (logged)."""
    st = two_volumes
    await st.export("vol-a", EXPORT_A)
    await st.export("vol-b", EXPORT_B)
    assert await nbd_client.list_exports(st.nbd_host, st.nbd_port) == []
    log = (st.data_dir / "run" / "gate.log").read_text()
    assert "refused option 3 (listing exports is not allowed" in log
    # behind the gate the daemon does list them: what the gate is for
    listed = await nbd_client.list_exports_unix(str(st.server.nbd_socket_path))
    assert listed == sorted([EXPORT_A, EXPORT_B])
    a = await attach(st, EXPORT_A)  # a name still attaches, after a refused list too
    await a.close()


async def test_gate_killed_is_restarted(two_volumes: QemuStorage) -> None:
    st = two_volumes
    await st.export("vol-a", EXPORT_A)
    pid, gate = st.server.pid, st.server.gate_pid
    os.kill(gate, signal.SIGKILL)
    await wait_until(lambda: st.server.gate_restarts == 1, 20, "the gate restarted")
    assert st.server.pid == pid
    assert st.server.restarts == 0
    a = await attach(st, EXPORT_A)
    await a.close()


# bad input: a clear StorageError, nothing left behind --------------------------------


async def test_unknown_image_leaves_no_volume(storage: QemuStorage) -> None:
    with pytest.raises(StorageError, match="no image 'nope'") as exc:
        await storage.create_volume("vol-x", "t", "nope")
    assert exc.value.status == 404
    assert entries(storage.volumes.dir) == []
    assert await storage.list_volumes() == []


async def test_missing_directory_and_bad_sizes(storage: QemuStorage, rootfs: Path) -> None:
    with pytest.raises(StorageError, match="does not exist on the storage host") as exc:
        await storage.images.add_from_dir("img", rootfs / "nope", 32 * MIB)
    assert exc.value.status == 400
    with pytest.raises(StorageError, match="not absolute"):
        await storage.images.add_from_dir("img", "relative/dir", 32 * MIB)
    with pytest.raises(StorageError, match="too small"):
        await storage.images.add_from_dir("img", rootfs, 1024)
    with pytest.raises(StorageError, match="invalid image name"):
        await storage.images.add_from_dir("../escape", rootfs, 32 * MIB)
    # contents larger than the file system: mke2fs's own words, nothing left
    (rootfs / "big").write_bytes(os.urandom(6 * MIB))
    with pytest.raises(StorageError, match="building the file system") as exc:
        await storage.images.add_from_dir("img", rootfs, 4 * MIB)
    assert exc.value.status == 502
    assert entries(storage.images.dir) == []
    assert storage.images.list() == []


async def test_corrupt_or_unsafe_uploads_are_refused(storage: QemuStorage, tmp_path: Path) -> None:
    good = tmp_path / "good.qcow2"
    run("qemu-img", "create", "-q", "-f", "qcow2", str(good), "1M")
    corrupt = tmp_path / "corrupt.qcow2"
    blob = bytearray(good.read_bytes())
    blob[4:8] = b"\x00\x00\x00\x63"  # the qcow2 magic with version 99
    corrupt.write_bytes(bytes(blob))
    with pytest.raises(StorageError, match=r"corrupt\.qcow2 is not a valid qcow2 image") as exc:
        await storage.images.add_file("bad", corrupt)
    assert exc.value.status == 400

    truncated = tmp_path / "truncated.qcow2"
    truncated.write_bytes(good.read_bytes()[:100])
    with pytest.raises(StorageError, match="not a valid qcow2 image"):
        await storage.images.add_file("bad", truncated)

    overlay = tmp_path / "overlay.qcow2"
    run("qemu-img", "create", "-q", "-f", "qcow2", "-b", str(good), "-F", "qcow2", str(overlay))
    with pytest.raises(StorageError, match="has a backing file"):
        await storage.images.add_file("bad", overlay)

    odd = tmp_path / "notes.txt"
    odd.write_text("not a disk\n")
    with pytest.raises(StorageError, match="not a multiple of 512"):
        await storage.images.add_file("bad", odd)
    empty = tmp_path / "empty.raw"
    empty.write_bytes(b"")
    with pytest.raises(StorageError, match="virtual size 0"):
        await storage.images.add_file("bad", empty)
    with pytest.raises(StorageError, match="cannot read") as exc:
        await storage.images.add_file("bad", tmp_path / "absent.qcow2")
    assert exc.value.status == 400
    with pytest.raises(StorageError, match="not a regular file"):
        await storage.images.add_file("bad", tmp_path)

    assert entries(storage.images.dir) == []
    assert storage.images.list() == []


async def test_duplicate_names_conflict(storage: QemuStorage, rootfs: Path) -> None:
    first, second = await asyncio.gather(
        storage.images.add_from_dir("base", rootfs, 8 * MIB),
        storage.images.add_from_dir("base", rootfs, 8 * MIB),
        return_exceptions=True,
    )
    outcomes = sorted(type(x).__name__ for x in (first, second))
    assert outcomes == ["Image", "StorageError"], (first, second)
    with pytest.raises(StorageError, match="exists already") as exc:
        await storage.images.add_from_dir("base", rootfs, 8 * MIB)
    assert exc.value.status == 409
    await storage.create_volume("v", "t", "base")
    with pytest.raises(StorageError, match="volume 'v' exists already"):
        await storage.create_volume("v", "t", "base")
    assert entries(storage.images.dir) == ["base.json", "base.qcow2"]
    assert entries(storage.volumes.dir) == ["v.json", "v.qcow2"]


async def test_leftovers_of_an_interrupted_run_are_removed(tmp_path: Path, rootfs: Path) -> None:
    data = tmp_path / "data"
    (data / "images").mkdir(parents=True)
    (data / "volumes").mkdir()
    (data / "images" / ".tmp-img.1234.raw").write_bytes(b"x")
    (data / "images" / "half.qcow2").write_bytes(b"x")  # no record: never committed
    (data / "volumes" / ".tmp-v.1234.qcow2").write_bytes(b"x")
    (data / "volumes" / "deleted.json").write_text("{}")  # its overlay went first
    st = QemuStorage(data, listen_host="127.0.0.1", listen_port=free_port())
    await st.start()
    try:
        assert entries(data / "images") == []
        assert entries(data / "volumes") == []
    finally:
        await st.close(stop_daemon=True)


async def test_nbd_port_taken_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        st = QemuStorage(tmp_path / "data", listen_host="127.0.0.1", listen_port=port)
        try:
            with pytest.raises(StorageError, match=f"cannot listen on 127.0.0.1:{port}"):
                await st.start()
        finally:
            await st.close(stop_daemon=True)
    assert entries(tmp_path / "data" / "run") == ["gate.log"], "no daemon, socket, pid left"
