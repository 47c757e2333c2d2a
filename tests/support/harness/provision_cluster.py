"""The region's provisioning over real QEMU nodes, for the VM tests and the bench.

:func:`vm_cluster` assembles what ``metalguard controller run`` starts with
``[provision] enabled = true`` (controller/provision/run.py: the QemuStorage with its
qemu-storage-daemon, the ProvisionService, its boot server, the BmcPower path) and, for
each node, a QEMU VM behind its own Redfish BMC (tests/support/harness/provision_vm.py),
answered by a bmc-proxy's BmcCommandService on real NATS.  Nothing is simulated between
the service's BMC command and the guest's ready report: the PXE override and the power
cycle go over NATS to the bmc-proxy, which PATCHes and resets the Redfish BMC, whose
power hook starts QEMU; iPXE fetches its script, kernel and initramfs from the boot
server; the initramfs attaches the tenant's export from the qemu-storage-daemon; the
image's init posts the ready report to the boot server.

The only stand-in is the controller's node records: every node is HEALTHY (the health
gate itself is the service tests' business).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import nats

from metalguard.agent.bmc.commands import BmcCommandService
from metalguard.agent.bmc.remediation import Remediator, open_control
from metalguard.agent.bmc.targets import BmcTarget
from metalguard.agent.connection import NatsSettings
from metalguard.controller.config import ProvisionNodeSection, ProvisionSection
from metalguard.controller.provision.manager import ProvisionError, ProvisionService
from metalguard.controller.provision.run import Provisioning
from metalguard.controller.provision.storage import QemuStorage
from metalguard.proto.base import NodeIdentity
from metalguard.proto.nodes import NodeRecord
from metalguard.proto.provision import Instance
from metalguard.proto.subjects import Subjects
from tests.support.harness import provision_vm
from tests.support.harness.bmc_client import credentials
from tests.support.harness.redfish_emulator import Certificate
from tests.support.harness.rxe_kernel import Kernel
from tests.support.waiting import wait_until

REGION = "eu1"
CLUSTER = "vm"
IMAGE_MB = 64
KERNEL_ARGS = "quiet cryptomgr.notests rodata=off acpi=off"
"""``[provision] kernel_args`` of the test region: what makes a boot under TCG shorter
(no console chatter at 115200 baud, no crypto self-tests, no read-only remapping of the
kernel, no ACPI tables to parse: docs/benchmarks.md, "Provisioning")."""
"""The base image's file system (what ``mke2fs -d`` makes of the image directory)."""


def node_handle(index: int) -> str:
    """Test node ``index``'s handle (1-based): ``eu1.vm.n01``."""
    return f"{REGION}.{CLUSTER}.n{index:02d}"


class HealthyNodes:
    """The controller's node records, every node HEALTHY and uncordoned."""

    def __init__(self, handles: list[str]) -> None:
        self._records = {
            h: NodeRecord(node=NodeIdentity(*h.split(".", 2)), grade="HEALTHY") for h in handles
        }

    @property
    def records(self) -> Mapping[str, NodeRecord]:
        return self._records


def free_port() -> int:
    """A loopback port nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class VmCluster:
    """What :func:`vm_cluster` yields."""

    provisioning: Provisioning
    nodes: list[provision_vm.QemuNode]
    bmcs: list[provision_vm.VmBmc]
    image_dir: Path

    @property
    def service(self) -> ProvisionService:
        return self.provisioning.service

    @property
    def storage(self) -> QemuStorage:
        return self.provisioning.storage

    def node(self, handle: str) -> provision_vm.QemuNode | None:
        """The VM of node ``handle``."""
        name = handle.rsplit(".", 1)[-1]
        return next((n for n in self.nodes if n.name == name), None)

    async def wait_active(self, instance_id: str, timeout_s: float) -> Instance:
        """The instance once ACTIVE (its ready report came); AssertionError with every
        node's console when it failed, when its VM ended first (a guest that fails resets
        and QEMU runs with -no-reboot) or at the deadline."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                inst = await self.service.wait_for(instance_id, timeout_s=0.5)
            except ProvisionError as exc:
                if exc.status != 504:
                    raise AssertionError(f"{exc.message}\n{self.diagnostics()}") from None
                now = await self.service.instance(instance_id)
                assert now is not None, instance_id
                inst = now
            if inst.state == "active":
                return inst
            if inst.state == "deploy_failed":
                raise AssertionError(f"{instance_id} failed: {inst.error}\n{self.diagnostics()}")
            vm = self.node(inst.node)
            if vm is not None and vm.boots and not vm.running:
                raise AssertionError(
                    f"{instance_id}: the VM of {inst.node} ended before its ready report\n"
                    f"{self.diagnostics()}"
                )
            if time.monotonic() >= deadline:
                raise AssertionError(
                    f"{instance_id} still {inst.state} after {timeout_s:g}s\n{self.diagnostics()}"
                )

    def diagnostics(self) -> str:
        """Every node's console tail and its BMC's record (for assertion messages)."""
        parts = []
        for node, bmc in zip(self.nodes, self.bmcs, strict=True):
            emulator = bmc.running.emulator
            parts.append(f"{node.tail()}\n--- BMC: resets={emulator.resets} boots={emulator.boots}")
        return "\n".join(parts)


def section(
    work: Path,
    count: int,
    kernel: Kernel,
    initrd: Path,
    nbd_port: int,
    kernel_args: str = KERNEL_ARGS,
) -> ProvisionSection:
    """The ``[provision]`` section of the test region: the guest reaches the boot server
    as 10.0.2.100:80 and the NBD server as 10.0.2.101:10809, both forwarded to loopback."""
    return ProvisionSection(
        enabled=True,
        data_dir=str(work / "provision"),
        boot_listen="127.0.0.1:0",
        boot_url=provision_vm.BOOT_URL,
        nbd_listen=f"127.0.0.1:{nbd_port}",
        nbd_host=provision_vm.NBD_IP,
        nbd_port=provision_vm.NBD_PORT,
        kernel=str(kernel.image),
        initrd=str(initrd),
        kernel_args=kernel_args,
        deploy_timeout_s=300.0,
        deploy_attempts=1,
        bmc_timeout_s=60.0,
        tick_s=0.5,
        nodes=tuple(
            ProvisionNodeSection(node=node_handle(i), mac=provision_vm.mac_of(i))
            for i in range(1, count + 1)
        ),
    )


@contextlib.asynccontextmanager
async def vm_cluster(
    work: Path,
    nats_url: str,
    subjects: Subjects,
    certificate: Certificate,
    kernel: Kernel,
    *,
    count: int = 1,
    memory_mb: int = provision_vm.MEMORY_MB,
    nic: str = provision_vm.CLOUD.nic,
    kernel_args: str = KERNEL_ARGS,
    skip_banner: bool = True,
    image: str = "base1",
) -> AsyncIterator[VmCluster]:
    """``count`` QEMU nodes with their BMCs and bmc-proxy, and the region's provisioning
    over them (``nic``: the NIC that ``kernel`` drives; ``kernel_args`` and
    ``skip_banner``: the boot's speed-ups, :data:`KERNEL_ARGS` and
    provision_vm.press_through_banner), with base image ``image`` registered; everything
    stopped afterwards (VMs off, the export daemon ended)."""
    initrd = provision_vm.build_initramfs(kernel, work / "boot")
    image_dir = provision_vm.build_image_dir(work, image)
    nbd_port = free_port()
    cfg = section(work, count, kernel, initrd, nbd_port, kernel_args)
    handles = [n.node for n in cfg.nodes]
    nc = await nats.connect(nats_url, connect_timeout=5, max_reconnect_attempts=3)
    stack = contextlib.AsyncExitStack()
    try:
        stack.push_async_callback(nc.close)
        js = nc.jetstream(timeout=10)
        provisioning = await Provisioning.open(
            nc, js, subjects, REGION, cfg, HealthyNodes(handles), lambda: True
        )
        stack.push_async_callback(provisioning.storage.close, True)
        stack.push_async_callback(provisioning.stop)
        await provisioning.start()
        nodes, bmcs = [], []
        for i, handle in enumerate(handles, start=1):
            node = provision_vm.QemuNode(
                name=handle.rsplit(".", 1)[-1],
                mac=provision_vm.mac_of(i),
                boot_port=provisioning.boot_port,
                nbd_port=nbd_port,
                logs=work / "logs",
                memory_mb=memory_mb,
                nic=nic,
                skip_banner=skip_banner,
            )
            bmc = await provision_vm.start_vm_bmc(node, certificate)
            stack.push_async_callback(bmc.close)
            nodes.append(node)
            bmcs.append(bmc)
        creds = credentials(work)
        targets = [
            BmcTarget(
                node=handle,
                address=bmc.running.address,
                protocol="redfish",
                credentials=creds,
                timeout_s=10.0,
                retries=0,
            )
            for handle, bmc in zip(handles, bmcs, strict=True)
        ]
        opener = functools.partial(open_control, cafile=str(certificate.cert))
        proxy = BmcCommandService(
            targets,
            Remediator(opener=opener, store=work / "bmc-outcomes.jsonl"),
            NatsSettings(servers=(nats_url,)),
            subjects,
        )
        await proxy.start()
        stack.push_async_callback(proxy.close)
        task = asyncio.create_task(proxy.run())

        async def stop_proxy() -> None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

        stack.push_async_callback(stop_proxy)
        await wait_until(lambda: proxy.subscribed, 10, "the bmc-proxy's subscriptions")
        await provisioning.service.add_image_from_dir(image, str(image_dir), IMAGE_MB << 20)
        yield VmCluster(provisioning, nodes, bmcs, image_dir)
    finally:
        await stack.aclose()
