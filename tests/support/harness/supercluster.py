"""nats-servers of several regions joined by gateways (a supercluster), one server per
region, each region in its own account (docs/operations.md, "Regions and gateways").

Every region's account has JetStream (its streams and buckets stay in its region: one
account's stream names are global in a supercluster) and exports its federation subjects
(``<p>.fed.summary.<region>`` as a stream, ``<p>.fed.lookup.<region>`` and
``<p>.fed.submit.<region>`` as services); every other region's account imports them.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path

from metalguard.controller.broker.server import NatsServer
from metalguard.controller.creds.permissions import (
    account_of,
    federation_exports,
    federation_imports,
)

PASSWORD = "region-pw"


def free_port() -> int:
    """A free loopback TCP port (there is a small race: bind it soon)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RegionServer:
    """One region's nats-server: its ports, store and config file."""

    region: str
    dir: Path
    client_port: int = field(default_factory=free_port)
    monitor_port: int = field(default_factory=free_port)
    gateway_port: int = field(default_factory=free_port)
    route_port: int = field(default_factory=free_port)
    server: NatsServer | None = None
    accounts: str | None = None
    """The accounts block (``metalguard creds federate``'s); None: password users."""

    @property
    def url(self) -> str:
        """The client URL with this region's account user."""
        return f"nats://{self.region}:{PASSWORD}@127.0.0.1:{self.client_port}"

    @property
    def config_file(self) -> Path:
        return self.dir / f"{self.region}.conf"

    def start(self, regions: list[RegionServer], *, gateway: bool = True) -> None:
        """(Re)start with the gateways to ``regions`` (``gateway=False``: a region cut
        off, one server on its own, JetStream standalone over the same store)."""
        self.stop()
        self.config_file.write_text(
            server_config(self, regions, gateway=gateway, accounts=self.accounts)
        )
        self.server = NatsServer(config_file=self.config_file)
        self.server.start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


def accounts_block(regions: list[str], prefix: str) -> str:
    """Every region's account: its user, JetStream, its exports and the others' imports."""
    out = []
    for region in regions:
        exports = federation_exports(prefix, region)
        imports = federation_imports(prefix, region, regions)
        out.append(
            f"  {account_of(region)}: {{\n"
            "    jetstream: enabled\n"
            f'    users: [ {{user: "{region}", password: "{PASSWORD}"}} ]\n'
            f"    exports: [ {', '.join(exports)} ]\n"
            f"    imports: [ {', '.join(imports)} ]\n"
            "  }\n"
        )
    out.append(f'  SYS: {{ users: [ {{user: "sys", password: "{PASSWORD}"}} ] }}\n')
    return "accounts {\n" + "".join(out) + "}\nsystem_account: SYS\n"


def server_config(
    me: RegionServer,
    regions: list[RegionServer],
    *,
    gateway: bool = True,
    prefix: str = "mg",
    accounts: str | None = None,
) -> str:
    """nats-server.conf of ``me``: joined to every region by a gateway, or on its own."""
    lines = [
        f"server_name: {me.region}-1",
        f"listen: 127.0.0.1:{me.client_port}",
        f"http: 127.0.0.1:{me.monitor_port}",
        f'jetstream {{ store_dir: "{me.dir / (me.region + "-js")}" }}',
    ]
    if gateway:
        # JetStream across gateways needs a cluster block: a one-node cluster routing to
        # itself (the region's cluster of 3 in production, docs/operations.md).
        route = f"nats://127.0.0.1:{me.route_port}"
        lines.append(
            f'cluster {{ name: "{me.region}", listen: 127.0.0.1:{me.route_port}, '
            f'routes: ["{route}"] }}'
        )
        gateways = ", ".join(
            f'{{name: "{r.region}", urls: ["nats://127.0.0.1:{r.gateway_port}"]}}' for r in regions
        )
        lines.append(
            f'gateway {{ name: "{me.region}", listen: 127.0.0.1:{me.gateway_port}, '
            f"gateways: [ {gateways} ] }}"
        )
    block = (
        accounts if accounts is not None else accounts_block([r.region for r in regions], prefix)
    )
    return "\n".join(lines) + "\n" + block
