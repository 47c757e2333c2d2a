"""A Redfish service for the tests: DMTF mockup documents over HTTPS on loopback.

It serves the documents under ``tests/fixtures/redfish/public-rackmount1`` (a trimmed
copy of DMTF's ``public-rackmount1`` mockup, see the README there) and implements what a
BMC does with them, so that state changes are visible afterwards:

- authentication: HTTP Basic or a session (``POST SessionService/Sessions`` answers 201
  with ``X-Auth-Token`` and ``Location``; ``DELETE`` on it ends the session); every
  resource but the service root needs one, else 401 with a Redfish error body;
- ``ComputerSystem.Reset``: ``On``/``ForceOn``/``PushPowerButton`` boot an off system,
  ``ForceOff`` stops it at once, ``GracefulShutdown`` passes through ``PoweringOff`` for
  ``shutdown_polls`` reads of the system, ``ForceRestart``/``GracefulRestart``/
  ``PowerCycle`` reboot it; a type not in ``ResetType@Redfish.AllowableValues`` is 400;
- ``PATCH`` of ``Boot.BootSourceOverrideTarget``/``BootSourceOverrideEnabled`` (values
  checked against the allowable ones); each boot records the source it used in ``boots``
  and consumes a ``Once`` override (Enabled -> ``Disabled``, Target -> ``None``), as
  DSP0268 specifies;
- power hooks (``on_boot``, ``on_power_off``): callbacks a test sets to drive a real
  machine from the BMC's power actions (tests/support/harness/provision_vm.py starts and stops
  a QEMU VM with them); unset, nothing but the documents changes.

The fixtures ``certificate`` and ``bmc`` (tests/integration/conftest.py) start one per
test; test_bmc_redfish_emulator.py checks the emulator itself.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import shutil
import ssl
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest
from aiohttp import web

from tests.support import FIXTURES

MOCKUP = FIXTURES / "redfish" / "public-rackmount1"
SYSTEM = "/redfish/v1/Systems/437XR1138R2"
CHASSIS = "/redfish/v1/Chassis/1U"
SESSIONS = "/redfish/v1/SessionService/Sessions"
USER = "admin"
PASSWORD = "correct horse"


def load_mockup(root: Path) -> dict[str, dict[str, Any]]:
    """Every ``index.json`` under ``root``, keyed by its resource path."""
    docs = {}
    for index in root.rglob("index.json"):
        path = "/" + str(index.parent.relative_to(root))
        docs[path] = json.loads(index.read_text())
    return docs


@dataclass
class Certificate:
    """A self-signed certificate for 127.0.0.1 and its key (PEM files)."""

    cert: Path
    key: Path

    def server_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(self.cert, self.key)
        return ctx


def make_certificate(directory: Path) -> Certificate:
    """An EC P-256 self-signed certificate made with the openssl CLI."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl not on PATH: cannot make the emulator's TLS certificate")
    cert, key = directory / "bmc.crt", directory / "bmc.key"
    subprocess.run(
        [
            openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-days", "2", "-subj", "/CN=127.0.0.1",
            "-addext", "subjectAltName=IP:127.0.0.1",
            "-keyout", str(key), "-out", str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )  # fmt: skip
    return Certificate(cert, key)


def redfish_error(status: int, message: str) -> web.Response:
    body = {
        "error": {
            "code": "Base.1.8.GeneralError",
            "message": message,
            "@Message.ExtendedInfo": [{"MessageId": "Base.1.8.GeneralError", "Message": message}],
        }
    }
    return web.json_response(body, status=status)


@dataclass
class RedfishEmulator:
    """The mockup served with BMC semantics; its state is inspectable by tests."""

    docs: dict[str, dict[str, Any]] = field(default_factory=lambda: load_mockup(MOCKUP))
    user: str = USER
    password: str = PASSWORD
    legacy_only: bool = False
    """Drop the ThermalSubsystem/PowerSubsystem links: only Thermal/Power remain."""
    shutdown_polls: int = 2
    require_if_match: bool = False
    """Answer 428 to a PATCH without ``If-Match`` (some BMCs do); a stale one is 412."""
    stays_off: bool = False
    """A node whose power does not come back (a PSU that died): ``On`` is accepted, no boot."""
    sessions: dict[str, str] = field(default_factory=dict)
    """token -> session URI of the live sessions."""
    sessions_created: int = 0
    sessions_deleted: int = 0
    resets: list[str] = field(default_factory=list)
    boots: list[str] = field(default_factory=list)
    patches: list[dict[str, Any]] = field(default_factory=list)
    auth_seen: set[str] = field(default_factory=set)
    """``basic`` and/or ``session``: how authenticated requests came."""
    on_boot: Callable[[str], None] | None = None
    """Called at each boot with the source it used (``Pxe``, ``Hdd``, ...), also when the
    system was already on (a restart)."""
    on_power_off: Callable[[], None] | None = None
    """Called when the power goes from on (or powering off) to off."""
    _pending_off: int = 0

    def __post_init__(self) -> None:
        if self.legacy_only:
            chassis = self.docs[CHASSIS]
            chassis.pop("ThermalSubsystem", None)
            chassis.pop("PowerSubsystem", None)

    @property
    def system(self) -> dict[str, Any]:
        return self.docs[SYSTEM]

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app

    def _authorized(self, request: web.Request) -> bool:
        token = request.headers.get("X-Auth-Token", "")
        if token and token in self.sessions:
            self.auth_seen.add("session")
            return True
        header = request.headers.get("Authorization", "")
        if header.startswith("Basic "):
            user, _, password = base64.b64decode(header[6:]).decode().partition(":")
            if (user, password) == (self.user, self.password):
                self.auth_seen.add("basic")
                return True
        return False

    async def handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path.rstrip("/") or "/"
        if request.method == "POST" and path == SESSIONS:
            return await self._login(request)
        if path != "/redfish/v1" and not self._authorized(request):
            return redfish_error(401, "Authentication required: missing or wrong credentials.")
        if request.method == "GET":
            return self._get(path)
        if request.method == "DELETE" and path.startswith(SESSIONS + "/"):
            return self._logout(path)
        if request.method == "POST" and path == SYSTEM + "/Actions/ComputerSystem.Reset":
            return self._reset(await request.json())
        if request.method == "PATCH" and path == SYSTEM:
            if_match = request.headers.get("If-Match")
            if if_match is None and self.require_if_match:
                return redfish_error(428, "If-Match header required")
            if if_match is not None and if_match != self._etag(self.system):
                return redfish_error(412, "ETag does not match: the resource changed")
            return self._patch(await request.json())
        return redfish_error(405, f"{request.method} not allowed on {path}")

    async def _login(self, request: web.Request) -> web.Response:
        body = await request.json()
        if (body.get("UserName"), body.get("Password")) != (self.user, self.password):
            return redfish_error(401, "Invalid username or password.")
        token = uuid4().hex
        uri = f"{SESSIONS}/{token[:8]}"
        self.sessions[token] = uri
        self.sessions_created += 1
        doc = {"@odata.id": uri, "Id": token[:8], "UserName": self.user}
        return web.json_response(doc, status=201, headers={"X-Auth-Token": token, "Location": uri})

    def _logout(self, path: str) -> web.Response:
        for token, uri in list(self.sessions.items()):
            if uri == path:
                del self.sessions[token]
                self.sessions_deleted += 1
                return web.Response(status=204)
        return redfish_error(404, f"no session {path}")

    def _get(self, path: str) -> web.Response:
        if path == SYSTEM and self._pending_off > 0:
            self._pending_off -= 1
            if self._pending_off == 0:
                self._set_power("Off")
        doc = self.docs.get(path)
        if doc is None:
            return redfish_error(404, f"no resource {path}")
        if path == SESSIONS:
            doc = {**doc, "Members": [{"@odata.id": u} for u in self.sessions.values()]}
        return web.json_response(copy.deepcopy(doc), headers={"ETag": self._etag(doc)})

    @staticmethod
    def _etag(doc: dict[str, Any]) -> str:
        digest = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()
        return f'W/"{digest[:16]}"'

    def _set_power(self, state: str) -> None:
        was = self.system["PowerState"]
        self.system["PowerState"] = state
        self.docs[CHASSIS]["PowerState"] = state
        if state == "Off" and was != "Off" and self.on_power_off is not None:
            self.on_power_off()

    def _boot(self) -> None:
        boot = self.system["Boot"]
        if boot.get("BootSourceOverrideEnabled") in ("Once", "Continuous"):
            self.boots.append(boot.get("BootSourceOverrideTarget", "None"))
            if boot["BootSourceOverrideEnabled"] == "Once":
                boot["BootSourceOverrideEnabled"] = "Disabled"
                boot["BootSourceOverrideTarget"] = "None"
        else:
            self.boots.append("Hdd")
        self._set_power("On")
        if self.on_boot is not None:
            self.on_boot(self.boots[-1])

    def _reset(self, body: dict[str, Any]) -> web.Response:
        kind = body.get("ResetType", "")
        allowed = self.system["Actions"]["#ComputerSystem.Reset"][
            "ResetType@Redfish.AllowableValues"
        ]
        if kind not in allowed:
            return redfish_error(400, f"ResetType {kind!r} is not one of {allowed}")
        self.resets.append(kind)
        state = self.system["PowerState"]
        if kind in ("On", "ForceOn", "PushPowerButton") and state == "Off":
            if not self.stays_off:
                self._boot()
        elif kind == "PushPowerButton" and state == "On":
            self._set_power("Off")
        elif kind == "ForceOff":
            self._pending_off = 0
            self._set_power("Off")
        elif kind == "GracefulShutdown" and state == "On":
            self._set_power("PoweringOff")
            self._pending_off = self.shutdown_polls
        elif kind in ("ForceRestart", "GracefulRestart", "PowerCycle") and state == "On":
            self._boot()
        return web.Response(status=204)

    def _patch(self, body: dict[str, Any]) -> web.Response:
        self.patches.append(body)
        boot = self.system["Boot"]
        for key, value in body.get("Boot", {}).items():
            if key == "BootSourceOverrideTarget":
                allowed = boot["BootSourceOverrideTarget@Redfish.AllowableValues"]
                if value not in allowed:
                    return redfish_error(400, f"{key} {value!r} is not one of {allowed}")
            elif key == "BootSourceOverrideEnabled":
                if value not in ("Once", "Continuous", "Disabled"):
                    return redfish_error(400, f"{key} {value!r} is not allowed")
            elif key != "BootSourceOverrideMode":
                return redfish_error(400, f"property Boot.{key} is read-only or unknown")
            boot[key] = value
        return web.json_response(copy.deepcopy(self.system))


@dataclass
class RunningEmulator:
    """An emulator serving on loopback (what the ``bmc`` fixture yields)."""

    emulator: RedfishEmulator
    address: str
    """``127.0.0.1:PORT`` as a ``[[bmc]]`` address."""
    certificate: Certificate


async def start_emulator(
    emulator: RedfishEmulator, certificate: Certificate | None
) -> tuple[web.AppRunner, str]:
    """Serve ``emulator`` over HTTPS on a free loopback port (plain HTTP when
    ``certificate`` is None, as sushy-tools does by default): its runner (clean it up)
    and its ``127.0.0.1:PORT`` address."""
    runner = web.AppRunner(emulator.app(), access_log=None)
    await runner.setup()
    tls = certificate.server_context() if certificate is not None else None
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls)
    await site.start()
    server = site._server
    assert server is not None
    port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
    return runner, f"127.0.0.1:{port}"
