"""The provisioning service: instances on bare-metal nodes (docs/provisioning.md).

:class:`ProvisionService` is the thin I/O around the pure :mod:`machine`: it claims nodes
and writes instance records to KV ``<P>_PROVISION`` (:mod:`store`) **before** it acts,
creates and exports tenant volumes through a :class:`VolumeBackend` (E's
:class:`~metalguard.controller.provision.storage.QemuStorage`, or the demo's), boots nodes
through a :class:`PowerDriver` (:class:`~metalguard.controller.provision.power.BmcPower`:
``bmc_pxe_once`` + ``bmc_power_cycle`` to the node's bmc-proxy) and announces
``<p>.ctl.<region>.instance.<kind>`` events.  Only the region's leader acts (like the job
manager); a follower reloads the bucket each pass to answer reads and answers changes
with 503 ``not_leader``.

The interface (what the API, CLI, demo and boot server use)::

    await svc.start() / await svc.stop()
    await svc.create(InstanceRequest) -> Instance        # returns once DEPLOYING: the node
                                                         # was told to network-boot
    await svc.switch(id, tenant, image, volume="", user_data="") -> Instance  # SWITCHING
    await svc.release(id, keep_volume) -> Instance       # RELEASED (or 502/504: RELEASING,
                                                         # finished by the passes)
    await svc.replace(id) -> Instance                    # DEPLOYING on another node
    await svc.wait_for(id, states=("active", "deploy_failed"), timeout_s) -> Instance
    await svc.instances() -> list[Instance]; await svc.instance(id) -> Instance | None
    await svc.volumes() -> list[Volume]; await svc.delete_volume(name)
    svc.list_images() -> list[Image]; svc.image(name) -> Image | None
    await svc.add_image_from_dir(name, directory, size_bytes) -> Image
    await svc.add_image_file(name, path) -> Image; await svc.delete_image(name)
    svc.node_states() -> dict[handle, NodeProvisionState]
    svc.provision_nodes() -> list[ProvisionNode]         # mac, state, tenant, failures...
    await svc.clear_flag(node) -> ProvisionNode           # an operator clears a flagged node
    svc.volume_users() -> dict[volume, instance id]      # volumes a live instance uses
    svc.images (ImageStore), svc.storage (VolumeBackend), svc.settings, svc.wanted_exports()
    await svc.run_pass()                                 # one pass now (tests, the demo)
    # the boot server's side (controller/provision/bootserver.py):
    svc.boot_instance(mac) -> Instance | None; await svc.report_ready(id, export, report)
    svc.user_data(id, export) -> str

Deleting a volume or an image, and adding images, go through ``svc.delete_volume`` /
``svc.delete_image`` / ``svc.add_image_*`` rather than ``svc.storage`` / ``svc.images``
directly: they refuse a volume a live instance uses (409) and keep the KV entries in step.

An instance is ACTIVE only on its node's ready report (``POST /ready/{id}/{export}``), or
on a telemetry batch of the node's own agent taken in after the network boot's power cycle
ended (an image that carries the agent).  A node is deployed only while HEALTHY and not
cordoned in the controller's records; one that turns FAILING while its instance is active
marks the instance (event ``instance.node_failing``, ``error`` says to ``replace`` it).

Every refusal is a :class:`ProvisionError` (``status`` 400/403/404/409/502/503/504,
``code``, ``message``, ``reasons``); after one, nothing the call made is left: its claim,
volume, export and record are rolled back.  The secret ``Instance.export`` never leaves
through the API: :func:`public` blanks it.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import secrets
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping
from typing import Any, Protocol

import msgspec
from msgspec.structs import replace
from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.js import JetStreamContext

from metalguard.controller.provision import machine, spec
from metalguard.controller.provision.announce import Announcer
from metalguard.controller.provision.errors import ProvisionError, storage_error
from metalguard.controller.provision.images import directory_allowed
from metalguard.controller.provision.power import BmcPower, PowerDriver, PowerError
from metalguard.controller.provision.resources import Resources
from metalguard.controller.provision.settings import ProvisionSettings
from metalguard.controller.provision.storage import StorageError, VolumeBackend
from metalguard.controller.provision.store import ProvisionConflictError, ProvisionStore
from metalguard.proto.nodes import NodeRecord
from metalguard.proto.provision import (
    Image,
    Instance,
    InstanceRequest,
    NodeProvisionState,
    Volume,
)
from metalguard.proto.subjects import Subjects
from metalguard.runtime.deadlines import wait_event, within

__all__ = [
    "BmcPower",
    "ImageStore",
    "PowerDriver",
    "ProvisionError",
    "ProvisionNode",
    "ProvisionService",
    "ProvisionSettings",
    "public",
]

log = logging.getLogger(__name__)

DONE_STATES = ("active", "deploy_failed")
"""What :meth:`ProvisionService.wait_for` waits for by default (a boot's end)."""


class ImageStore(Protocol):
    """The base images (:class:`~metalguard.controller.provision.images.ImageRegistry`)."""

    def get(self, name: str) -> Image | None: ...

    def list(self) -> list[Image]: ...

    async def add_from_dir(
        self, name: str, directory: str | os.PathLike[str], size_bytes: int
    ) -> Image: ...

    async def add_file(self, name: str, path: str | os.PathLike[str]) -> Image: ...

    async def delete(self, name: str) -> None: ...


class NodeRecords(Protocol):
    """The controller's node records, by handle (``NodeStore``)."""

    @property
    def records(self) -> Mapping[str, NodeRecord]: ...


class ProvisionNode(msgspec.Struct, frozen=True, kw_only=True):
    """A provisioned node as the API and the dashboard show it."""

    node: str
    mac: str
    state: NodeProvisionState
    instance_id: str = ""
    tenant: str = ""
    image: str = ""
    grade: str = ""
    """Its grade in the controller's records ("" = no record)."""
    cordoned: bool = False
    failures: int = 0
    flagged: bool = False


def public(inst: Instance) -> Instance:
    """``inst`` without its secret export name (what the API and CLI show)."""
    return replace(inst, export="") if inst.export else inst


def new_instance_id() -> str:
    """A fresh instance id, ``i-`` and 12 hex digits."""
    return f"i-{secrets.token_hex(6)}"


def new_export() -> str:
    """A fresh export secret: the NBD export's name and the token of the node's reports."""
    return secrets.token_hex(16)


class ProvisionService:
    """Provisions the region's nodes (docs/provisioning.md; the interface: this module's
    docstring)."""

    def __init__(
        self,
        nc: Client,
        js: JetStreamContext,
        store: ProvisionStore,
        nodes: NodeRecords,
        subjects: Subjects,
        region: str,
        settings: ProvisionSettings,
        *,
        images: ImageStore,
        storage: VolumeBackend,
        power: PowerDriver | None = None,
        clock: Callable[[], float] = time.time,
        leading: Callable[[], bool] = lambda: True,
    ) -> None:
        self._nc = nc
        self._js = js
        self.store = store
        self._nodes = nodes
        self._subjects = subjects
        self.region = region
        self.settings = settings
        self.images = images
        self.storage = storage
        self.power: PowerDriver = power or BmcPower(nc, subjects)
        self._clock = clock
        self._leading = leading
        self._led = False
        """Whether the last pass ran as the leader (a new leader resumes from KV first)."""
        self._by_mac = {mac: node for node, mac in settings.macs.items()}
        self._locks: dict[str, asyncio.Lock] = {}
        self._pass_lock = asyncio.Lock()
        self._changed = asyncio.Condition()
        self._announcer = Announcer(js, subjects, region, clock)
        self._res = Resources(
            store, storage, self._announcer, lambda: self.settings.max_failures, clock
        )
        self._release_tries: dict[str, int] = {}
        self._release_due: dict[str, float] = {}
        self._powered_on: dict[tuple[str, str], float] = {}
        """(instance, export) -> when its network boot's power cycle ended (telemetry
        from the node after that is from the new boot)."""
        self._task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._busy: set[str] = set()
        """Instances with a background step running (:meth:`_spawn`)."""
        self._wake = asyncio.Event()

    # --- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Load the bucket, resume what a previous run left (as the leader), start the
        passes."""
        await self.store.load()
        if self._leading():
            await self._resume()
            self._led = True
        self._task = asyncio.create_task(self._run(), name="provision")

    async def stop(self) -> None:
        """Stop the passes and the background work (instances stay as recorded)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def wake(self) -> None:
        """Run a pass now."""
        self._wake.set()

    async def _run(self) -> None:
        while True:
            try:
                await self.run_pass()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("provision pass failed; retrying on the next tick")
            await wait_event(self._wake, self.settings.tick_s)
            self._wake.clear()

    async def run_pass(self) -> None:
        """One pass: as a follower, reload the bucket; as the leader, publish what is
        unsent, then start the work the time and the node grades call for: a boot past its
        deadline fails (or is retried elsewhere), an active instance whose node turned
        FAILING is marked, a release whose power-off failed is tried again."""
        async with self._pass_lock:
            leading = self._leading()
            if not leading:
                self._led = False
                await self.store.load()
                await self._notify()
                return
            if not self._led:
                await self._resume()
                self._led = True
            await self._announcer.flush()
            now = self._clock()
            records = self._nodes.records
            for inst in list(self.store.instances.values()):
                if self._lock(inst.instance_id).locked():
                    continue  # a request or a background step is working on it
                if inst.state in machine.BOOTING:
                    record = records.get(inst.node)
                    if machine.timed_out(inst, now, self.settings.deploy_timeout_s):
                        self._spawn(self._boot_timed_out(inst.instance_id), inst.instance_id)
                    elif record is not None and machine.ready_by_telemetry(
                        inst,
                        record.last_seen_ts,
                        record.last_sent_ts,
                        self._powered_on.get((inst.instance_id, inst.export)),
                    ):
                        self._spawn(self._ready_by_telemetry(inst.instance_id), inst.instance_id)
                elif inst.state == "active":
                    record = records.get(inst.node)
                    if record is not None and record.grade == "FAILING":
                        await self._mark_failing(inst.instance_id, record.grade)
                elif inst.state == "releasing" and now >= self._release_due.get(
                    inst.instance_id, 0.0
                ):
                    self._spawn(self._retry_release(inst.instance_id), inst.instance_id)

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        """Run a background step of instance ``name`` (one at a time per instance)."""
        if name in self._busy:
            work.close()
            return
        self._busy.add(name)

        async def guarded() -> None:
            try:
                await work
            except ProvisionError as exc:
                log.warning("instance %s: %s", name, exc.message)
            except Exception:
                log.exception("instance %s: background step failed", name)
            else:
                self.wake()  # a pass may have skipped the instance meanwhile
            finally:
                self._busy.discard(name)

        task = asyncio.create_task(guarded(), name=f"provision-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- reads ---------------------------------------------------------------------------

    async def instances(self) -> list[Instance]:
        """Every instance (ended ones too), by creation time."""
        return sorted(self.store.instances.values(), key=lambda i: (i.created_ts, i.instance_id))

    async def instance(self, instance_id: str) -> Instance | None:
        """One instance, or None."""
        return self.store.instances.get(instance_id)

    async def wait_for(
        self,
        instance_id: str,
        states: Iterable[str] = DONE_STATES,
        timeout_s: float = 600.0,
    ) -> Instance:
        """Wait until the instance is in one of ``states``; ProvisionError 404 when there
        is no such instance, 504 when ``timeout_s`` passes first."""
        wanted = frozenset(states)

        def reached() -> bool:
            inst = self.store.instances.get(instance_id)
            return inst is None or inst.state in wanted

        async with self._changed:
            try:
                await within(self._changed.wait_for(reached), timeout_s)
            except TimeoutError:
                inst = self.store.instances.get(instance_id)
                state = inst.state if inst is not None else "gone"
                raise ProvisionError(
                    504, f"instance {instance_id} still {state} after {timeout_s:g}s"
                ) from None
        inst = self.store.instances.get(instance_id)
        if inst is None:
            raise ProvisionError(404, f"no instance {instance_id!r}")
        return inst

    def node_states(self) -> dict[str, NodeProvisionState]:
        """Each provisioned node's state, by handle."""
        return {node: self._node_state(node) for node in sorted(self.settings.macs)}

    def _node_state(self, node: str) -> NodeProvisionState:
        claim = self.store.claims.get(node)
        inst = self.store.instances.get(claim.instance_id) if claim and claim.instance_id else None
        return machine.node_state(claim, inst)

    def provision_nodes(self) -> list[ProvisionNode]:
        """Each provisioned node with its MAC, state, instance and counters."""
        out = []
        records = self._nodes.records
        for node in sorted(self.settings.macs):
            claim = self.store.claims.get(node)
            inst = None
            if claim is not None and claim.instance_id:
                inst = self.store.instances.get(claim.instance_id)
            record = records.get(node)
            out.append(
                ProvisionNode(
                    node=node,
                    mac=self.settings.macs[node],
                    state=machine.node_state(claim, inst),
                    instance_id=inst.instance_id if inst is not None else "",
                    tenant=inst.tenant if inst is not None else "",
                    image=inst.image if inst is not None else "",
                    grade=record.grade if record is not None else "",
                    cordoned=bool(record is not None and (record.cordoned or record.held)),
                    failures=claim.failures if claim is not None else 0,
                    flagged=bool(claim is not None and claim.flagged),
                )
            )
        return out

    def list_images(self) -> list[Image]:
        """The base images."""
        return self.images.list()

    def image(self, name: str) -> Image | None:
        """One base image, or None."""
        return self.images.get(name)

    async def volumes(self) -> list[Volume]:
        """Every tenant volume with its size on disk."""
        try:
            return await self.storage.list_volumes()
        except StorageError as exc:
            raise storage_error(exc, "listing the volumes") from None

    def volume_users(self) -> dict[str, str]:
        """Volume name -> the live instance using it (volumes kept free are absent)."""
        return {n: e.used_by for n, e in self.store.volumes.items() if e.used_by}

    # --- the boot server's side -----------------------------------------------------------

    def boot_instance(self, mac: str) -> Instance | None:
        """The instance the node with ``mac`` boots now (deploying, switching or active),
        or None (an unknown MAC, a free node)."""
        try:
            node = self._by_mac.get(spec.normalize_mac(mac))
        except ValueError:
            return None
        if node is None:
            return None
        claim = self.store.claims.get(node)
        if claim is None or not claim.instance_id:
            return None
        inst = self.store.instances.get(claim.instance_id)
        if inst is None or inst.node != node or not inst.export:
            return None
        if inst.state not in machine.BOOTING and inst.state != "active":
            return None
        return inst

    def _by_token(self, instance_id: str, export: str) -> Instance:
        inst = self.store.instances.get(instance_id)
        if (
            inst is None
            or not inst.export
            or not hmac.compare_digest(inst.export.encode(), export.encode())
        ):
            raise ProvisionError(403, "no such instance boot (a wrong or stale token)")
        return inst

    def user_data(self, instance_id: str, export: str) -> str:
        """The user data of the instance's current boot; 403 on a wrong token."""
        return self._by_token(instance_id, export).user_data

    async def report_ready(
        self, instance_id: str, export: str, report: Mapping[str, str]
    ) -> Instance:
        """The booted image says it is up: the instance becomes ACTIVE.  403 on a wrong
        token, 409 when it is not booting (a repeat of an accepted report is answered with
        the active instance), 503 on a follower."""
        self._by_token(instance_id, export)
        self._check_leading()
        async with self._lock(instance_id):
            inst = self._by_token(instance_id, export)
            if inst.state == "active":
                return inst
            if inst.state not in machine.BOOTING:
                raise ProvisionError(409, f"instance {instance_id} is {inst.state}, not booting")
            return await self._activate(inst, report)

    async def _ready_by_telemetry(self, instance_id: str) -> None:
        async with self._lock(instance_id):
            inst = self.store.instances.get(instance_id)
            if inst is not None and inst.state in machine.BOOTING:
                await self._activate(inst, {"source": "telemetry"})

    async def _activate(self, inst: Instance, report: Mapping[str, str]) -> Instance:
        """The node is up: ACTIVE, its volume marked booted, its failures forgotten."""
        step = machine.activated(inst, report, self._clock())
        await self._write(step.instance)
        self._powered_on.pop((inst.instance_id, inst.export), None)
        entry = self.store.volumes.get(inst.volume)
        if entry is not None and not entry.booted:
            await self._res.best_effort(
                self.store.put_volume(replace(entry, booted=True)), "volume entry"
            )
        claim = self.store.claims.get(inst.node)
        if claim is not None and claim.failures:
            await self._res.best_effort(
                self.store.put_claim(replace(claim, failures=0, updated_ts=self._clock())),
                "node claim",
            )
        await self._announcer.announce(step.emits)
        return step.instance

    # --- requests ------------------------------------------------------------------------

    def _check_leading(self) -> None:
        if not self._leading():
            raise ProvisionError(
                503, "this controller does not lead the region; ask the leader", "not_leader"
            )

    def _lock(self, instance_id: str) -> asyncio.Lock:
        lock = self._locks.get(instance_id)
        if lock is None:
            lock = self._locks[instance_id] = asyncio.Lock()
        return lock

    def _image(self, name: str) -> Image:
        image = self.images.get(name)
        if image is None:
            raise ProvisionError(404, f"no image {name!r}")
        return image

    async def create(self, req: InstanceRequest) -> Instance:
        """Deploy a new instance: claim a node (the named one, else the first free
        HEALTHY uncordoned one), make (or take) the tenant's volume, export it, and have
        the node network-boot through its BMC.  Returns the DEPLOYING instance; it becomes
        ACTIVE on the node's ready report (:meth:`wait_for`)."""
        self._check_leading()
        problems = spec.request_problems(req)
        if problems:
            raise ProvisionError(400, "; ".join(problems), reasons=problems)
        self._image(req.image)
        instance_id = req.instance_id or new_instance_id()
        async with self._lock(instance_id):
            if instance_id in self.store.instances:
                raise ProvisionError(409, f"instance {instance_id} exists already")
            entry = self._res.named_volume(req.volume, req.tenant, req.image)
            volume = req.volume or await self._res.fresh_volume_name(req.tenant, instance_id)
            candidates = self._candidates(req.node, sensitive=req.sensitive)
            node = await self._res.claim_first(candidates, instance_id, req.node)
            step = machine.new_instance(req, instance_id, volume, new_export(), node, self._clock())
            inst = step.instance
            try:
                await self.store.create_instance(inst)
            except (ProvisionConflictError, NatsError) as exc:
                await self._res.free(node, instance_id)
                if isinstance(exc, ProvisionConflictError):
                    raise ProvisionError(409, f"instance {instance_id} exists already") from None
                raise ProvisionError(503, f"KV unavailable: {exc}") from None
            await self._notify()
            try:
                if entry is None:
                    await self._res.create_volume(volume, req.tenant, req.image, instance_id)
                else:
                    await self._res.use_volume(entry, instance_id)
                await self._boot(inst)
            except ProvisionError as exc:
                await self._rollback_create(inst, exc.message)
                raise
            await self._announcer.announce(step.emits)
            return inst

    async def switch(
        self,
        instance_id: str,
        tenant: str,
        image: str,
        volume: str = "",
        user_data: str = "",
    ) -> Instance:
        """ACTIVE(A) -> SWITCHING(B) -> (ready report) ACTIVE(B) on the same node: B's
        volume (new from ``image``, or ``volume``) exported, the node network-booted, A's
        export removed; A's volume stays with tenant A (nothing copied, nothing shared)."""
        self._check_leading()
        try:
            req = spec.parse_switch(
                {"tenant": tenant, "image": image, "volume": volume, "user_data": user_data}
            )
        except spec.SpecError as exc:
            raise ProvisionError(400, str(exc), reasons=exc.reasons) from None
        self._image(req.image)
        async with self._lock(instance_id):
            inst = self._live_instance(instance_id, ("active",))
            self._check_health(inst.node)
            entry = self._res.named_volume(req.volume, req.tenant, req.image)
            name = req.volume or await self._res.fresh_volume_name(req.tenant, instance_id)
            export = new_export()
            if entry is None:
                await self._res.create_volume(name, req.tenant, req.image, instance_id)
            else:
                await self._res.use_volume(entry, instance_id)
            now = self._clock()
            step = machine.switching(inst, req.tenant, req.image, name, export, req.user_data, now)
            try:
                await self._res.export(name, export)
                await self._write(step.instance)
            except ProvisionError:
                await self._res.unexport(export)
                await self._res.drop_volume(name, instance_id)
                raise
            try:
                await self._network_boot(step.instance)
            except ProvisionError as exc:
                await self._res.unexport(export)
                await self._res.drop_volume(name, instance_id)
                back = machine.restored(step.instance, inst, self._clock(), exc.message)
                await self._res.best_effort(self._write(back), "instance record")
                raise
            await self._res.unexport(inst.export)  # A's OS is down: its export goes
            await self._res.release_volume(inst.volume, instance_id)
            await self._announcer.announce(step.emits)
            return step.instance

    async def release(self, instance_id: str, keep_volume: bool) -> Instance:
        """Give the node back: its export removed, the node powered off through its BMC,
        the volume kept for its tenant or deleted, the node free.  A BMC that fails leaves
        the instance RELEASING (502/504; the passes try again)."""
        self._check_leading()
        async with self._lock(instance_id):
            inst = self.store.instances.get(instance_id)
            if inst is None:
                raise ProvisionError(404, f"no instance {instance_id!r}")
            if inst.state == "released":
                return inst
            if inst.state == "deploy_failed":
                raise ProvisionError(409, f"instance {instance_id} ended: deploy_failed")
            if inst.state != "releasing":
                step = machine.releasing(inst, self._clock(), keep_volume)
                inst = replace(step.instance, keep_volume=keep_volume)
                await self._write(inst)
                await self._announcer.announce(step.emits)
            return await self._finish_release(inst)

    async def replace(self, instance_id: str) -> Instance:
        """Boot the instance's volume on another node (its node failed): the old export
        removed first (one writer at a time), a new one for the new node, which
        network-boots; the old node is freed and powered off.  DEPLOYING on the new node."""
        self._check_leading()
        async with self._lock(instance_id):
            inst = self._live_instance(instance_id, ("active", "deploying"))
            candidates = [
                n for n in self._candidates("", sensitive=inst.sensitive) if n != inst.node
            ]
            if not candidates:
                raise ProvisionError(409, f"no node available to replace {inst.node}")
            node = await self._res.claim_first(candidates, instance_id, "")
            export = new_export()
            step = machine.redeployed(
                inst, node, export, self._clock(), f"replacing {inst.node}", replacing=True
            )
            new = replace(step.instance, pinned=False)
            try:
                await self._write(new)
            except ProvisionError:
                await self._res.free(node, instance_id)
                raise
            try:
                await self._res.unexport(inst.export, strict=True)
                await self._boot(new)
            except ProvisionError as exc:
                await self._res.unexport(export)
                await self._res.best_effort(self._res.export(inst.volume, inst.export), "re-export")
                await self._res.free(node, instance_id)
                back = machine.restored(new, inst, self._clock(), exc.message)
                await self._res.best_effort(self._write(back), "instance record")
                raise
            await self._res.free(inst.node, instance_id)
            self._power_off_later(inst.node, machine.command_id(inst, "off"))
            await self._announcer.announce(step.emits)
            return new

    # --- images and volumes ----------------------------------------------------------------

    async def add_image_from_dir(
        self, name: str, directory: str | os.PathLike[str], size_bytes: int
    ) -> Image:
        """Build a base image from a directory on the storage host (ext4, then qcow2);
        403 when ``[provision] image_source_dirs`` is set and it lies below none of them."""
        self._check_leading()
        if not directory_allowed(directory, self.settings.image_source_dirs):
            raise ProvisionError(
                403,
                f"directory {os.fspath(directory)!r} is not below [provision] "
                f"image_source_dirs ({', '.join(self.settings.image_source_dirs)})",
                "forbidden",
            )
        try:
            image = await self.images.add_from_dir(name, directory, size_bytes)
        except StorageError as exc:
            raise storage_error(exc, f"image {name}") from None
        await self._res.best_effort(self.store.put_image(image), "image record")
        return image

    async def add_image_file(self, name: str, path: str | os.PathLike[str]) -> Image:
        """Register an uploaded qcow2/raw file as a base image."""
        self._check_leading()
        try:
            image = await self.images.add_file(name, path)
        except StorageError as exc:
            raise storage_error(exc, f"image {name}") from None
        await self._res.best_effort(self.store.put_image(image), "image record")
        return image

    async def delete_image(self, name: str) -> None:
        """Delete a base image no volume is over (409 otherwise)."""
        self._check_leading()
        users = sorted(n for n, e in self.store.volumes.items() if e.volume.image == name)
        if users:
            raise ProvisionError(409, f"image {name!r} is the base of volumes {', '.join(users)}")
        try:
            await self.images.delete(name)
        except StorageError as exc:
            raise storage_error(exc, f"image {name}") from None
        await self._res.best_effort(self.store.delete_image(name), "image record")

    async def delete_volume(self, name: str) -> None:
        """Delete a tenant's volume and its data; 409 while a live instance uses it."""
        self._check_leading()
        entry = self.store.volumes.get(name)
        if entry is not None and entry.used_by:
            raise ProvisionError(409, f"volume {name!r} is in use by instance {entry.used_by}")
        try:
            await self.storage.delete_volume(name)
        except StorageError as exc:
            raise storage_error(exc, f"volume {name}") from None
        await self._res.best_effort(self.store.delete_volume(name), "volume entry")

    async def clear_flag(self, node: str) -> ProvisionNode:
        """An operator clears a flagged node: its failure count starts again."""
        self._check_leading()
        if node not in self.settings.macs:
            raise ProvisionError(404, f"{node} is not a provisioned node")
        claim = self.store.claims.get(node)
        if claim is not None and (claim.flagged or claim.failures):
            cleared = replace(claim, flagged=False, failures=0, updated_ts=self._clock())
            await self._res.kv(self.store.put_claim(cleared))
        return next(n for n in self.provision_nodes() if n.node == node)

    # --- the steps ---------------------------------------------------------------------------

    def _live_instance(self, instance_id: str, states: Iterable[str]) -> Instance:
        inst = self.store.instances.get(instance_id)
        if inst is None:
            raise ProvisionError(404, f"no instance {instance_id!r}")
        allowed = tuple(states)
        if inst.state not in allowed:
            raise ProvisionError(
                409, f"instance {instance_id} is {inst.state}, not {' or '.join(allowed)}"
            )
        return inst

    def _why_not(
        self, node: str, *, claimed_ok: bool = False, sensitive: bool = False
    ) -> str | None:
        record = self._nodes.records.get(node)
        claim = self.store.claims.get(node)
        return machine.why_not_deployable(
            node,
            record.grade if record is not None else None,
            record is not None and record.cordoned,
            None if claimed_ok else claim,
            node in self.settings.macs,
            held=record is not None and record.held,
            rail_flagged=record is not None and record.rail_flagged,
            sensitive=sensitive,
            dma_posture=record.dma_posture if record is not None else "",
        )

    def _check_health(self, node: str) -> None:
        why = self._why_not(node, claimed_ok=True)
        if why is not None:
            raise ProvisionError(409, why)

    def _candidates(self, named: str, *, sensitive: bool = False) -> list[str]:
        """The nodes a request may take, in order: the named one (404 unknown, 409 not
        available), else every deployable one (409 when there is none); a ``sensitive``
        one only DMA-isolated nodes."""
        if named:
            if named not in self.settings.macs:
                raise ProvisionError(404, f"{named} is not a provisioned node")
            why = self._why_not(named, sensitive=sensitive)
            if why is not None:
                raise ProvisionError(409, why)
            return [named]
        reasons = {n: self._why_not(n, sensitive=sensitive) for n in self.settings.macs}
        free = machine.pick_node(n for n, why in reasons.items() if why is None)
        if not free:
            shown = "; ".join(why for why in reasons.values() if why)[:500]
            raise ProvisionError(409, f"no node available ({shown or 'none configured'})")
        return free

    async def _network_boot(self, inst: Instance) -> None:
        try:
            await self.power.network_boot(inst.node, machine.command_id(inst, "boot"))
            self._powered_on[(inst.instance_id, inst.export)] = self._clock()
        except PowerError as exc:
            raise ProvisionError(
                exc.status, f"network boot of {inst.node}: {exc.message}"
            ) from None

    async def _boot(self, inst: Instance) -> None:
        """Export the instance's volume under its secret and network-boot its node."""
        await self._res.export(inst.volume, inst.export)
        try:
            await self._network_boot(inst)
        except ProvisionError:
            await self._res.unexport(inst.export)
            raise

    async def _rollback_create(self, inst: Instance, reason: str) -> None:
        """Undo a create that failed: export, volume, record, claim (the node's state as
        it was)."""
        log.info("instance %s rolled back: %s", inst.instance_id, reason)
        await self._res.unexport(inst.export)
        await self._res.drop_volume(inst.volume, inst.instance_id)
        await self._res.best_effort(self.store.delete_instance(inst.instance_id), "instance record")
        await self._res.free(inst.node, inst.instance_id)
        await self._notify()

    async def _finish_release(self, inst: Instance) -> Instance:
        await self._res.unexport(inst.export, strict=True)
        tries = self._release_tries.get(inst.instance_id, 0)
        self._release_tries[inst.instance_id] = tries + 1
        off_id = f"{machine.command_id(inst, 'off')}.{tries}"
        try:
            await self.power.power_off(inst.node, off_id)
        except PowerError as exc:
            self._release_due[inst.instance_id] = self._clock() + self.settings.release_retry_s
            message = f"release of {inst.instance_id}: power-off failed, tried again: {exc.message}"
            await self._res.best_effort(
                self._write(replace(inst, error=message)), "instance record"
            )
            raise ProvisionError(exc.status, message) from None
        if inst.keep_volume:
            await self._res.release_volume(inst.volume, inst.instance_id)
        else:
            try:
                await self.storage.delete_volume(inst.volume)
            except StorageError as exc:
                log.warning("volume %s not deleted at release: %s", inst.volume, exc)
                await self._res.release_volume(inst.volume, inst.instance_id)
            else:
                await self._res.best_effort(self.store.delete_volume(inst.volume), "volume entry")
        await self._res.free(inst.node, inst.instance_id)
        what = "kept" if inst.keep_volume else "deleted"
        step = machine.released(inst, self._clock(), f"powered off; volume {what}")
        await self._write(step.instance)
        self._release_tries.pop(inst.instance_id, None)
        self._release_due.pop(inst.instance_id, None)
        await self._announcer.announce(step.emits)
        return step.instance

    async def _retry_release(self, instance_id: str) -> None:
        async with self._lock(instance_id):
            inst = self.store.instances.get(instance_id)
            if inst is not None and inst.state == "releasing":
                await self._finish_release(inst)

    def _power_off_later(self, node: str, command_id: str) -> None:
        """Turn a node off in the background (a node left behind: best effort)."""

        async def off() -> None:
            try:
                await self.power.power_off(node, command_id)
            except PowerError as exc:
                log.warning("%s not powered off: %s", node, exc.message)

        task = asyncio.create_task(off(), name=f"power-off-{node}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _boot_timed_out(self, instance_id: str) -> None:
        """A boot with no ready report by its deadline: the node's failure counted, then
        retried on another node (a request that named none, attempts left) or failed."""
        async with self._lock(instance_id):
            inst = self.store.instances.get(instance_id)
            now = self._clock()
            if inst is None or not machine.timed_out(inst, now, self.settings.deploy_timeout_s):
                return
            reason = f"no ready report from {inst.node} within {self.settings.deploy_timeout_s:g}s"
            await self._boot_failed(inst, reason)

    async def _boot_failed(self, inst: Instance, reason: str) -> None:
        await self._res.free(inst.node, inst.instance_id, failed=True)
        self._power_off_later(inst.node, machine.command_id(inst, "off"))
        old_export = inst.export
        while machine.on_timeout(inst, self.settings.deploy_attempts) == "retry":
            try:
                candidates = self._candidates("", sensitive=inst.sensitive)
            except ProvisionError:
                candidates = []
            tried = machine.tried_nodes(inst)
            candidates = [n for n in candidates if n not in tried]
            try:
                node = await self._res.claim_first(candidates, inst.instance_id, "")
            except ProvisionError:
                reason = f"{reason}; no other node available"
                break
            step = machine.redeployed(
                inst, node, new_export(), self._clock(), f"{reason}; retrying on {node}"
            )
            await self._write(step.instance)
            await self._res.unexport(old_export)
            try:
                await self._boot(step.instance)
            except ProvisionError as exc:
                inst, old_export, reason = step.instance, step.instance.export, exc.message
                await self._res.free(node, inst.instance_id, failed=True)
                continue
            await self._announcer.announce(step.emits)
            return
        await self._res.unexport(old_export)
        await self._res.drop_volume(inst.volume, inst.instance_id)
        step = machine.deploy_failed(inst, self._clock(), reason)
        await self._write(step.instance)
        await self._announcer.announce(step.emits)

    async def _mark_failing(self, instance_id: str, grade: str) -> None:
        async with self._lock(instance_id):
            inst = self.store.instances.get(instance_id)
            if inst is None or inst.state != "active":
                return
            step = machine.node_failing(inst, grade, self._clock())
            if step is None:
                return
            await self._write(step.instance)
            await self._announcer.announce(step.emits)

    # --- resuming -----------------------------------------------------------------------------

    def wanted_exports(self) -> dict[str, str]:
        """Export name -> volume of every live instance that holds an export (what the
        export server must serve; QemuStorage.start/reconcile take it)."""
        return {
            i.export: i.volume
            for i in self.store.instances.values()
            if i.state in machine.LIVE and i.state != "releasing" and i.export
        }

    async def _resume(self) -> None:
        """Take up what KV says (a restart, a new leader): exports nobody owns removed,
        missing ones served again, claims and volume entries of no live instance freed,
        volumes of rolled-back requests deleted, and the boots in progress sent again (the
        same command ids: a BMC that did it answers from memory).  Deadlines stay as
        recorded."""
        await self.store.load()
        live = {i.instance_id: i for i in self.store.instances.values() if i.state in machine.LIVE}
        wanted = self.wanted_exports()
        try:
            served = set(await self.storage.list_exports())
        except StorageError as exc:
            log.warning("exports not listed at resume: %s", exc)
            served = set(wanted)
        for export in served - set(wanted):
            await self._res.unexport(export)
        for node, claim in list(self.store.claims.items()):
            holder = live.get(claim.instance_id) if claim.instance_id else None
            if claim.instance_id and (holder is None or holder.node != node):
                await self._res.free(node, claim.instance_id)
        for name, entry in list(self.store.volumes.items()):
            user = live.get(entry.used_by) if entry.used_by else None
            if entry.used_by and (user is None or user.volume != name):
                await self._res.release_volume(name, entry.used_by)
            elif (
                not entry.used_by
                and entry.created_by
                and not entry.booted
                and entry.created_by not in self.store.instances
            ):
                await self._res.drop_volume(name, entry.created_by)  # a rolled-back request's
        for export, volume in wanted.items():
            if export not in served:  # an active node's root, a boot's volume
                try:
                    await self._res.export(volume, export)
                except ProvisionError as exc:
                    log.warning("an export of volume %s not restored: %s", volume, exc)
        now = self._clock()
        for inst in live.values():  # (one whose export is gone fails at its deadline)
            timeout_s = self.settings.deploy_timeout_s
            if inst.state in machine.BOOTING and not machine.timed_out(inst, now, timeout_s):
                self._spawn(self._resend_boot(inst.instance_id), inst.instance_id)
        await self._notify()

    async def _resend_boot(self, instance_id: str) -> None:
        async with self._lock(instance_id):
            inst = self.store.instances.get(instance_id)
            if inst is not None and inst.state in machine.BOOTING:
                await self._network_boot(inst)

    # --- KV and events ----------------------------------------------------------------------

    async def _write(self, inst: Instance) -> None:
        """Write an instance's record (compare-and-set); 409 when another controller
        changed it first (the fresh value is taken), 503 when KV is away."""
        try:
            await self.store.put_instance(inst)
        except ProvisionConflictError:
            await self._notify()
            raise ProvisionError(
                409, f"instance {inst.instance_id} was changed by another controller; try again"
            ) from None
        except NatsError as exc:
            raise ProvisionError(503, f"KV unavailable: {exc}") from None
        await self._notify()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()
