"""Two network namespaces joined by a veth pair, for the QoS tests (root and iproute2
only: ``needs_root``), the QoS profile they apply, and a sender of DSCP-marked datagrams.
The ``pair`` fixture (tests/integration/conftest.py) makes a fresh pair per test."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
from pyroute2 import IPRoute, netns

MISSING = [t for t in ("ip", "tc", "dcb") if shutil.which(t) is None]
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or bool(MISSING),
    reason=f"needs root and iproute2 (uid {os.geteuid()}, missing {MISSING})",
)
PROFILE_TEXT = """\
version = {version}
link_rate_mbit = 1000
pfc_priorities = [3]
dscp_map = {{ 26 = 3, 46 = 5 }}

[[traffic_class]]
name = "default"
priorities = [0, 1, 2]
bandwidth_percent = {default_share}

[[traffic_class]]
name = "training"
priorities = [3]
bandwidth_percent = {training_share}
ecn = {{ min_kb = 100, max_kb = 400, probability = 0.1 }}

[[traffic_class]]
name = "control"
priorities = [5]
bandwidth_percent = 10
strict = true
"""
DEFAULT_CLASS, TRAINING_CLASS = "1:10", "1:11"


def profile_text(version: int = 1, default_share: int = 40, training_share: int = 50) -> str:
    return PROFILE_TEXT.format(
        version=version, default_share=default_share, training_share=training_share
    )


@dataclass(frozen=True)
class VethPair:
    """Namespace ``ns_a`` with ``if_a`` (10.77.x.1) joined to ``ns_b`` with ``if_b``."""

    ns_a: str
    ns_b: str
    if_a: str
    if_b: str
    addr_a: str
    addr_b: str


@contextmanager
def veth_pair() -> Iterator[VethPair]:
    """Two fresh namespaces (``mgtq-<id>-a|b``) joined by a veth pair; both removed at the
    end, whatever happened (removing a namespace removes its end of the pair)."""
    tag = uuid.uuid4().hex[:6]
    subnet = int(tag[:2], 16)
    pair = VethPair(
        f"mgtq-{tag}-a", f"mgtq-{tag}-b", f"tqa{tag}", f"tqb{tag}", f"10.77.{subnet}.1",
        f"10.77.{subnet}.2",
    )  # fmt: skip
    created: list[str] = []
    try:
        for ns in (pair.ns_a, pair.ns_b):
            netns.create(ns)
            created.append(ns)
        with IPRoute(netns=pair.ns_a) as ipr:
            ipr.link(
                "add",
                ifname=pair.if_a,
                kind="veth",
                peer={"ifname": pair.if_b, "net_ns_fd": pair.ns_b},
            )
            a = ipr.link_lookup(ifname=pair.if_a)[0]
            ipr.addr("add", index=a, address=pair.addr_a, prefixlen=24)
            ipr.link("set", index=a, state="up")
        with IPRoute(netns=pair.ns_b) as ipr:
            b = ipr.link_lookup(ifname=pair.if_b)[0]
            ipr.addr("add", index=b, address=pair.addr_b, prefixlen=24)
            ipr.link("set", index=b, state="up")
            mac_b = ipr.get_links(b)[0].get_attr("IFLA_ADDRESS")
        with IPRoute(netns=pair.ns_a) as ipr:  # a static neighbour: no datagram waits on ARP
            ipr.neigh("add", dst=pair.addr_b, lladdr=mac_b, ifindex=a, state="permanent")
        yield pair
    finally:
        for ns in created:
            netns.remove(ns)


SENDER = textwrap.dedent(
    """
    import socket, sys
    dst, dscp, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, dscp << 2)
    for _ in range(count):
        s.sendto(b"x" * 64, (dst, 9))
    """
)


def send(pair: VethPair, dscp: int, count: int) -> None:
    """``count`` UDP datagrams with ``dscp`` from namespace A to B (inside the pair only)."""
    subprocess.run(
        ["ip", "netns", "exec", pair.ns_a, sys.executable, "-c", SENDER, pair.addr_b,
         str(dscp), str(count)],
        check=True,
        timeout=30,
    )  # fmt: skip
