"""Simulated provisioning hardware for the demo (docs/demo.md, docs/provisioning.md): the
node's BMC, its network boot and the storage, with no VM, no qemu-img and no NBD.

The demo (and the API tests) run the real :class:`~metalguard.controller.provision.
manager.ProvisionService`, its KV records and its boot server over these:

- :class:`SimImages` — the base image registry (``ImageStore``), records only;
- :class:`SimStorage` — tenant volumes and their exports (``VolumeBackend``), kept in
  memory with the real storage's rules and errors: a volume over a known image, one
  export per volume and per name, no deleting an exported volume, export names of 16-128
  characters;
- :class:`SimPower` — the BMC (``PowerDriver``): ``network_boot`` starts a simulated
  boot that does what a real node does on the wire, a moment later: it fetches the boot
  server's ``/boot.ipxe`` and its own ``/boot/<mac>.ipxe`` by MAC over HTTP, reads the
  kernel command line (``nbdroot=``, ``mg.ready=``, ``mg.userdata=``), "attaches" its
  export (it must be served: :meth:`SimStorage.attach`), writes a line into its volume,
  fetches its user data and posts its ready report.  ``power_off`` ends a boot under
  way.  Nodes can be told to refuse (a BMC that fails: 502), to stay silent (504), or to
  boot and never report (the deploy timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import aiohttp
from aiohttp import web
from nats.aio.client import Client
from nats.js import JetStreamContext

from metalguard.controller.provision.bootserver import start_boot_server
from metalguard.controller.provision.manager import (
    NodeRecords,
    ProvisionService,
    ProvisionSettings,
)
from metalguard.controller.provision.power import PowerError
from metalguard.controller.provision.spec import normalize_mac
from metalguard.controller.provision.storage import ExportInfo, StorageError
from metalguard.controller.provision.store import ProvisionStore
from metalguard.proto.provision import Image, Volume
from metalguard.proto.subjects import Subjects

log = logging.getLogger(__name__)

FRESH_OVERLAY_BYTES = 196_608
"""What a fresh qcow2 overlay takes on disk (measured: ~192 KiB, docs/provisioning.md)."""
EXPORT_NAME = re.compile(r"^[A-Za-z0-9_.-]{16,128}\Z")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}\Z")
KERNEL_RE = re.compile(r"^kernel\s+(\S+)\s*(.*)$", re.MULTILINE)
BOOT_TIMEOUT_S = 10.0


class SimImages:
    """Base images as records in memory (no file is made): ``ImageStore``."""

    def __init__(
        self,
        in_use: Callable[[str], list[str]] = lambda _name: [],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._images: dict[str, Image] = {}
        self._in_use = in_use
        self._clock = clock

    def get(self, name: str) -> Image | None:
        """The image ``name``, or None."""
        return self._images.get(name)

    def list(self) -> list[Image]:
        """Every image, by name."""
        return [self._images[n] for n in sorted(self._images)]

    async def add_from_dir(
        self, name: str, directory: str | os.PathLike[str], size_bytes: int
    ) -> Image:
        """A record of an image "built" from ``directory`` (which must exist; nothing is
        read): ``size_bytes`` (or 64 MiB), the checksum of the path."""
        self._check_new(name)
        src = Path(directory)
        _, digest = await asyncio.to_thread(_tree, name, src)
        size = size_bytes or 64 << 20
        return self._add(name, size, size, digest, f"dir:{src}")

    async def add_file(self, name: str, path: str | os.PathLike[str]) -> Image:
        """A record of the image file at ``path`` (its size and sha256)."""
        self._check_new(name)
        src = Path(path)
        try:
            data = await asyncio.to_thread(src.read_bytes)
        except OSError as exc:
            raise StorageError(
                f"image {name!r}: cannot read {str(src)!r}: {exc}", "invalid"
            ) from None
        if not data:
            raise StorageError(f"image {name!r}: the file is empty", "invalid")
        digest = hashlib.sha256(data).hexdigest()
        return self._add(name, len(data), len(data), digest, f"upload:{src.name}")

    async def delete(self, name: str) -> None:
        """Forget image ``name``: 404 unknown, 409 while volumes are made from it."""
        if name not in self._images:
            raise StorageError(f"no image {name!r}", "not_found")
        users = self._in_use(name)
        if users:
            raise StorageError(
                f"image {name!r} is the base of volumes {', '.join(users)}", "conflict"
            )
        del self._images[name]

    def _check_new(self, name: str) -> None:
        if not NAME.match(name) or len(name) > 64:
            raise StorageError(f"{name!r} is not an image name", "invalid")
        if name in self._images:
            raise StorageError(f"image {name!r} exists already", "conflict")

    def _add(self, name: str, size: int, virtual: int, digest: str, source: str) -> Image:
        image = Image(
            name=name,
            size_bytes=size,
            virtual_size=virtual,
            sha256=digest,
            created_ts=self._clock(),
            source=source,
        )
        self._images[name] = image
        return image


def _tree(name: str, src: Path) -> tuple[int, str]:
    """The directory's entries (not walked: a record only) and a digest of its path."""
    if not src.is_absolute() or not src.is_dir():
        raise StorageError(f"image {name!r}: no directory {str(src)!r}", "invalid")
    return len(list(src.iterdir())), hashlib.sha256(str(src).encode()).hexdigest()


@dataclass
class SimVolume:
    """A volume and what the nodes that booted it wrote there."""

    volume: Volume
    lines: list[str] = field(default_factory=list)


class SimStorage:
    """Tenant volumes and their exports in memory: ``VolumeBackend``."""

    def __init__(
        self,
        images: SimImages | None = None,
        *,
        nbd_host: str = "127.0.0.1",
        nbd_port: int = 10809,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.images = images if images is not None else SimImages(clock=clock)
        self.images._in_use = self.users_of
        self.nbd_host = nbd_host
        self.nbd_port = nbd_port
        self._clock = clock
        self._volumes: dict[str, SimVolume] = {}
        self._exports: dict[str, str] = {}
        self.fail_exports = False
        """Every export refused (the daemon down: 502) while True (tests)."""

    def users_of(self, image: str) -> list[str]:
        """The volumes made from ``image``."""
        return sorted(n for n, v in self._volumes.items() if v.volume.image == image)

    async def create_volume(self, name: str, tenant: str, image: str) -> Volume:
        """A new "copy-on-write" volume of ``tenant`` over ``image``."""
        if not NAME.match(name):
            raise StorageError(f"{name!r} is not a volume name", "invalid")
        if self.images.get(image) is None:
            raise StorageError(f"no image {image!r}", "not_found")
        if name in self._volumes:
            raise StorageError(f"volume {name!r} exists already", "conflict")
        volume = Volume(
            name=name,
            tenant=tenant,
            image=image,
            size_bytes=FRESH_OVERLAY_BYTES,
            created_ts=self._clock(),
        )
        self._volumes[name] = SimVolume(volume)
        return volume

    async def delete_volume(self, name: str, missing_ok: bool = False) -> None:
        """Delete volume ``name``: 404 if absent (unless ``missing_ok``), 409 while exported."""
        if name not in self._volumes:
            if missing_ok:
                return
            raise StorageError(f"no volume {name!r}", "not_found")
        if name in self._exports.values():
            raise StorageError(f"volume {name!r} is exported: unexport it first", "conflict")
        del self._volumes[name]

    async def list_volumes(self) -> list[Volume]:
        """Every volume with its size, by name."""
        return [self._volumes[n].volume for n in sorted(self._volumes)]

    async def export(self, volume: str, export_name: str) -> ExportInfo:
        """Serve ``volume`` as ``export_name`` (idempotent for the same pair)."""
        if self.fail_exports:
            raise StorageError("the export server is down (simulated)", "failed")
        if not EXPORT_NAME.match(export_name):
            raise StorageError("invalid export name: 16 to 128 of [A-Za-z0-9_.-]", "invalid")
        if volume not in self._volumes:
            raise StorageError(f"no volume {volume!r}", "not_found")
        served = self._exports.get(export_name)
        if served == volume:
            return ExportInfo(self.nbd_host, self.nbd_port, export_name)
        if served is not None or volume in self._exports.values():
            raise StorageError(f"volume {volume!r} or that export is served already", "conflict")
        self._exports[export_name] = volume
        return ExportInfo(self.nbd_host, self.nbd_port, export_name)

    async def unexport(self, export_name: str) -> None:
        """Stop serving ``export_name`` (idempotent)."""
        self._exports.pop(export_name, None)

    async def list_exports(self) -> list[str]:
        """The export names served now."""
        return sorted(self._exports)

    def attach(self, export_name: str) -> str | None:
        """What a node's NBD client gets for ``export_name``: the volume's name, or None
        (no such export: the server refuses the name)."""
        return self._exports.get(export_name)

    def write(self, volume: str, line: str) -> None:
        """A node writes ``line`` on its root volume."""
        if volume in self._volumes:
            self._volumes[volume].lines.append(line)

    def lines(self, volume: str) -> list[str]:
        """What nodes wrote on ``volume``."""
        return list(self._volumes[volume].lines) if volume in self._volumes else []


@dataclass(frozen=True, slots=True)
class BootScript:
    """What a node reads from its iPXE script: the kernel command line's parts."""

    kernel: str
    nbd_export: str
    instance: str
    ready_url: str
    userdata_url: str


def parse_boot_script(text: str) -> BootScript | None:
    """The boot of an iPXE script as the boot server writes it, or None (no ``kernel``
    line: "no instance for this node", the node falls through)."""
    m = KERNEL_RE.search(text)
    if m is None:
        return None
    args = dict(a.split("=", 1) for a in m.group(2).split() if "=" in a)
    nbdroot = args.get("nbdroot", "").split(",")
    return BootScript(
        kernel=m.group(1),
        nbd_export=nbdroot[2] if len(nbdroot) == 3 else "",
        instance=args.get("mg.instance", ""),
        ready_url=args.get("mg.ready", ""),
        userdata_url=args.get("mg.userdata", ""),
    )


class SimPower:
    """The simulated nodes' BMCs (``PowerDriver``) and what their network boot does.

    ``macs``: node handle -> MAC; ``boot_url()``: the boot server's base URL (read at each
    boot); ``delay_s``: from the power cycle to the booted image's ready report.
    """

    def __init__(
        self,
        macs: Mapping[str, str],
        storage: SimStorage,
        boot_url: Callable[[], str],
        *,
        delay_s: float = 1.0,
        on_boot: Callable[[str, str], None] | None = None,
    ) -> None:
        self._macs = dict(macs)
        self._storage = storage
        self._boot_url = boot_url
        self.delay_s = delay_s
        self._on_boot = on_boot
        self._done: dict[str, str] = {}
        """Command id -> what it did (a repeat is answered from memory, like the proxy)."""
        self._boots: dict[str, asyncio.Task[None]] = {}
        self.refuse: set[str] = set()
        """Nodes whose BMC refuses every command (502)."""
        self.silent: set[str] = set()
        """Nodes whose BMC does not answer (504)."""
        self.no_report: set[str] = set()
        """Nodes that boot but whose image never reports ready (the deploy timeout)."""
        self.powered: dict[str, bool] = {}
        self.reports: list[tuple[str, str, int]] = []
        """(node, instance, HTTP status) of every ready report posted."""

    async def network_boot(self, node: str, command_id: str) -> None:
        """PXE once, then a power cycle: the node's boot starts (after ``delay_s`` it has
        posted its ready report, when all goes well)."""
        self._check(node, "bmc_pxe_once")
        if command_id in self._done:
            return
        self._done[command_id] = "boot"
        self.powered[node] = True
        old = self._boots.pop(node, None)
        if old is not None:
            old.cancel()
        self._boots[node] = asyncio.create_task(self._boot(node), name=f"sim-boot-{node}")

    async def power_off(self, node: str, command_id: str) -> None:
        """Forced off: a boot under way ends there."""
        self._check(node, "bmc_power_off")
        self._done.setdefault(command_id, "off")
        self.powered[node] = False
        boot = self._boots.pop(node, None)
        if boot is not None:
            boot.cancel()

    async def close(self) -> None:
        """Stop every boot under way."""
        boots = list(self._boots.values())
        self._boots.clear()
        for boot in boots:
            boot.cancel()
        await asyncio.gather(*boots, return_exceptions=True)

    def _check(self, node: str, verb: str) -> None:
        if node not in self._macs:
            raise PowerError(504, f"{verb} to {node}: no bmc-proxy answers for it")
        if node in self.silent:
            raise PowerError(504, f"{verb} to {node}: the BMC did not answer (simulated)")
        if node in self.refuse:
            raise PowerError(502, f"{verb} to {node}: failed: the BMC refused (simulated)")

    async def _boot(self, node: str) -> None:
        """The node's firmware and image, over the wire: iPXE chain, attach, report."""
        try:
            await asyncio.sleep(self.delay_s / 2)  # POST, DHCP, iPXE
            async with aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=BOOT_TIMEOUT_S)
            ) as http:
                script = await self._script(http, node)
                if script is None:
                    return  # no instance for this node: it falls through to its disk
                volume = self._storage.attach(script.nbd_export)
                if volume is None:
                    log.info("sim %s: NBD export refused: the boot stops in the initramfs", node)
                    return
                await asyncio.sleep(self.delay_s / 2)  # kernel, initramfs, switch_root
                user_data = await _text(http, script.userdata_url)
                self._storage.write(volume, f"booted {script.instance} on {node}")
                if self._on_boot is not None:
                    self._on_boot(node, script.instance)
                if node in self.no_report:
                    return
                report = {
                    "boot_id": f"sim-{script.instance}-{time.monotonic_ns()}",
                    "kernel": "metalguard-sim",
                    "node": node,
                    "output": f"user data: {len(user_data)} bytes",
                }
                async with http.post(script.ready_url, json=report) as answer:
                    self.reports.append((node, script.instance, answer.status))
        except asyncio.CancelledError:
            raise
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            log.warning("sim %s: boot failed: %s", node, exc)
        finally:
            with contextlib.suppress(KeyError):
                if self._boots[node] is asyncio.current_task():
                    del self._boots[node]

    async def _script(self, http: aiohttp.ClientSession, node: str) -> BootScript | None:
        base = self._boot_url().rstrip("/")
        chain = await _text(http, f"{base}/boot.ipxe")
        m = re.search(r"^chain\s+(\S+)", chain, re.MULTILINE)
        if m is None:
            return None
        url = m.group(1).replace("${net0/mac:hexhyp}", self._macs[node].replace(":", "-"))
        return parse_boot_script(await _text(http, url))


async def _text(http: aiohttp.ClientSession, url: str) -> str:
    if not url:
        return ""
    async with http.get(url) as answer:
        answer.raise_for_status()
        return await answer.text()


def sim_mac(index: int) -> str:
    """The demo's MAC of its ``index``-th provisioned node (``52:54:00:6d:gg:00`` on)."""
    return f"52:54:00:6d:{(index >> 8) & 0xFF:02x}:{index & 0xFF:02x}"


class SimProvisioning:
    """The real ProvisionService and boot server over the simulated hardware: what
    ``metalguard demo`` runs for a region, and what the API tests drive."""

    def __init__(
        self,
        service: ProvisionService,
        storage: SimStorage,
        power: SimPower,
        runner: web.AppRunner,
        boot_url: str,
    ) -> None:
        self.service = service
        self.storage = storage
        self.images = storage.images
        self.power = power
        self.boot_url = boot_url
        self._runner = runner

    @classmethod
    async def start(
        cls,
        nc: Client,
        js: JetStreamContext,
        subjects: Subjects,
        region: str,
        nodes: NodeRecords,
        macs: Mapping[str, str],
        *,
        boot_delay_s: float = 1.0,
        deploy_timeout_s: float = 30.0,
        tick_s: float = 0.5,
        leading: Callable[[], bool] = lambda: True,
    ) -> SimProvisioning:
        """Open ``<P>_PROVISION``, start the service's passes and the boot server on a
        free loopback port (the simulated nodes boot from it)."""
        storage = SimStorage()
        settings = ProvisionSettings(
            macs={node: normalize_mac(mac) for node, mac in macs.items()},
            boot_url="http://127.0.0.1:0",
            deploy_timeout_s=deploy_timeout_s,
            tick_s=tick_s,
            release_retry_s=max(2 * tick_s, 0.5),
        )
        holder: dict[str, str] = {"url": settings.boot_url}
        power = SimPower(settings.macs, storage, lambda: holder["url"], delay_s=boot_delay_s)
        service = ProvisionService(
            nc,
            js,
            await ProvisionStore.open(js, subjects),
            nodes,
            subjects,
            region,
            settings,
            images=storage.images,
            storage=storage,
            power=power,
            leading=leading,
        )
        runner, port = await start_boot_server(service, "127.0.0.1:0")
        holder["url"] = f"http://127.0.0.1:{port}"
        service.settings = replace(settings, boot_url=holder["url"])  # what the scripts say
        await service.start()
        return cls(service, storage, power, runner, holder["url"])

    async def stop(self) -> None:
        """Stop the boots under way, the boot server and the service's passes."""
        await self.power.close()
        await self._runner.cleanup()
        await self.service.stop()
