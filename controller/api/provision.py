"""The provisioning routes of the HTTP API (docs/provisioning.md, docs/api.md).

Over the region's :class:`~metalguard.controller.provision.manager.ProvisionService`:

- ``/v1/images`` (GET; POST: build from a directory of the storage host as JSON, or
  upload a qcow2/raw file as ``application/octet-stream`` with ``?name=``),
  ``/v1/images/{name}`` (GET, DELETE);
- ``/v1/instances`` (GET with filters; POST an instance request: 202 while it deploys,
  201 with ``?wait=true`` once it is active or failed), ``/v1/instances/{id}`` (GET;
  DELETE releases it, ``?keep_volume=true|false``), ``/v1/instances/{id}/switch`` and
  ``/v1/instances/{id}/replace`` (POST);
- ``/v1/volumes`` (GET), ``/v1/volumes/{name}`` (DELETE);
- ``/v1/provision/nodes`` (GET: the provisioned nodes, their MACs, states and failure
  counts), ``/v1/provision/nodes/{node}/clear`` (POST: an operator clears a flagged node).

Reads take a read token, writes an admin token, like every route; a follower answers
writes with 503 ``not_leader``.  The service's ``ProvisionError`` becomes the API's JSON
error with its status, code and message (and ``reasons`` for an invalid request).  An
instance is never shown with its ``export`` (the secret of its boot) nor its user data.

Without ``[provision]`` in the controller's config, :func:`add_provision_disabled`
answers these paths with a 404 that says so (and the OpenAPI document leaves them out).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import tempfile
from collections.abc import Awaitable, Iterable, Sequence
from pathlib import Path
from typing import Any, Final, Protocol, TypeVar, get_args

import msgspec
from aiohttp import web

from metalguard.controller.api.auth import check_admin, check_read
from metalguard.controller.api.errors import ApiError, reject_unknown_query
from metalguard.controller.api.leader import leader_elsewhere
from metalguard.controller.api.nodes import NODE_PROVISION, NodeProvisionLines
from metalguard.controller.api.shapes import (
    ImageBuild,
    InstanceAnswer,
    NodeProvision,
    ProvisionNodeLine,
    VolumeLine,
)
from metalguard.controller.provision.manager import ProvisionError, ProvisionNode
from metalguard.controller.provision.spec import (
    MAX_USER_DATA,
    SpecError,
    parse_request,
    parse_switch,
)
from metalguard.proto.codec import to_builtins
from metalguard.proto.provision import (
    TERMINAL_INSTANCE_STATES,
    Image,
    ImageName,
    Instance,
    InstanceRequest,
    InstanceState,
    Volume,
)

T = TypeVar("T")

STATES: Final = frozenset(get_args(InstanceState))
SETTLED: Final = frozenset({"active"}) | TERMINAL_INSTANCE_STATES
"""States an instance stays in by itself; the others move on (202 while in them)."""
WAIT_MAX_S: Final = 600.0
"""The longest ``?wait=true`` holds an answer (the deploy timeout ends a deploy first)."""
MAX_UPLOAD: Final = 64 << 30
"""The largest image file ``POST /v1/images`` takes (64 GiB)."""
MAX_REQUEST: Final = MAX_USER_DATA + 16 * 1024
"""The largest instance or switch body: the user data and the rest (the API's 16 KiB
limit would cut the user data a node may be given)."""
CHUNK: Final = 1 << 20
UPLOAD_PREFIX: Final = ".tmp-upload."
"""An upload in progress, in the registry's directory (its ``.tmp-*`` files are removed
at start: a controller killed mid-upload leaves nothing)."""
TRUE: Final = frozenset({"1", "true", "yes"})
FALSE: Final = frozenset({"0", "false", "no"})
CODES: Final = {
    400: "bad_request",
    403: "forbidden",
    404: "not_found",
    409: "conflict",
    413: "request_entity_too_large",
    502: "bad_gateway",
    503: "unavailable",
    504: "gateway_timeout",
}
PATHS: Final = (
    "/v1/images",
    "/v1/images/{name}",
    "/v1/instances",
    "/v1/instances/{instance_id}",
    "/v1/instances/{instance_id}/switch",
    "/v1/instances/{instance_id}/replace",
    "/v1/volumes",
    "/v1/volumes/{name}",
    "/v1/provision/nodes",
    "/v1/provision/nodes/{node}/clear",
)
NOT_ENABLED: Final = (
    "provisioning is not enabled on this controller: add a [provision] section with "
    "enabled = true to its config (docs/provisioning.md)"
)


class ProvisionView(Protocol):
    """What the routes need of the provisioning service (controller/provision/manager.py's
    ProvisionService)."""

    async def create(self, req: InstanceRequest) -> Instance: ...

    async def switch(
        self, instance_id: str, tenant: str, image: str, volume: str = "", user_data: str = ""
    ) -> Instance: ...

    async def release(self, instance_id: str, keep_volume: bool) -> Instance: ...

    async def replace(self, instance_id: str) -> Instance: ...

    async def wait_for(
        self, instance_id: str, states: Iterable[str] = ..., timeout_s: float = ...
    ) -> Instance: ...

    async def instances(self) -> list[Instance]: ...

    async def instance(self, instance_id: str) -> Instance | None: ...

    async def volumes(self) -> list[Volume]: ...

    async def delete_volume(self, name: str) -> None: ...

    def volume_users(self) -> dict[str, str]: ...

    def list_images(self) -> list[Image]: ...

    def image(self, name: str) -> Image | None: ...

    async def add_image_from_dir(self, name: str, directory: str, size_bytes: int) -> Image: ...

    async def add_image_file(self, name: str, path: str) -> Image: ...

    async def delete_image(self, name: str) -> None: ...

    def provision_nodes(self) -> list[ProvisionNode]: ...

    async def clear_flag(self, node: str) -> ProvisionNode: ...


PROVISION: Final = web.AppKey("provision", ProvisionView)
UPLOAD_DIR: Final = web.AppKey("provision_upload_dir", str)


def add_provision_routes(
    app: web.Application, service: ProvisionView, upload_dir: str | os.PathLike[str] = ""
) -> None:
    """Register the provisioning routes over ``service`` and give ``GET /v1/nodes`` each
    provisioned node's instance state and tenant.  Uploaded images are received into
    ``upload_dir`` (best on the registry's file system; "" = the images' directory when
    the registry says it, else the system's temporary directory)."""
    app[PROVISION] = service
    app[UPLOAD_DIR] = str(upload_dir or _images_dir(service))
    app[NODE_PROVISION] = _node_lines_of(service)
    app.router.add_get("/v1/images", list_images)
    app.router.add_post("/v1/images", add_image)
    app.router.add_get("/v1/images/{name}", get_image)
    app.router.add_delete("/v1/images/{name}", delete_image)
    app.router.add_get("/v1/instances", list_instances)
    app.router.add_post("/v1/instances", create_instance)
    app.router.add_get("/v1/instances/{instance_id}", get_instance)
    app.router.add_delete("/v1/instances/{instance_id}", release_instance)
    app.router.add_post("/v1/instances/{instance_id}/switch", switch_instance)
    app.router.add_post("/v1/instances/{instance_id}/replace", replace_instance)
    app.router.add_get("/v1/volumes", list_volumes)
    app.router.add_delete("/v1/volumes/{name}", delete_volume)
    app.router.add_get("/v1/provision/nodes", list_provision_nodes)
    app.router.add_post("/v1/provision/nodes/{node}/clear", clear_node)


def add_provision_disabled(app: web.Application) -> None:
    """Answer the provisioning paths with a 404 saying provisioning is not enabled (the
    handler is left out of the OpenAPI document: nothing is served there)."""
    for path in PATHS:
        app.router.add_route("*", path, provision_disabled)


async def provision_disabled(request: web.Request) -> web.Response:
    """404: this controller runs no provisioning service."""
    raise ApiError(404, "not_enabled", NOT_ENABLED)


provision_disabled.openapi_hidden = True  # type: ignore[attr-defined]


# --- images ------------------------------------------------------------------------------


async def list_images(request: web.Request) -> web.Response:
    """Every base image of the registry, by name."""
    check_read(request)
    reject_unknown_query(request, ())
    images = sorted(request.app[PROVISION].list_images(), key=lambda i: i.name)
    return web.json_response({"images": [to_builtins(i) for i in images]})


async def get_image(request: web.Request) -> web.Response:
    """One base image: format, sizes, checksum, source."""
    check_read(request)
    reject_unknown_query(request, ())
    return web.json_response(to_builtins(_image(request)))


async def add_image(request: web.Request) -> web.Response:
    """Add a base image (admin): JSON ``{name, directory, size_bytes}`` builds an ext4
    image from a directory of the storage host; ``application/octet-stream`` with
    ``?name=`` stores an uploaded qcow2 or raw file.  201 with the image."""
    check_admin(request)
    _leading(request)
    kind = request.content_type.lower()
    service = request.app[PROVISION]
    if kind == "application/octet-stream":
        reject_unknown_query(request, ("name",))
        name = _image_name(request.query.get("name", ""))
        _absent(service, name)
        path = Path(request.app[UPLOAD_DIR]) / f"{UPLOAD_PREFIX}{secrets.token_hex(4)}.{name}"
        try:
            await _receive(request, path)
            image = await _service(service.add_image_file(name, str(path)))
        finally:
            path.unlink(missing_ok=True)
    elif kind == "application/json":
        reject_unknown_query(request, ())
        build = _decode(await request.read(), ImageBuild, "image build")
        if not os.path.isabs(build.directory):
            raise ApiError(400, "bad_request", f"directory {build.directory!r} is not absolute")
        _absent(service, build.name)
        image = await _service(
            service.add_image_from_dir(build.name, build.directory, build.size_bytes)
        )
    else:
        raise ApiError(
            415,
            "unsupported_media_type",
            "send a directory to build as application/json, or an image file as "
            "application/octet-stream with ?name=",
        )
    return web.json_response(to_builtins(image), status=201)


async def delete_image(request: web.Request) -> web.Response:
    """Remove a base image (admin): 409 while a volume is an overlay of it."""
    check_admin(request)
    reject_unknown_query(request, ())
    _leading(request)
    image = _image(request)
    await _service(request.app[PROVISION].delete_image(image.name))
    return web.json_response(to_builtins(image))


# --- instances ---------------------------------------------------------------------------

LIST_FILTERS: Final = ("state", "tenant", "node", "image")


async def list_instances(request: web.Request) -> web.Response:
    """Every instance, oldest first; ``?state=active,deploying``, ``tenant``, ``node``
    (a handle) and ``image`` filter."""
    check_read(request)
    reject_unknown_query(request, LIST_FILTERS)
    wanted = {s for s in request.query.get("state", "").split(",") if s}
    if wanted - STATES:
        bad = ", ".join(sorted(wanted - STATES))
        raise ApiError(400, "bad_request", f"unknown state(s) {bad}; known: {sorted(STATES)}")
    exact = {k: request.query[k] for k in ("tenant", "node", "image") if request.query.get(k)}
    rows = [
        instance_answer(i)
        for i in sorted(await request.app[PROVISION].instances(), key=_order)
        if (not wanted or i.state in wanted) and all(getattr(i, k) == v for k, v in exact.items())
    ]
    return web.json_response({"instances": rows})


async def get_instance(request: web.Request) -> web.Response:
    """One instance: state, node, tenant, image, volume, attempts, history with reasons."""
    check_read(request)
    reject_unknown_query(request, ())
    return web.json_response(instance_answer(await _instance(request)))


async def create_instance(request: web.Request) -> web.Response:
    """Deploy an instance (admin): 202 while it deploys; with ``?wait=true`` the answer
    waits until it is active or failed (201)."""
    check_admin(request)
    reject_unknown_query(request, ("wait",))
    wait = flag(request.query.get("wait"), "wait", default=False)
    _leading(request)
    try:
        req = parse_request(await _json_body(request, "an instance request"))
    except SpecError as exc:
        raise ApiError(400, "bad_request", f"invalid request: {exc}", exc.reasons) from None
    service = request.app[PROVISION]
    instance = await _service(service.create(req))
    if wait:
        instance = await _settled(service, instance)
    return _answer(instance, created=True)


async def release_instance(request: web.Request) -> web.Response:
    """Release an instance (admin): remove its export, power the node off, free the node;
    ``?keep_volume=false`` also deletes the tenant's volume (default: kept).  200 once
    released; 202 while a BMC that failed is tried again (or a 502/504 naming it)."""
    check_admin(request)
    reject_unknown_query(request, ("keep_volume", "wait"))
    keep = flag(request.query.get("keep_volume"), "keep_volume", default=True)
    wait = flag(request.query.get("wait"), "wait", default=False)
    _leading(request)
    service = request.app[PROVISION]
    found = await _instance(request)
    instance = await _service(service.release(found.instance_id, keep))
    if wait:
        instance = await _settled(service, instance)
    return _answer(instance)


async def switch_instance(request: web.Request) -> web.Response:
    """Switch an active instance's node to another tenant (admin): the new volume (made
    from ``image`` unless ``volume`` names one of the tenant's) exported, the node
    network-booted, the old export removed.  202 while it switches; ``?wait=true`` waits
    (200)."""
    check_admin(request)
    reject_unknown_query(request, ("wait",))
    wait = flag(request.query.get("wait"), "wait", default=False)
    _leading(request)
    try:
        body = parse_switch(await _json_body(request, "a switch"))
    except SpecError as exc:
        raise ApiError(400, "bad_request", f"invalid switch: {exc}", exc.reasons) from None
    service = request.app[PROVISION]
    found = await _instance(request)
    instance = await _service(
        service.switch(found.instance_id, body.tenant, body.image, body.volume, body.user_data)
    )
    if wait:
        instance = await _settled(service, instance)
    return _answer(instance)


async def replace_instance(request: web.Request) -> web.Response:
    """Boot a replacement node on the instance's volume (admin; e.g. after its node
    failed): 202 while it deploys; ``?wait=true`` waits (200)."""
    check_admin(request)
    reject_unknown_query(request, ("wait",))
    wait = flag(request.query.get("wait"), "wait", default=False)
    _leading(request)
    _empty_body(await request.read())
    service = request.app[PROVISION]
    found = await _instance(request)
    instance = await _service(service.replace(found.instance_id))
    if wait:
        instance = await _settled(service, instance)
    return _answer(instance)


# --- volumes -----------------------------------------------------------------------------


async def list_volumes(request: web.Request) -> web.Response:
    """Every tenant volume with its size on the storage host and the live instance that
    boots it; ``?tenant=`` filters."""
    check_read(request)
    reject_unknown_query(request, ("tenant",))
    tenant = request.query.get("tenant", "")
    service = request.app[PROVISION]
    users = service.volume_users()
    rows = [
        volume_line(v, users.get(v.name))
        for v in sorted(await _service(service.volumes()), key=lambda v: v.name)
        if not tenant or v.tenant == tenant
    ]
    return web.json_response({"volumes": rows})


async def delete_volume(request: web.Request) -> web.Response:
    """Delete a tenant volume (admin): 409 while a live instance boots from it; its data
    is gone."""
    check_admin(request)
    reject_unknown_query(request, ())
    _leading(request)
    service = request.app[PROVISION]
    name = request.match_info["name"]
    volume = next((v for v in await _service(service.volumes()) if v.name == name), None)
    if volume is None:
        raise ApiError(404, "not_found", f"no volume {name!r}")
    await _service(service.delete_volume(name))
    return web.json_response(volume_line(volume, None))


# --- provisioned nodes -------------------------------------------------------------------


async def list_provision_nodes(request: web.Request) -> web.Response:
    """The nodes provisioning may deploy (``[[provision.nodes]]``): MAC, state, instance,
    tenant, grade, failures, flagged."""
    check_read(request)
    reject_unknown_query(request, ())
    nodes = request.app[PROVISION].provision_nodes()
    return web.json_response({"nodes": [node_answer(n) for n in nodes]})


async def clear_node(request: web.Request) -> web.Response:
    """An operator clears a node flagged after failed deploys (admin): it is deployed
    again, its failures counted from zero."""
    check_admin(request)
    reject_unknown_query(request, ())
    _leading(request)
    _empty_body(await request.read())
    node = await _service(request.app[PROVISION].clear_flag(request.match_info["node"]))
    return web.json_response(node_answer(node))


# --- shaping (pure) ----------------------------------------------------------------------


def instance_answer(instance: Instance) -> dict[str, Any]:
    """An instance as the API shows it (an :class:`~shapes.InstanceAnswer`): never its
    ``export``, the user data only as its size."""
    line = InstanceAnswer(
        instance_id=instance.instance_id,
        tenant=instance.tenant,
        image=instance.image,
        volume=instance.volume,
        state=instance.state,
        node=instance.node,
        attempts=instance.attempts,
        pinned=instance.pinned,
        sensitive=instance.sensitive,
        keep_volume=instance.keep_volume,
        ready_ts=instance.ready_ts,
        ready_report=dict(instance.ready_report),
        error=instance.error,
        created_ts=instance.created_ts,
        updated_ts=instance.updated_ts,
        history=list(instance.history),
        user_data_bytes=len(instance.user_data.encode()),
    )
    return dict(msgspec.to_builtins(line))


def volume_line(volume: Volume, instance: str | None) -> dict[str, Any]:
    """A volume's line in ``GET /v1/volumes`` (a :class:`~shapes.VolumeLine`)."""
    line = VolumeLine(
        name=volume.name,
        tenant=volume.tenant,
        image=volume.image,
        size_bytes=volume.size_bytes,
        created_ts=volume.created_ts,
        instance=instance or None,
    )
    return dict(msgspec.to_builtins(line))


def node_answer(node: ProvisionNode) -> dict[str, Any]:
    """A provisioned node as ``GET /v1/provision/nodes`` shows it (a
    :class:`~shapes.ProvisionNodeLine`)."""
    line = msgspec.convert(msgspec.to_builtins(node), ProvisionNodeLine)
    return dict(msgspec.to_builtins(line))


def node_lines(nodes: Iterable[ProvisionNode]) -> dict[str, dict[str, Any]]:
    """Each provisioned node's line for ``GET /v1/nodes`` (a :class:`~shapes.NodeProvision`),
    by handle: its state, the instance on it and its tenant, whether it is flagged."""
    out = {}
    for n in nodes:
        line = NodeProvision(
            state=n.state,
            instance=n.instance_id or None,
            tenant=n.tenant or None,
            image=n.image or None,
            flagged=n.flagged,
        )
        out[n.node] = dict(msgspec.to_builtins(line))
    return out


def flag(text: str | None, name: str, *, default: bool) -> bool:
    """A boolean query parameter: ``true|false|1|0|yes|no`` (ApiError 400 otherwise)."""
    if text is None or text == "":
        return default
    if text.lower() in TRUE:
        return True
    if text.lower() in FALSE:
        return False
    raise ApiError(400, "bad_request", f"{name} must be true or false, not {text!r}")


def error_of(exc: ProvisionError) -> ApiError:
    """The API error of a ProvisionError: its status (400 when it is not an error status),
    message and reasons; its code where the API has none of its own for the status."""
    status = exc.status if 400 <= exc.status <= 599 else 400
    code = "not_leader" if exc.code == "not_leader" else CODES.get(status, exc.code or "error")
    message = exc.message or str(exc) or "provisioning refused the request"
    reasons = exc.reasons
    listed = list(reasons) if isinstance(reasons, Sequence) and reasons else None
    return ApiError(status, code, message, listed)


def answer_status(state: str, *, created: bool = False) -> int:
    """201 (a create) or 200 for an instance settled in ``state``; 202 while it moves on."""
    if state in SETTLED:
        return 201 if created else 200
    return 202


# --- helpers -----------------------------------------------------------------------------


def _answer(instance: Instance, *, created: bool = False) -> web.Response:
    status = answer_status(instance.state, created=created)
    return web.json_response(instance_answer(instance), status=status)


async def _settled(service: ProvisionView, instance: Instance) -> Instance:
    """The instance once settled, or as it is after :data:`WAIT_MAX_S`."""
    if instance.state in SETTLED:
        return instance
    try:
        return await service.wait_for(instance.instance_id, SETTLED, WAIT_MAX_S)
    except ProvisionError as exc:
        if exc.status != 504:
            raise error_of(exc) from None
    return await service.instance(instance.instance_id) or instance


def _node_lines_of(service: ProvisionView) -> NodeProvisionLines:
    async def lines() -> dict[str, dict[str, Any]]:
        return node_lines(service.provision_nodes())

    return lines


def _images_dir(service: ProvisionView) -> str:
    """Where the registry keeps its files, when it says (E's ImageRegistry: ``dir``)."""
    images = getattr(service, "images", None)
    where = getattr(images, "dir", None)
    return str(where) if isinstance(where, Path) else tempfile.gettempdir()


def _leading(request: web.Request) -> None:
    where = leader_elsewhere(request)
    if where is not None:
        raise ApiError(
            503, "not_leader", f"this controller follows; provisioning goes to the leader: {where}"
        )


async def _instance(request: web.Request) -> Instance:
    instance_id = request.match_info["instance_id"]
    found = await request.app[PROVISION].instance(instance_id)
    if found is None:
        raise ApiError(404, "not_found", f"no instance {instance_id!r}")
    return found


def _image(request: web.Request) -> Image:
    name = request.match_info["name"]
    image = request.app[PROVISION].image(name)
    if image is None:
        raise ApiError(404, "not_found", f"no image {name!r}")
    return image


def _absent(service: ProvisionView, name: str) -> None:
    if service.image(name) is not None:
        raise ApiError(409, "conflict", f"image {name!r} exists already")


class _NameOnly(msgspec.Struct, frozen=True):
    name: ImageName


def _image_name(name: str) -> str:
    try:
        return msgspec.convert({"name": name}, _NameOnly).name
    except msgspec.ValidationError:
        raise ApiError(
            400,
            "bad_request",
            f"name {name!r}: an image name is 1-64 letters, digits, '.', '_', '-' "
            "(starting with a letter or digit)",
        ) from None


class _Empty(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The body of a POST that takes none: an empty JSON object (or nothing)."""


def _empty_body(data: bytes) -> None:
    if data.strip():
        _decode(data, _Empty, "body (an empty object)")


async def _receive(request: web.Request, path: Path) -> None:
    """The request's body into ``path`` (at most :data:`MAX_UPLOAD` bytes)."""
    size = 0
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as out:
        async for chunk in request.content.iter_chunked(CHUNK):
            size += len(chunk)
            if size > MAX_UPLOAD:
                raise ApiError(
                    413, "request_entity_too_large", f"an image file over {MAX_UPLOAD} bytes"
                )
            await asyncio.to_thread(out.write, chunk)
    if size == 0:
        raise ApiError(400, "bad_request", "the body is empty: send the image file")


async def _json_body(request: web.Request, what: str) -> Any:
    """The request's JSON body (at most :data:`MAX_REQUEST` bytes), as plain data."""
    if request.content_type.lower() != "application/json":
        raise ApiError(415, "unsupported_media_type", f"send {what} as application/json")
    data = bytearray()
    async for chunk in request.content.iter_chunked(CHUNK):
        data += chunk
        if len(data) > MAX_REQUEST:
            raise ApiError(413, "request_entity_too_large", f"a body over {MAX_REQUEST} bytes")
    if not data.strip():
        raise ApiError(400, "bad_request", f"the body is empty: send {what} as JSON")
    try:
        return msgspec.json.decode(bytes(data))
    except msgspec.DecodeError as exc:
        raise ApiError(400, "bad_request", f"the body is not valid JSON: {exc}") from None


def _decode(data: bytes, kind: type[T], what: str) -> T:
    if not data.strip():
        raise ApiError(400, "bad_request", f"the body is empty: send the {what} as JSON")
    try:
        return msgspec.json.decode(data, type=kind)
    except msgspec.ValidationError as exc:
        raise ApiError(400, "bad_request", f"invalid {what}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, "bad_request", f"the body is not valid JSON: {exc}") from None


async def _service(call: Awaitable[T]) -> T:
    try:
        return await call
    except ProvisionError as exc:
        raise error_of(exc) from None


def _order(i: Instance) -> tuple[float, str]:
    return (i.created_ts, i.instance_id)
