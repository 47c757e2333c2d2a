"""Provisioning inside ``metalguard controller run``: the storage (qemu-img and the NBD
export daemon), the :class:`ProvisionService` and its boot server, started and stopped
together (``[provision] enabled = true``, docs/provisioning.md)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from aiohttp import web
from nats.aio.client import Client
from nats.js import JetStreamContext

from metalguard.controller.config import ProvisionSection
from metalguard.controller.provision.bootserver import start_boot_server
from metalguard.controller.provision.manager import (
    NodeRecords,
    ProvisionService,
    ProvisionSettings,
)
from metalguard.controller.provision.power import BmcPower
from metalguard.controller.provision.storage import QemuStorage
from metalguard.controller.provision.store import ProvisionStore
from metalguard.proto.addresses import parse_listen
from metalguard.proto.subjects import Subjects

log = logging.getLogger(__name__)


class Provisioning:
    """The region's provisioning: storage, service, boot server."""

    def __init__(self, service: ProvisionService, storage: QemuStorage, boot_listen: str) -> None:
        self.service = service
        self.storage = storage
        self.boot_listen = boot_listen
        self.boot_port = 0
        """The boot server's port once started."""
        self._runner: web.AppRunner | None = None

    @classmethod
    async def open(
        cls,
        nc: Client,
        js: JetStreamContext,
        subjects: Subjects,
        region: str,
        section: ProvisionSection,
        nodes: NodeRecords,
        leading: Callable[[], bool],
    ) -> Provisioning:
        """The parts over ``<P>_PROVISION`` (loaded), not started."""
        settings = ProvisionSettings.from_section(section)
        listen = parse_listen(section.nbd_listen)
        storage = QemuStorage(
            section.data_dir,
            listen_host=listen.host,
            listen_port=listen.port or 10809,
            nbd_host=settings.nbd_host,
            nbd_port=settings.nbd_port,
        )
        store = await ProvisionStore.open(js, subjects)
        service = ProvisionService(
            nc,
            js,
            store,
            nodes,
            subjects,
            region,
            settings,
            images=storage.images,
            storage=storage,
            power=BmcPower(nc, subjects, section.bmc_timeout_s),
            leading=leading,
        )
        return cls(service, storage, section.boot_listen)

    async def start(self) -> None:
        """Serve the exports the live instances hold, resume the service, serve boots."""
        removed = await self.storage.start(self.service.wanted_exports())
        if removed:
            log.warning("provision: exports not served at start: %d", len(removed))
        await self.service.start()
        self._runner, self.boot_port = await start_boot_server(self.service, self.boot_listen)

    async def stop(self) -> None:
        """Stop serving boots, the service's passes and the daemon's supervision (the
        exports stay served: booted nodes keep their root volumes)."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.service.stop()
        await self.storage.close()
