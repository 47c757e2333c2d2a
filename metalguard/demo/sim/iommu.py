"""A simulated node's IOMMU in its sysfs tree (docs/simulation.md, docs/security.md "DMA
isolation"): ``class/iommu/dmar0``, a group per GPU and NIC (``kernel/iommu_groups/<n>``
with its ``type`` and ``devices/<bdf>`` links, each device's ``iommu_group`` link), and a
``config`` file for each device and the root port above it, in the PCI configuration
space's format: a PCI Express capability with the port type and, on root ports, ACS
(capability SV TB RR CR UF DT, redirect enabled as Linux does: QEMU's root ports' bytes,
tests/fixtures/iommu/PROVENANCE.md). The agent's real ``iommu`` collector reads it.
"""

from __future__ import annotations

import posixpath
from collections.abc import Sequence
from typing import Final

ACS_CAP: Final = 0x005F
ACS_REDIRECT: Final = 0x001D
PORT_ENDPOINT: Final = 0
PORT_ROOT: Final = 4
DOMAIN: Final = "DMA-FQ"


def config_space(vendor: str, device: str, pci_class: str, port: int, *, acs: bool) -> bytes:
    """4096 bytes of configuration space: the header, a PCI Express capability at 0x40 of
    ``port`` type, and (``acs``) an ACS extended capability at 0x100."""
    config = bytearray(4096)
    config[0:2] = int(vendor, 16).to_bytes(2, "little")
    config[2:4] = int(device, 16).to_bytes(2, "little")
    config[0x06] = 0x10  # a capability list
    config[0x09:0x0C] = int(pci_class, 16).to_bytes(3, "little")
    config[0x0E] = 0x01 if port == PORT_ROOT else 0x00  # header type: bridge / endpoint
    config[0x34] = 0x40
    config[0x40:0x44] = (0x10 | 0x0002 << 16 | port << 20).to_bytes(4, "little")  # ID, v2
    if acs:
        config[0x100:0x104] = (0x000D | 1 << 16).to_bytes(4, "little")  # ACS v1, last
        config[0x104:0x108] = (ACS_CAP | ACS_REDIRECT << 16).to_bytes(4, "little")
    return bytes(config)


def add_iommu(
    files: dict[str, str | bytes],
    links: dict[str, str],
    sys: str,
    devices: Sequence[tuple[str, str, tuple[str, str, str]]],
    bridge: tuple[str, str, str],
) -> None:
    """Give each ``(device dir, address, (class, vendor, device))`` a group of its own,
    its config space, and its root port (the directory above it) a config with ACS."""
    files[f"{sys}/class/iommu/dmar0/intel-iommu/version"] = "1:0\n"
    for group, (dev_dir, address, (cls, vendor, device)) in enumerate(devices):
        base = f"{sys}/{dev_dir}"
        files[f"{base}/config"] = config_space(vendor, device, cls, PORT_ENDPOINT, acs=False)
        port_dir = posixpath.dirname(base)
        b_cls, b_vendor, b_device = bridge
        files[f"{port_dir}/config"] = config_space(b_vendor, b_device, b_cls, PORT_ROOT, acs=True)
        group_dir = f"{sys}/kernel/iommu_groups/{group}"
        files[f"{group_dir}/type"] = f"{DOMAIN}\n"
        member = f"{group_dir}/devices/{address}"
        links[member] = posixpath.relpath(base, posixpath.dirname(member))
        links[f"{base}/iommu_group"] = posixpath.relpath(group_dir, base)
