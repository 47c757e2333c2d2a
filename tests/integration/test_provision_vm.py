"""A real network boot through the BMC, a tenant switch on the same machine, and the
tenants' data kept apart (issue 17's "A real boot in the tests").

One QEMU node (TCG) behind its Redfish BMC and a bmc-proxy on real NATS, and the
region's real provisioning (tests/support/harness/provision_cluster.py): the service's
request goes to the BMC (the Redfish PATCH of the Pxe boot override, then the reset), the
VM boots iPXE -> the boot server's script -> Debian's cloud kernel and the initramfs built
here -> its tenant's volume over NBD from the qemu-storage-daemon -> the image's init,
which runs the user data and posts the ready report: only then is the instance ACTIVE.
Nothing is mocked between the BMC call and the ready report.  The three acceptance
checks share one VM (boots are the expensive part: ~11-20 s each under TCG).

Skips, with the reason, where QEMU, iPXE's ROM, busybox-static, gcc, qemu-utils,
qemu-storage-daemon or e2fsprogs are missing (tests/ensure-tools.sh installs them as
root) or no Debian kernel can be had (apt; cached after the first run).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from metalguard.proto.provision import InstanceRequest
from metalguard.proto.subjects import Subjects
from tests.support.harness import provision_cluster, provision_vm, rxe_kernel
from tests.support.harness.provision_cluster import VmCluster, node_handle
from tests.support.harness.redfish_emulator import Certificate

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.xdist_group("vm")]

BOOT_TIMEOUT_S = 240.0
"""One network boot to the ready report (~11-20 s under TCG on 2 loaded cores)."""
SECRET = "tenant A's secret, written on its own volume"
USER_DATA_A = f"""\
echo "{SECRET}" > /root/a.txt
sync
cat /root/a.txt
"""
USER_DATA_B = """\
if [ -e /root/a.txt ]; then echo "VISIBLE: $(cat /root/a.txt)"; else echo "a.txt absent"; fi
echo "tenant B was here" > /root/b.txt
sync
"""


def _kernel() -> rxe_kernel.Kernel:
    if (reason := provision_vm.missing_tools()) is not None:
        pytest.skip(f"provisioning VM: {reason}")
    try:
        return rxe_kernel.ensure_kernel(rxe_kernel.cache_root(), provision_vm.KERNEL)
    except rxe_kernel.NoKernelError as exc:
        pytest.skip(f"provisioning VM: no Debian cloud kernel (virtio_net, nbd): {exc}")


def _volume_file(volume: Path, path: str, work: Path, *, shared: bool = False) -> str:
    """``path`` inside the ext4 file system of a qcow2 volume, read on this host:
    ``qemu-img convert -O raw`` then ``debugfs -R "cat PATH"`` ("" when absent)."""
    raw = work / f"{volume.stem}.raw"
    share = ["-U"] if shared else []  # a volume still exported is read without its lock
    subprocess.run(
        ["qemu-img", "convert", *share, "-O", "raw", str(volume), str(raw)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    done = subprocess.run(
        ["debugfs", "-R", f"cat {path}", str(raw)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    raw.unlink()
    return done.stdout


async def test_network_boot_tenant_switch_and_isolation(
    tmp_path: Path, nats_url: str, subjects: Subjects, certificate: Certificate
) -> None:
    kernel = _kernel()
    try:
        async with provision_cluster.vm_cluster(
            tmp_path, nats_url, subjects, certificate, kernel
        ) as cluster:
            await _scenario(cluster, tmp_path)
    except provision_vm.GuestBuildError as exc:
        pytest.skip(f"provisioning VM: {exc}")


async def _scenario(cluster: VmCluster, work: Path) -> None:
    svc, node, bmc = cluster.service, cluster.nodes[0], cluster.bmcs[0].running.emulator
    handle = node_handle(1)

    # (1) A request -> the BMC call -> a network boot -> the ready report -> ACTIVE.
    started = time.monotonic()
    created = await svc.create(
        InstanceRequest(tenant="tenantA", image="base1", node=handle, user_data=USER_DATA_A)
    )
    assert created.state == "deploying"
    a = await cluster.wait_active(created.instance_id, BOOT_TIMEOUT_S)
    print(f"request -> ACTIVE: {time.monotonic() - started:.1f}s")
    assert bmc.patches[0] == {
        "Boot": {"BootSourceOverrideTarget": "Pxe", "BootSourceOverrideEnabled": "Once"}
    }
    assert bmc.resets == ["On"], bmc.resets  # it was off: the power cycle powers it on
    assert bmc.boots == ["Pxe"], bmc.boots
    assert [b.source for b in node.boots] == ["Pxe"]
    console = node.console()
    for step in ("mg-nbd-client: /dev/nbd0 attached", "mg-initramfs: root mounted", "synced"):
        assert step in console, cluster.diagnostics()
    report = a.ready_report
    assert (report["instance"], report["image"]) == (a.instance_id, "base1"), report
    assert report["userdata_rc"] == "0", report
    assert SECRET in report["output"], report
    assert report["kernel"], report
    assert report["boot_id"], report
    assert svc.node_states()[handle] == "active"
    assert a.tenant == "tenantA"
    assert a.ready_ts is not None

    # (2) A tenant switch on the same VM: A's volume detached, B's attached, a network
    # reboot through the BMC (graceful shutdown, then on), B's image reports ready.
    started = time.monotonic()
    switched = await svc.switch(a.instance_id, "tenantB", "base1", user_data=USER_DATA_B)
    assert switched.state == "switching"
    assert switched.volume != a.volume
    b = await cluster.wait_active(a.instance_id, BOOT_TIMEOUT_S)
    print(f"tenant switch -> ACTIVE: {time.monotonic() - started:.1f}s")
    assert (b.tenant, b.volume) == ("tenantB", switched.volume)
    assert bmc.boots == ["Pxe", "Pxe"], bmc.boots
    assert len(node.boots) == 2
    assert bmc.resets[1:] == ["GracefulShutdown", "On"], bmc.resets
    assert b.ready_report["boot_id"] != report["boot_id"], "the node did not reboot"
    exports = await cluster.storage.list_exports()
    assert exports == [b.export], "A's export is gone, B's is served"

    # (3) What tenant A wrote is on A's volume and never visible to B.
    assert b.ready_report["output"].strip() == "a.txt absent", b.ready_report
    volumes = cluster.storage.volumes
    a_file = _volume_file(volumes.path(a.volume), "/root/a.txt", work)
    assert a_file.strip() == SECRET
    b_volume = volumes.path(b.volume)
    assert _volume_file(b_volume, "/root/a.txt", work, shared=True) == ""
    assert _volume_file(b_volume, "/root/b.txt", work, shared=True).strip() == "tenant B was here"

    # Release: the export removed, the VM powered off through the BMC, volumes kept.
    released = await svc.release(a.instance_id, keep_volume=True)
    assert released.state == "released"
    assert bmc.resets[-1] == "ForceOff"
    assert not node.running
    assert await cluster.storage.list_exports() == []
    names = {v.name for v in await cluster.storage.list_volumes()}
    assert {a.volume, b.volume} <= names
    assert svc.node_states()[handle] == "available"
