"""Which interfaces the node has: names from netlink, driver / PCI class / speed from sysfs.

Synchronous (pyroute2); in a named network namespace the host's sysfs does not describe
the interfaces, so only the names are known there.
"""

from __future__ import annotations

from pathlib import Path

from pyroute2 import IPRoute

from metalguard.agent.qos.plan import InterfaceInfo
from metalguard.agent.qos.tc_backend import check_netns


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return ""


def describe(name: str, sysfs: Path) -> InterfaceInfo:
    """One interface as sysfs tells it (missing files leave fields empty)."""
    base = sysfs / "class" / "net" / name
    speed_text = _read(base / "speed")
    speed = int(speed_text) if speed_text.lstrip("-").isdigit() else None
    driver_link = base / "device" / "driver"
    driver = driver_link.resolve().name if driver_link.exists() else ""
    return InterfaceInfo(
        name=name,
        driver=driver,
        pci_class=_read(base / "device" / "class"),
        speed_mbit=speed if speed and speed > 0 else None,
    )


def list_interfaces(netns: str | None, sysfs: Path) -> list[InterfaceInfo]:
    """Every interface but loopback, in ``netns`` (None: the agent's own namespace);
    TcError when the named namespace does not exist."""
    check_netns(netns)
    with IPRoute(netns=netns) if netns else IPRoute() as ipr:
        names = sorted(link.get_attr("IFLA_IFNAME") for link in ipr.get_links())
    names = [n for n in names if n and n != "lo"]
    if netns:
        return [InterfaceInfo(name=n) for n in names]
    return [describe(n, sysfs) for n in names]
