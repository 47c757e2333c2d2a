"""Provisioning on real QEMU nodes: request -> ACTIVE, a tenant switch, a release, and
the storage cost of a fresh tenant volume.

The region's real provisioning (the ProvisionService, its boot server, the QemuStorage's
qemu-storage-daemon) over N QEMU VMs (TCG, 256 MiB each; Debian's cloud kernel with a
virtio-net NIC, or ``--variant generic``: the generic kernel with an e1000; the
``-plain`` variants boot without the speed-ups: no ``kernel_args``, iPXE's 3 s prompt
waited out) behind their own Redfish
BMCs and a bmc-proxy on a real nats-server: tests/support/harness/provision_cluster.py, the
same harness as tests/integration/test_provision_vm.py.  Each figure is wall time from the
service call to the instance's ACTIVE, which only the booted image's ready report makes
it (BMC commands -> iPXE -> kernel + initramfs over HTTP -> the root volume over NBD ->
the image's init -> ready report):

- one node: ``create`` on a node that is off, to ACTIVE;
- a tenant switch on that node: ``switch`` (B's new volume exported, the node
  network-rebooted through its BMC, A's export removed) to ACTIVE(B);
- a release: ``release`` (export removed, forced off through the BMC, volume deleted);
- N nodes at once (``--nodes``, 4 by default): N ``create`` calls together, to the last
  ACTIVE (each node's own time too);
- the storage cost of a tenant volume right after it is made (a qcow2 overlay over the
  base image), against the base image's size, and after one boot.

Each boot's breakdown comes from the guest's console (its lines carry the kernel's
uptime): the BMC path (request -> the VM powered on), firmware + iPXE + the kernel and
initramfs fetched and unpacked (power-on -> the kernel's clock starts), the kernel to the
initramfs's /init, its module loading, DHCP, the NBD attach + mount, the image's init to
its ready report.

Under TCG every VM emulates its CPU on the host's cores: N VMs share them, and so does
everything else running on the machine (the load average is printed with each run; the
figures scale with it).  ``--variant cloud --variant generic --rounds 2`` runs the two
interleaved (cloud, generic, cloud, generic): an A/B on a noisy machine.  Prints
figures; asserts nothing.

Usage: python bench/provision_bench.py [--nodes 4] [--memory 256] [--skip-many]
       [--variant cloud|generic|cloud-plain|generic-plain ...] [--rounds 1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

import nats

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the VM harness lives with the integration tests

from metalguard.controller.broker.server import NatsServer  # noqa: E402
from metalguard.controller.state.streams import ensure_streams  # noqa: E402
from metalguard.proto.provision import Instance, InstanceRequest  # noqa: E402
from metalguard.proto.subjects import Subjects  # noqa: E402
from tests.support.harness import provision_cluster, provision_vm, rxe_kernel  # noqa: E402
from tests.support.harness.provision_cluster import VmCluster, node_handle  # noqa: E402
from tests.support.harness.redfish_emulator import make_certificate  # noqa: E402

BOOT_TIMEOUT_S = 900.0
VARIANTS = {
    "cloud": (provision_vm.CLOUD, True),
    "generic": (provision_vm.GENERIC, True),
    "cloud-plain": (provision_vm.CLOUD, False),
    "generic-plain": (provision_vm.GENERIC, False),
}
"""A variant's guest kernel and whether the boot's speed-ups are on (the test region's
``kernel_args``, iPXE's prompt pressed through)."""
USER_DATA = "echo hello > /root/hello\nsync\n"


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.1f} (1 min), {five:.1f} (5 min)"


def machine_note() -> str:
    return (
        f"machine: {os.cpu_count()} vCPU {platform.machine()}, load average {load()}; "
        f"QEMU {provision_vm.QEMU} -accel tcg, {provision_vm.MEMORY_MB} MiB per VM "
        "unless --memory"
    )


STEP = re.compile(r"mg-(?:initramfs|image): (.*?) at ([0-9.]+)s")
MILESTONES = (
    ("init", "kernel"),
    ("modules", "modules"),
    ("dhcp", "dhcp"),
    ("root mounted", "nbd+mount"),
    ("ready reported", "image"),
)
"""The console's steps (the text a line starts with) and the name of the span that ends
there."""


async def breakdown(node: provision_vm.QemuNode, requested: float, done: float) -> str:
    """One boot's spans from its console (the last boot of ``node``; its last line comes
    once the boot server has answered the report: waited for up to 5 s); "" without."""
    if not node.boots:
        return ""
    boot = node.boots[-1]
    steps: dict[str, float] = {}
    for _ in range(50):
        steps = {}
        for match in STEP.finditer(node.console()):
            steps.setdefault(match[1], float(match[2]))
        if "ready reported" in steps:
            break
        await asyncio.sleep(0.1)
    ready = steps.get("ready reported")
    if ready is None:
        return ""
    kernel_start = done - ready  # the kernel's clock starts, on this host's clock
    if kernel_start < boot.started:  # a TSC calibrated wrong on a loaded host: it races
        return (
            f" [the guest's clock ran fast: {ready:.1f}s of uptime in {done - boot.started:.1f}s]"
        )
    spans = [f"bmc {boot.started - requested:.1f}", f"ipxe+fetch {kernel_start - boot.started:.1f}"]
    last = 0.0
    for step, name in MILESTONES:
        at = next((t for text, t in steps.items() if text.startswith(step)), None)
        if at is not None:
            spans.append(f"{name} {at - last:.1f}")
            last = at
    return " [" + ", ".join(spans) + " s]"


async def active(cluster: VmCluster, instance_id: str) -> Instance:
    try:
        return await cluster.wait_active(instance_id, BOOT_TIMEOUT_S)
    except AssertionError as exc:
        raise SystemExit(str(exc)) from None


async def timed_create(cluster: VmCluster, index: int, tenant: str) -> tuple[Instance, float, str]:
    started = time.monotonic()
    req = InstanceRequest(
        tenant=tenant, image="base1", node=node_handle(index), user_data=USER_DATA
    )
    created = await cluster.service.create(req)
    inst = await active(cluster, created.instance_id)
    done = time.monotonic()
    node = cluster.nodes[index - 1]
    return inst, done - started, await breakdown(node, started, done)


def kib(n: int) -> str:
    return f"{n / 1024:,.0f} KiB"


async def storage_cost(cluster: VmCluster) -> None:
    image = cluster.service.image("base1")
    assert image is not None
    vol = await cluster.storage.create_volume("bench-fresh", "bench", "base1")
    try:
        print(
            f"storage: a fresh tenant volume takes {kib(vol.size_bytes)} on disk; a copy of "
            f"the base image would take {kib(image.size_bytes)} (its qcow2) or "
            f"{kib(image.virtual_size)} (raw, the {image.virtual_size >> 20} MiB disk)"
        )
    finally:
        await cluster.storage.delete_volume("bench-fresh")


async def one_node(cluster: VmCluster) -> None:
    a, took, spans = await timed_create(cluster, 1, "tenantA")
    print(f"one node: request -> ACTIVE {took:.1f}s{spans}  (load {load()})")
    volumes = {v.name: v for v in await cluster.storage.list_volumes()}
    print(f"storage: tenant A's volume after one boot: {kib(volumes[a.volume].size_bytes)}")
    started = time.monotonic()
    await cluster.service.switch(a.instance_id, "tenantB", "base1", user_data=USER_DATA)
    await active(cluster, a.instance_id)
    done = time.monotonic()
    spans = await breakdown(cluster.nodes[0], started, done)
    print(f"tenant switch (A -> B, same node): {done - started:.1f}s{spans}  (load {load()})")
    started = time.monotonic()
    await cluster.service.release(a.instance_id, keep_volume=False)
    took = time.monotonic() - started
    print(f"release (export removed, powered off, volume deleted): {took:.2f}s")
    await cluster.service.delete_volume(a.volume)


async def many_nodes(cluster: VmCluster, count: int) -> None:
    started = time.monotonic()
    results = await asyncio.gather(
        *(timed_create(cluster, i, f"tenant{i}") for i in range(1, count + 1))
    )
    total = time.monotonic() - started
    each = ", ".join(f"{t:.1f}" for _, t, _ in results)
    print(
        f"{count} nodes at once: request -> all ACTIVE {total:.1f}s (each: {each} s)"
        f"  (load {load()})"
    )
    for index, (_, _, spans) in enumerate(results, start=1):
        print(f"  node {index}:{spans}")
    started = time.monotonic()
    await asyncio.gather(
        *(cluster.service.release(inst.instance_id, keep_volume=False) for inst, _, _ in results)
    )
    print(f"{count} releases at once: {time.monotonic() - started:.2f}s")


async def measure(args: argparse.Namespace, work: Path) -> None:
    names = args.variant or ["cloud"]
    kernels = {}
    for name in names:
        guest = VARIANTS[name][0]
        if (reason := provision_vm.missing_tools(guest)) is not None:
            raise SystemExit(f"provision bench: {reason}")
        kernels[name] = rxe_kernel.ensure_kernel(rxe_kernel.cache_root(), guest.spec)
    server = NatsServer(store_dir=work / "js")
    url = await asyncio.to_thread(server.start)
    try:
        nc = await nats.connect(url, name="provision-bench")
        subjects = Subjects("mg")
        await ensure_streams(nc.jetstream(timeout=10), subjects)
        await nc.close()
        certificate = make_certificate(work)
        count = 1 if args.skip_many else args.nodes
        print(machine_note())
        for run in range(args.rounds):
            for name in names:
                (guest, fast), kernel = VARIANTS[name], kernels[name]
                print(
                    f"--- round {run + 1}: {name} ({kernel.package}, {guest.nic} NIC, "
                    f"speed-ups {'on' if fast else 'off'})"
                )
                async with provision_cluster.vm_cluster(
                    work / f"{name}-{run}",
                    url,
                    subjects,
                    certificate,
                    kernel,
                    count=count,
                    memory_mb=args.memory,
                    nic=guest.nic,
                    kernel_args=provision_cluster.KERNEL_ARGS if fast else "",
                    skip_banner=fast,
                ) as cluster:
                    if run == 0:
                        await storage_cost(cluster)
                    await one_node(cluster)
                    if not args.skip_many:
                        await many_nodes(cluster, count)
        print(f"load average after: {load()}")
    finally:
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=4, help="VMs booted at once")
    parser.add_argument("--memory", type=int, default=provision_vm.MEMORY_MB, help="MiB per VM")
    parser.add_argument("--skip-many", action="store_true", help="one node only")
    parser.add_argument(
        "--variant",
        action="append",
        choices=sorted(VARIANTS),
        help="the guest kernel and speed-ups (repeat for an interleaved A/B; default: cloud)",
    )
    parser.add_argument("--rounds", type=int, default=1, help="runs of each --variant")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="provision-bench-") as tmp:
        asyncio.run(measure(args, Path(tmp)))


if __name__ == "__main__":
    main()
