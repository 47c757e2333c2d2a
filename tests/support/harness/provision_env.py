"""The building blocks of the provisioning service tests (test_provision_service.py):
a region with real parts and no VM.

- nodes ``r1.c1.n01..n03``, each with its own Redfish emulator (HTTPS) behind one real
  bmc-proxy command service (agent/bmc/commands.py) on the session nats-server; ``n04``
  is provisioned (a MAC) but no bmc-proxy answers for it; ``n05`` has a MAC and no node
  record;
- the region controller's real NodeStore and RegionController (the nodes' records come
  from real batches; a fatal NodeEvent isolates through the real lifecycle);
- E's real storage (qemu-img overlays, one qemu-storage-daemon serving NBD) with a base
  image built from a directory;
- the ProvisionService with its boot server on a loopback port, time injected
  (:class:`ShiftedClock`: real time plus what the test skips);
- the "guest": :meth:`ProvisionEnv.guest_boot` waits for the emulator's network boot,
  fetches the node's iPXE script from the boot server like iPXE does, checks the export
  it names is really served (an NBD client reads the ext4 superblock through it) and
  posts the ready report to the URL the script gives.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import shutil
import socket
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web
from nats.aio.client import Client
from nats.aio.msg import Msg

from metalguard.agent.bmc.commands import BmcCommandService
from metalguard.agent.bmc.remediation import Remediator, open_control
from metalguard.agent.connection import NatsSettings
from metalguard.controller.core.lifecycle import LifecycleConfig
from metalguard.controller.provision import machine
from metalguard.controller.provision.bootserver import start_boot_server
from metalguard.controller.provision.manager import ProvisionService, ProvisionSettings
from metalguard.controller.provision.power import BmcPower
from metalguard.controller.provision.spec import mac_path
from metalguard.controller.provision.storage import QemuStorage
from metalguard.controller.provision.store import ProvisionStore
from metalguard.controller.region import RegionController
from metalguard.controller.state.store import NodeStore
from metalguard.proto.base import NodeIdentity
from metalguard.proto.codec import decode
from metalguard.proto.events import ControllerEvent, NodeEvent
from metalguard.proto.provision import Instance
from metalguard.proto.subjects import Subjects
from metalguard.proto.telemetry import TelemetryBatch
from tests.support.harness import nbd_client
from tests.support.harness.bmc_client import credentials, serving, target
from tests.support.harness.redfish_emulator import Certificate, RedfishEmulator, start_emulator
from tests.support.waiting import wait_until

REGION = "r1"
NODES = ("r1.c1.n01", "r1.c1.n02", "r1.c1.n03")
NO_BMC = "r1.c1.n04"
"""Provisioned, with a node record, but no bmc-proxy answers its BMC verbs."""
NO_RECORD = "r1.c1.n05"
"""Provisioned (a MAC), but the controller has no record of it."""
MACS = {f"r1.c1.n0{i}": f"52:54:00:00:00:0{i}" for i in range(1, 6)}
TOOLS = ("qemu-img", "qemu-storage-daemon", "mke2fs")
MIB = 1024 * 1024
EXT4_MAGIC_OFFSET = 1024 + 0x38
WAIT_S = 30.0
LIFECYCLE = LifecycleConfig(rail_max_fraction=1.0, rail_min_nodes=1000)
"""No safety rail: a fatal event isolates its node."""


def missing_tools() -> list[str]:
    """The storage tools not installed here."""
    return [t for t in TOOLS if shutil.which(t) is None]


def free_port() -> int:
    """A free loopback TCP port (bound again by the daemon soon after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def identity(handle: str) -> NodeIdentity:
    region, cluster, node = handle.split(".")
    return NodeIdentity(region=region, cluster=cluster, node=node)


@dataclass
class ShiftedClock:
    """Real time plus ``skipped`` seconds (a test jumps past a deadline)."""

    skipped: float = 0.0

    def __call__(self) -> float:
        return time.time() + self.skipped


@dataclass
class Bmc:
    """One node's Redfish emulator on loopback."""

    emulator: RedfishEmulator
    runner: web.AppRunner
    address: str

    def pxe_boots(self) -> int:
        return self.emulator.boots.count("Pxe")


@dataclass
class ProvisionEnv:
    """The region under test (see the module docstring)."""

    nc: Client
    subjects: Subjects
    tmp: Path
    storage: QemuStorage
    nodes: NodeStore
    region: RegionController
    bmcs: dict[str, Bmc]
    settings: ProvisionSettings
    clock: ShiftedClock
    service: ProvisionService
    boot_url: str
    http: aiohttp.ClientSession
    proxy: BmcCommandService | None = None
    """The bmc-proxy's command service (its counters)."""
    events: list[ControllerEvent] = field(default_factory=list)
    seq: int = 0

    async def on_event(self, msg: Msg) -> None:
        self.events.append(decode(msg.data, ControllerEvent))

    def kinds(self, instance_id: str = "") -> list[str]:
        """The kinds of the events seen (of one instance when given), in order."""
        return [
            e.kind
            for e in self.events
            if not instance_id or e.attributes.get("instance") == instance_id
        ]

    async def wait_event(self, kind: str, instance_id: str = "") -> ControllerEvent:
        await wait_until(lambda: kind in self.kinds(instance_id), WAIT_S, f"event {kind}")
        return next(
            e
            for e in self.events
            if e.kind == kind and (not instance_id or e.attributes.get("instance") == instance_id)
        )

    # --- the nodes ---------------------------------------------------------------------------

    async def report(self, handle: str) -> None:
        """A clean batch of ``handle`` through the region controller (HEALTHY)."""
        self.seq += 1
        now = time.time()
        batch = TelemetryBatch(node=identity(handle), seq=self.seq, ts=now, interval_s=5.0)
        await self.region.on_batch(batch, now)

    async def isolate(self, handle: str) -> None:
        """A fatal NodeEvent of ``handle``: the real lifecycle makes it FAILING."""
        self.seq += 1
        event = NodeEvent(
            node=identity(handle),
            event_id=f"{handle}-aer-{self.seq}",
            ts=time.time(),
            kind="aer_fatal",
            source="pcie",
            device="0000:41:00.0",
            message="fatal AER error on 0000:41:00.0",
        )
        await self.region.on_node_event(event, time.time())
        assert self.nodes.records[handle].grade == "FAILING"

    # --- the guest ---------------------------------------------------------------------------

    async def script(self, handle: str) -> str:
        """The iPXE script the node's firmware gets: the bootfile, then its chain."""
        async with self.http.get(f"{self.boot_url}/boot.ipxe") as resp:
            chain = await resp.text()
        assert "chain " in chain
        assert "${net0/mac:hexhyp}" in chain
        url = (
            chain.split("chain ", 1)[1]
            .strip()
            .replace("${net0/mac:hexhyp}", mac_path(MACS[handle]))
        )
        async with self.http.get(url) as resp:
            assert resp.status == 200
            return await resp.text()

    async def guest_boot(self, handle: str, boots_before: int, *, ready: bool = True) -> str:
        """Be the node's booted image: once its BMC recorded a network boot after
        ``boots_before``, fetch its script, attach the export it names (an NBD read of the
        file system's superblock) and, with ``ready``, post the ready report.  The export
        name the script carried."""
        bmc = self.bmcs[handle]
        await wait_until(lambda: bmc.pxe_boots() > boots_before, WAIT_S, f"{handle} PXE boot")
        text = await self.script(handle)
        match = re.search(r"nbdroot=([^,\s]+),(\d+),(\S+)", text)
        assert match is not None, text
        host, port, export = match.group(1), int(match.group(2)), match.group(3)
        client = await nbd_client.connect(host, port, export)
        try:
            magic = await client.read(EXT4_MAGIC_OFFSET, 2)
        finally:
            await client.close()
        assert magic == b"\x53\xef", "the export is not the image's ext4 file system"
        if ready:
            ready_url = re.search(r"mg\.ready=(\S+)", text)
            assert ready_url is not None, text
            async with self.http.post(ready_url.group(1), json={"boot_id": "b-1"}) as resp:
                assert resp.status == 200, await resp.text()
        return export

    # --- what is left ------------------------------------------------------------------------

    async def orphans(self) -> list[str]:
        """What nothing live owns, read afresh from KV and the storage (empty: none)."""
        fresh = await ProvisionStore.open(self.nc.jetstream(timeout=5), self.subjects)
        volumes = [v.name for v in await self.storage.list_volumes()]
        exports = await self.storage.list_exports()
        return machine.orphans(
            fresh.instances.values(), volumes, fresh.volumes, exports, fresh.claims
        )

    async def new_service(self) -> ProvisionService:
        """Another service over the same KV and storage (a restarted controller)."""
        store = await ProvisionStore.open(self.nc.jetstream(timeout=5), self.subjects)
        return make_service(self, store)


class CurrentService:
    """The boot server's view of whichever service the env holds now (a test replaces
    it to restart the controller)."""

    def __init__(self, env: ProvisionEnv) -> None:
        self._env = env

    @property
    def settings(self) -> ProvisionSettings:
        return self._env.service.settings

    def boot_instance(self, mac: str) -> Instance | None:
        return self._env.service.boot_instance(mac)

    def user_data(self, instance_id: str, export: str) -> str:
        return self._env.service.user_data(instance_id, export)

    async def report_ready(
        self, instance_id: str, export: str, report: Mapping[str, str]
    ) -> Instance:
        return await self._env.service.report_ready(instance_id, export, report)


def make_service(env: ProvisionEnv, store: ProvisionStore) -> ProvisionService:
    return ProvisionService(
        env.nc,
        env.nc.jetstream(timeout=5),
        store,
        env.nodes,
        env.subjects,
        REGION,
        env.settings,
        images=env.storage.images,
        storage=env.storage,
        power=BmcPower(env.nc, env.subjects, timeout_s=10.0, clock=env.clock),
        clock=env.clock,
    )


async def start_bmcs(certificate: Certificate) -> dict[str, Bmc]:
    """One Redfish emulator per node of :data:`NODES`."""
    out = {}
    for handle in NODES:
        emulator = RedfishEmulator(shutdown_polls=1)
        runner, address = await start_emulator(emulator, certificate)
        out[handle] = Bmc(emulator, runner, address)
    return out


@contextlib.asynccontextmanager
async def bmc_proxy(
    bmcs: dict[str, Bmc], certificate: Certificate, tmp: Path, nats_url: str, subjects: Subjects
) -> AsyncIterator[BmcCommandService]:
    """A real bmc-proxy command service answering the BMC verbs of every node in ``bmcs``."""
    creds = credentials(tmp)
    targets = [target(b.address, creds, node=handle) for handle, b in bmcs.items()]
    opener = functools.partial(open_control, cafile=str(certificate.cert))
    remediator = Remediator(
        opener=opener, poll_s=0.01, transition_timeout_s=5.0, store=tmp / "outcomes.jsonl"
    )
    svc = BmcCommandService(targets, remediator, NatsSettings(servers=(nats_url,)), subjects)
    async with serving(svc) as running:
        yield running


async def build_image(storage: QemuStorage, tmp: Path, name: str = "base") -> None:
    """A small base image built from a directory (ext4 via mke2fs -d, then qcow2)."""
    root = tmp / f"rootfs-{name}"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "os-release").write_text(f"ID={name}\n")
    await storage.images.add_from_dir(name, root, 8 * MIB)


@contextlib.asynccontextmanager
async def provision_env(
    nc: Client,
    nats_url: str,
    subjects: Subjects,
    certificate: Certificate,
    tmp: Path,
    **settings: object,
) -> AsyncIterator[ProvisionEnv]:
    """The whole region, torn down at the end (``settings`` override ProvisionSettings)."""
    js = nc.jetstream(timeout=5)
    storage = QemuStorage(tmp / "data", listen_host="127.0.0.1", listen_port=free_port())
    await storage.start()
    bmcs = await start_bmcs(certificate)
    http = aiohttp.ClientSession()
    runner: web.AppRunner | None = None
    service: ProvisionService | None = None
    try:
        await build_image(storage, tmp)
        nodes = await NodeStore.open(js, subjects)
        region = RegionController(js, nodes, subjects, REGION, LIFECYCLE)
        clock = ShiftedClock()
        base = ProvisionSettings(
            macs=MACS,
            boot_url="http://127.0.0.1:0",
            nbd_host=storage.nbd_host,
            nbd_port=storage.nbd_port,
            deploy_timeout_s=60.0,
            deploy_attempts=3,
            max_failures=3,
            tick_s=3600.0,  # the tests run the passes themselves
        )
        env_settings = dataclasses.replace(base, **settings)  # type: ignore[arg-type]
        store = await ProvisionStore.open(js, subjects)
        async with bmc_proxy(bmcs, certificate, tmp, nats_url, subjects) as proxy:
            env = ProvisionEnv(
                nc=nc,
                subjects=subjects,
                tmp=tmp,
                storage=storage,
                nodes=nodes,
                region=region,
                bmcs=bmcs,
                settings=env_settings,
                clock=clock,
                service=None,  # type: ignore[arg-type]
                boot_url="",
                http=http,
                proxy=proxy,
            )
            service = env.service = make_service(env, store)
            runner, port = await start_boot_server(CurrentService(env), "127.0.0.1:0")
            env.boot_url = f"http://127.0.0.1:{port}"
            env.settings = dataclasses.replace(env_settings, boot_url=env.boot_url)
            service.settings = env.settings
            sub = await nc.subscribe(subjects.control_all(REGION), cb=env.on_event)
            for handle in (*NODES, NO_BMC):
                await env.report(handle)
            await service.start()
            try:
                yield env
            finally:
                await sub.unsubscribe()
                await env.service.stop()
                await service.stop()  # the first one, when a test replaced it
    finally:
        if runner is not None:
            await runner.cleanup()
        await http.close()
        for bmc in bmcs.values():
            await bmc.runner.cleanup()
        await storage.close(stop_daemon=True)


def active_on(inst: Instance, handle: str) -> bool:
    return inst.state == "active" and inst.node == handle
