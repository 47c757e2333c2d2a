"""The boot server: what a node's firmware and its booted image fetch over HTTP
(``[provision] boot_listen``; the nodes reach it as ``boot_url``, docs/provisioning.md).

- ``GET /boot.ipxe`` (the DHCP bootfile): chains to the node's own script by its MAC;
- ``GET /boot/{mac}.ipxe`` (``52-54-00-12-34-01``): the kernel, its command line (the
  ``nbdroot=`` of the instance's current export, the ready and user-data URLs) and the
  initrd for a node with a deploying, switching or active instance; otherwise a script
  that says so and exits, so the node falls through to its next boot device;
- ``GET /files/vmlinuz``, ``GET /files/initrd``: the configured kernel and initramfs;
- ``POST /ready/{id}/{export}``: the booted image's ready report (a JSON object of
  strings): the instance becomes ACTIVE; a wrong token is 403;
- ``GET /userdata/{id}/{export}``: the instance's user data as text (403 on a wrong token).

The export name is the boot's secret: it is in the script of that MAC only, and it is the
token of the report and user-data URLs.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Final, Protocol

from aiohttp import web

from metalguard.controller.provision.manager import ProvisionError, ProvisionSettings
from metalguard.proto import addresses
from metalguard.proto.provision import Instance

log = logging.getLogger(__name__)

IPXE: Final = "text/plain"
MAX_REPORT: Final = 64 * 1024
"""Bytes of a ready report's body."""
MAX_VALUE: Final = 4096
"""Characters of one value of a ready report (longer ones are cut)."""
NO_INSTANCE: Final = "#!ipxe\necho metalguard: no instance for this node\nexit 1\n"
FILES: Final = ("vmlinuz", "initrd")


class BootView(Protocol):
    """What the boot server needs of the provisioning service."""

    @property
    def settings(self) -> ProvisionSettings: ...

    def boot_instance(self, mac: str) -> Instance | None: ...

    def user_data(self, instance_id: str, export: str) -> str: ...

    async def report_ready(
        self, instance_id: str, export: str, report: Mapping[str, str]
    ) -> Instance: ...


VIEW: Final = web.AppKey("provision_boot", BootView)


def chain_script(boot_url: str) -> str:
    """The DHCP bootfile: fetch this node's own script by its MAC."""
    return f"#!ipxe\nchain {boot_url}/boot/${{net0/mac:hexhyp}}.ipxe\n"


def instance_script(inst: Instance, settings: ProvisionSettings) -> str:
    """The iPXE script that boots ``inst``'s current volume (its export) on its node."""
    url = settings.boot_url
    token = f"{inst.instance_id}/{inst.export}"
    cmdline = " ".join(
        [
            "console=ttyS0",
            "panic=-1",
            "ip=dhcp",
            f"nbdroot={settings.nbd_host},{settings.nbd_port},{inst.export}",
            "root=/dev/nbd0",
            "rw",
            f"mg.instance={inst.instance_id}",
            f"mg.ready={url}/ready/{token}",
            f"mg.userdata={url}/userdata/{token}",
            *settings.kernel_args.split(),
        ]
    )
    return f"#!ipxe\nkernel {url}/files/vmlinuz {cmdline}\ninitrd {url}/files/initrd\nboot\n"


def parse_report(body: bytes) -> dict[str, str]:
    """A ready report's body: a JSON object of strings (an empty body is an empty
    report); ValueError naming the problem otherwise."""
    if not body.strip():
        return {}
    if len(body) > MAX_REPORT:
        raise ValueError(f"the report is larger than {MAX_REPORT} bytes")
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ValueError("the report must be a JSON object")
    bad = sorted(str(k) for k, v in doc.items() if not isinstance(v, str))
    if bad:
        raise ValueError(f"values must be strings: {', '.join(bad)}")
    return {str(k)[:128]: v[:MAX_VALUE] for k, v in doc.items()}


def make_boot_app(view: BootView) -> web.Application:
    """The boot server's routes over ``view``."""
    app = web.Application(client_max_size=MAX_REPORT + 1024)
    app[VIEW] = view
    app.router.add_get("/boot.ipxe", bootfile)
    app.router.add_get("/boot/{mac}.ipxe", node_script)
    app.router.add_get("/files/{name}", boot_file)
    app.router.add_post("/ready/{instance}/{export}", ready)
    app.router.add_get("/userdata/{instance}/{export}", user_data)
    return app


async def bootfile(request: web.Request) -> web.Response:
    """``GET /boot.ipxe``."""
    return web.Response(text=chain_script(request.app[VIEW].settings.boot_url), content_type=IPXE)


async def node_script(request: web.Request) -> web.Response:
    """``GET /boot/{mac}.ipxe``: the node's boot, or "no instance"."""
    view = request.app[VIEW]
    inst = view.boot_instance(request.match_info["mac"])
    if inst is None:
        return web.Response(text=NO_INSTANCE, content_type=IPXE)
    log.info("boot script for %s: instance %s (%s)", inst.node, inst.instance_id, inst.state)
    return web.Response(text=instance_script(inst, view.settings), content_type=IPXE)


async def boot_file(request: web.Request) -> web.StreamResponse:
    """``GET /files/vmlinuz`` and ``/files/initrd``."""
    name = request.match_info["name"]
    settings = request.app[VIEW].settings
    path = {"vmlinuz": settings.kernel, "initrd": settings.initrd}.get(name, "")
    if not path:
        raise web.HTTPNotFound(text=f"no {name} configured ([provision] kernel/initrd)\n")
    return web.FileResponse(path, headers={"Content-Type": "application/octet-stream"})


def _error(exc: ProvisionError) -> web.Response:
    return web.json_response(
        {"error": {"code": exc.code, "message": exc.message}}, status=exc.status
    )


async def ready(request: web.Request) -> web.Response:
    """``POST /ready/{id}/{export}``: the node is up."""
    view = request.app[VIEW]
    try:
        report = parse_report(await request.read())
    except ValueError as exc:
        return web.json_response({"error": {"code": "invalid", "message": str(exc)}}, status=400)
    try:
        inst = await view.report_ready(
            request.match_info["instance"], request.match_info["export"], report
        )
    except ProvisionError as exc:
        return _error(exc)
    return web.json_response({"instance_id": inst.instance_id, "state": inst.state})


async def user_data(request: web.Request) -> web.Response:
    """``GET /userdata/{id}/{export}``."""
    try:
        text = request.app[VIEW].user_data(
            request.match_info["instance"], request.match_info["export"]
        )
    except ProvisionError as exc:
        return _error(exc)
    return web.Response(text=text, content_type="text/plain")


async def start_boot_server(view: BootView, listen: str) -> tuple[web.AppRunner, int]:
    """Serve the boot routes on ``listen`` (``host:port``, port 0: a free one): the runner
    (``cleanup()`` stops it) and the port bound.  OSError when it cannot bind."""
    parsed = addresses.parse_listen(listen)
    runner = web.AppRunner(make_boot_app(view), access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    site = web.TCPSite(runner, parsed.host, parsed.port)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    port = int(runner.addresses[0][1]) if runner.addresses else parsed.port or 0
    log.info("boot server on %s (nodes use %s)", listen, view.settings.boot_url)
    return runner, port
