"""Fake ``class/infiniband`` trees laid out as the kernel lays them out: the device's
directory below its PCI function (``devices/pci0000:00/<pci>/infiniband/<device>``), the
class entry a relative symlink to it, ``<device>/device`` a link back to the function, and
the function's ``net/<if>/dev_port``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Port:
    """One port's files (None: the file is not written)."""

    state: str | None = "4: ACTIVE\n"
    phys_state: str | None = "5: LinkUp\n"
    rate: str | None = "200 Gb/sec (4X HDR)\n"
    link_layer: str | None = "InfiniBand\n"
    counters: Mapping[str, str] = field(default_factory=dict)
    counters_ext: Mapping[str, str] = field(default_factory=dict)
    hw_counters: Mapping[str, str] = field(default_factory=dict)
    gid_ndev: str | None = None
    """``gid_attrs/ndevs/0`` (RoCE ports have it)."""


ROCE = Port(
    rate="100 Gb/sec (2X HDR)\n",
    link_layer="Ethernet\n",
    counters={"port_rcv_data": "1000\n", "port_xmit_data": "2000\n", "symbol_error": "0\n"},
    hw_counters={
        "out_of_sequence": "3\n",
        "packet_seq_err": "1\n",
        "local_ack_timeout_err": "0\n",
        "np_ecn_marked_roce_packets": "120\n",
        "np_cnp_sent": "118\n",
        "rp_cnp_handled": "40\n",
        "lifespan": "10\n",
    },
    gid_ndev="ens1f0np0\n",
)
"""An mlx5 RoCE port: link layer Ethernet, vendor counters at port level, a bound netdev."""


def write_device(
    root: Path,
    name: str,
    ports: Mapping[int | str, Port],
    *,
    pci: str = "0000:3b:00.0",
    info: Mapping[str, str] | None = None,
    hw_counters: Mapping[str, str] | None = None,
    netdevs: Mapping[str, int | None] | None = None,
) -> Path:
    """Write one device below the sysfs root ``root``; return its real directory.

    ``info``: the device's files (default board_id, fw_ver, hca_type of a ConnectX-7);
    ``hw_counters``: device-level counters (None: no folder); ``netdevs``: the PCI
    function's interfaces with their ``dev_port`` (None: no ``dev_port`` file).
    """
    function = root / "devices" / "pci0000:00" / pci
    real = function / "infiniband" / name
    real.mkdir(parents=True)
    files = info if info is not None else {
        "board_id": "MT_0000000834\n", "fw_ver": "28.39.1002\n", "hca_type": "MT4129\n",
    }  # fmt: skip
    for file, text in files.items():
        (real / file).write_text(text)
    (real / "device").symlink_to(f"../../../{pci}")
    if hw_counters is not None:
        _folder(real / "hw_counters", hw_counters)
    for ifname, dev_port in (netdevs or {}).items():
        netdir = function / "net" / ifname
        netdir.mkdir(parents=True)
        if dev_port is not None:
            (netdir / "dev_port").write_text(f"{dev_port}\n")
    (real / "ports").mkdir()
    for number, port in ports.items():
        write_port(real / "ports" / str(number), port)
    entry = root / "class" / "infiniband" / name
    entry.parent.mkdir(parents=True, exist_ok=True)
    entry.symlink_to(f"../../devices/pci0000:00/{pci}/infiniband/{name}")
    return real


def write_port(directory: Path, port: Port) -> None:
    """One port's directory."""
    directory.mkdir(parents=True)
    for file in ("state", "phys_state", "rate", "link_layer"):
        text = getattr(port, file)
        if text is not None:
            (directory / file).write_text(text)
    _folder(directory / "counters", port.counters)
    if port.counters_ext:
        _folder(directory / "counters_ext", port.counters_ext)
    if port.hw_counters:
        _folder(directory / "hw_counters", port.hw_counters)
    if port.gid_ndev is not None:
        _folder(directory / "gid_attrs" / "ndevs", {"0": port.gid_ndev})


def _folder(directory: Path, files: Mapping[str, str]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for file, text in files.items():
        (directory / file).write_text(text)
