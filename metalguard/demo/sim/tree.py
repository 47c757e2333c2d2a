"""Generate one node's fake sysfs tree (and saved SMART JSON) shaped like the real thing.

:func:`layout` is pure: it maps a :class:`NodeSpec` and a seed to the files and relative
symlinks of the tree.  :func:`write_tree` materialises that layout under a directory and
returns a :class:`NodeTree` naming the paths the fault injectors change.

The shapes follow Linux (docs NOTES §9) and the node_exporter fixture tree::

    sys/bus/pci/devices/<addr>  -> ../../../devices/pci0000:00/<port>/<addr>
    sys/class/hwmon/hwmonN      -> ../../devices/platform/<chip>/hwmon/hwmonN
    sys/devices/platform/<chip>/hwmon/hwmonN/device -> ../../../<chip>
    sys/devices/system/edac/mc/mcN/{ce_count,...,dimmM/{dimm_ce_count,...}}
    sys/class/infiniband/mlx5_N -> ../../devices/pci0000:00/<port>/<nic>/infiniband/mlx5_N
    sys/devices/.../<nic>/infiniband/mlx5_N/{board_id,fw_ver,hca_type,device -> ../../../<nic>,
        ports/1/{state,phys_state,rate,link_layer,counters/*,hw_counters/*}}
    sys/devices/.../<nic>/net/<ifname>  (the netdev the RDMA device is bound to)
    sys/class/net/<ifname>      -> ../../devices/pci0000:00/<port>/<nic>/net/<ifname>
    smart/nvmeN.json            (smartctl --json -a output, the collector's smart_json_dir)
"""

from __future__ import annotations

import json
import os
import posixpath
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

from metalguard.demo.sim.iommu import add_iommu

SYS = "sys"
SMART = "smart"

GPU_CLASS = "0x030200"
GPU_VENDOR = "0x10de"
GPU_DEVICE = "0x2330"
NIC_CLASS_IB = "0x020700"
NIC_CLASS_ETH = "0x020000"
NIC_VENDOR = "0x15b3"
NIC_DEVICE = "0x1021"
BRIDGE_CLASS = "0x060400"
BRIDGE_VENDOR = "0x8086"
BRIDGE_DEVICE = "0x352a"

SPEED_16 = "16.0 GT/s PCIe"

AER_COR_NAMES = (
    "RxErr",
    "BadTLP",
    "BadDLLP",
    "Rollover",
    "Timeout",
    "NonFatalErr",
    "CorrIntErr",
    "HeaderOF",
)
AER_UNCOR_NAMES = (
    "Undefined",
    "DLP",
    "SDES",
    "TLP",
    "FCP",
    "CmpltTO",
    "CmpltAbrt",
    "UnxCmplt",
    "RxOF",
    "MalfTLP",
    "ECRC",
    "UnsupReq",
    "ACSViol",
    "UncorrIntErr",
    "BlockedTLP",
    "AtomicOpBlocked",
    "TLPBlockedErr",
    "PoisonTLPBlocked",
)

FAN_CHIP = "nct6775.656"
TEMP_CHIP = "coretemp.0"
TEMP_MAX_MILLI = 85000
TEMP_CRIT_MILLI = 95000
FAN_MIN_RPM = 2000

RDMA_DRIVER = "mlx5"
RDMA_HCA_TYPE = "MT4129"
"""ConnectX-7."""
RDMA_BOARD_ID = "MT_0000000838"
RDMA_FW_VER = "28.39.1002"
RDMA_RATE = "400 Gb/sec (4X NDR)"
RDMA_RATE_GBPS = 400.0
STATE_ACTIVE = "4: ACTIVE"
STATE_DOWN = "1: DOWN"
PHYS_LINK_UP = "5: LinkUp"
PHYS_DISABLED = "3: Disabled"
PHYS_POLLING = "2: Polling"
LINK_LAYER_IB = "InfiniBand"
LINK_LAYER_ETH = "Ethernet"

RDMA_DATA_COUNTERS = (
    "port_xmit_data",
    "port_rcv_data",
    "port_xmit_packets",
    "port_rcv_packets",
    "unicast_xmit_packets",
    "unicast_rcv_packets",
)
"""The ``counters/`` files traffic moves (data in 4-octet words, packets)."""
RDMA_FLAT_COUNTERS = (
    "VL15_dropped",
    "excessive_buffer_overrun_errors",
    "link_downed",
    "link_error_recovery",
    "local_link_integrity_errors",
    "multicast_rcv_packets",
    "multicast_xmit_packets",
    "port_rcv_constraint_errors",
    "port_rcv_errors",
    "port_rcv_remote_physical_errors",
    "port_rcv_switch_relay_errors",
    "port_xmit_constraint_errors",
    "port_xmit_discards",
    "port_xmit_wait",
    "symbol_error",
)
"""The other ``counters/`` files mlx5 shows: errors, waits, multicast; 0 unless faulted."""
HW_COUNTERS_IB = (
    "duplicate_request",
    "implied_nak_seq_err",
    "local_ack_timeout_err",
    "out_of_buffer",
    "out_of_sequence",
    "packet_seq_err",
    "rnr_nak_retry_err",
)
"""Port ``hw_counters/`` of an mlx5 InfiniBand port (a subset of the driver's)."""
HW_COUNTERS_ROCE = (
    *HW_COUNTERS_IB,
    "np_cnp_sent",
    "np_ecn_marked_roce_packets",
    "rp_cnp_handled",
    "rp_cnp_ignored",
)
"""An mlx5 RoCE port's ``hw_counters/``: the InfiniBand ones plus DCQCN's."""


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """What hardware one simulated node has."""

    gpus: int = 8
    nics: int = 2
    infiniband: bool = True
    """NIC class 0x020700 (InfiniBand) when true, else 0x020000 (Ethernet)."""
    dimms: int = 16
    memory_controllers: int = 2
    fans: int = 8
    temps: int = 5
    disks: int = 2
    rdma: bool = True
    """Each NIC is an RDMA device ``mlx5_<j>`` with one port (InfiniBand when
    ``infiniband``, else RoCE) in ``class/infiniband``."""
    iommu: bool = True
    """An IOMMU with a group for each GPU and NIC and ACS on their root ports (the
    ``iommu`` collector's posture: ``isolated``; demo/sim/iommu.py)."""
    bridges: bool = False
    """List the root ports above the GPUs and NICs in ``bus/pci/devices`` too (as real
    sysfs does).  Off by default: they double the cost of every PCIe scan, and a fleet of
    simulated agents in one process is CPU-bound."""


@dataclass(frozen=True, slots=True)
class Layout:
    """A tree as data: file contents and symlink targets by path relative to the node dir."""

    files: dict[str, str | bytes]
    """Text, or bytes (a PCI configuration space)."""
    links: dict[str, str]
    tree: NodeTreePaths


@dataclass(frozen=True, slots=True)
class NodeTreePaths:
    """The paths (relative to ``sys/``, or to the node dir for SMART files) faults change."""

    gpus: tuple[str, ...]
    """Real device directories of the GPUs, e.g. ``devices/pci0000:00/0000:00:01.0/...``."""
    nics: tuple[str, ...]
    mcs: tuple[str, ...]
    """``devices/system/edac/mc/mcN`` directories."""
    dimms: tuple[str, ...]
    """``.../mcN/dimmM`` directories, all controllers."""
    fans: tuple[str, ...]
    """``fanN_input`` files."""
    temps: tuple[str, ...]
    """``tempN_input`` files."""
    disks: tuple[str, ...]
    """SMART JSON files (relative to the node dir)."""
    rdma_ports: tuple[str, ...] = ()
    """Real directories of the RDMA ports, ``devices/.../infiniband/mlx5_0/ports/1``."""


@dataclass(frozen=True, slots=True)
class NodeTree:
    """A written tree: its directories and the paths faults change."""

    root: Path
    """The node directory (holds ``sys/`` and ``smart/``)."""
    paths: NodeTreePaths

    @property
    def sysfs(self) -> Path:
        """The sysfs root to give the agent (``collect.sysfs``)."""
        return self.root / SYS

    @property
    def smart_dir(self) -> Path:
        """The saved-JSON directory to give the agent (``collect.smart_json_dir``)."""
        return self.root / SMART

    @property
    def iommu(self) -> bool:
        """Whether the tree has an IOMMU (``class/iommu``): the ``iommu`` collector runs."""
        return (self.root / SYS / "class" / "iommu").is_dir()

    def sys_path(self, rel: str) -> Path:
        """An absolute path below ``sys/``."""
        return self.sysfs / rel

    @property
    def crit_celsius(self) -> float:
        """The critical limit every generated temperature sensor has."""
        return TEMP_CRIT_MILLI / 1000


def aer_text(names: tuple[str, ...], total: str, counts: dict[str, int] | None = None) -> str:
    """An ``aer_dev_*`` file: one ``<name> <count>`` line per error, then the total."""
    counts = counts or {}
    lines = [f"{name} {counts.get(name, 0)}" for name in names]
    lines.append(f"{total} {counts.get(total, 0)}")
    return "\n".join(lines) + "\n"


def dimm_label(mc: int, index: int) -> str:
    """The label a BIOS gives DIMM ``index`` of controller ``mc`` (2 DIMMs a channel)."""
    return f"CPU_SrcID#{mc}_Ha#0_Chan#{index // 2}_DIMM#{index % 2}"


def smart_document(index: int, serial: str, rng: random.Random) -> dict[str, object]:
    """A healthy NVMe's ``smartctl --json -a`` output (the Micron 7450 fixture's shape)."""
    name = f"/dev/nvme{index}"
    temp = rng.randint(28, 38)
    hours = rng.randint(100, 20000)
    return {
        "device": {"info_name": name, "name": name, "protocol": "NVMe", "type": "nvme"},
        "firmware_version": "E2MU200",
        "json_format_version": [1, 0],
        "local_time": {"asctime": "Fri Feb 13 23:31:30 2009 UTC", "time_t": 1234567890},
        "model_name": "Micron_7450_MTFDKCB3T8TFR",
        "nvme_controller_id": 0,
        "nvme_ieee_oui_identifier": 41077,
        "nvme_number_of_namespaces": 132,
        "nvme_pci_vendor": {"id": 4932, "subsystem_id": 4932},
        "nvme_smart_health_information_log": {
            "available_spare": 100,
            "available_spare_threshold": 10,
            "controller_busy_time": rng.randint(10, 5000),
            "critical_comp_time": 0,
            "critical_warning": 0,
            "data_units_read": rng.randint(10**6, 10**8),
            "data_units_written": rng.randint(10**6, 10**8),
            "host_reads": rng.randint(10**7, 10**9),
            "host_writes": rng.randint(10**7, 10**9),
            "media_errors": 0,
            "num_err_log_entries": 0,
            "percentage_used": rng.randint(0, 5),
            "power_cycles": rng.randint(1, 50),
            "power_on_hours": hours,
            "temperature": temp,
            "temperature_sensors": [temp + 8, temp + 3, temp - 1],
            "unsafe_shutdowns": 0,
            "warning_temp_time": 0,
        },
        "nvme_total_capacity": 3840755982336,
        "nvme_unallocated_capacity": 0,
        "nvme_version": {"string": "1.4", "value": 66560},
        "power_cycle_count": 1,
        "power_on_time": {"hours": hours},
        "serial_number": serial,
        "smart_status": {"nvme": {"value": 0}, "passed": True},
        "smart_support": {"available": True, "enabled": True},
        "smartctl": {
            "argv": ["smartctl", "--json", "-a", name],
            "build_info": "(local build)",
            "exit_status": 0,
            "platform_info": "x86_64-linux",
            "version": [7, 3],
        },
        "temperature": {"current": temp},
    }


def _pci_device(
    files: dict[str, str | bytes],
    links: dict[str, str],
    port_addr: str,
    addr: str,
    ident: tuple[str, str, str],
    *,
    bridge: bool,
) -> str:
    """Write a root port and its endpoint; return the endpoint's real directory.

    Without ``bridge`` the port is only the endpoint's parent directory: not listed in
    ``bus/pci/devices`` and without attributes.
    """
    port_dir = f"devices/pci0000:00/{port_addr}"
    dev_dir = f"{port_dir}/{addr}"
    devices = [(dev_dir, addr, ident)]
    if bridge:
        devices.insert(0, (port_dir, port_addr, (BRIDGE_CLASS, BRIDGE_VENDOR, BRIDGE_DEVICE)))
    for directory, address, (cls, vendor, device) in devices:
        base = f"{SYS}/{directory}"
        files[f"{base}/class"] = cls + "\n"
        files[f"{base}/vendor"] = vendor + "\n"
        files[f"{base}/device"] = device + "\n"
        files[f"{base}/current_link_speed"] = SPEED_16 + "\n"
        files[f"{base}/max_link_speed"] = SPEED_16 + "\n"
        files[f"{base}/current_link_width"] = "16\n"
        files[f"{base}/max_link_width"] = "16\n"
        files[f"{base}/aer_dev_correctable"] = aer_text(AER_COR_NAMES, "TOTAL_ERR_COR")
        files[f"{base}/aer_dev_fatal"] = aer_text(AER_UNCOR_NAMES, "TOTAL_ERR_FATAL")
        files[f"{base}/aer_dev_nonfatal"] = aer_text(AER_UNCOR_NAMES, "TOTAL_ERR_NONFATAL")
        link = f"{SYS}/bus/pci/devices/{address}"
        links[link] = posixpath.relpath(f"{SYS}/{directory}", posixpath.dirname(link))
    return dev_dir


def rdma_device(index: int) -> str:
    """The RDMA device name of NIC ``index``: ``mlx5_0``, ..."""
    return f"{RDMA_DRIVER}_{index}"


def rdma_port_names(spec: NodeSpec) -> tuple[str, ...]:
    """The ``<device>/<port>`` names of a spec's RDMA ports (``NodeTopology.rdma_ports``)."""
    return tuple(f"{rdma_device(j)}/1" for j in range(spec.nics)) if spec.rdma else ()


def port_name(port_dir: str) -> str:
    """``mlx5_0/1`` for ``devices/.../infiniband/mlx5_0/ports/1``."""
    parts = port_dir.split("/")
    return f"{parts[-3]}/{parts[-1]}"


def netdev_name(bus: int, infiniband: bool) -> str:
    """The predictable name of the netdev on PCI bus ``bus``: IPoIB ``ibp48s0``, or the
    Ethernet port of a RoCE NIC ``enp48s0np0``."""
    return f"ibp{bus}s0" if infiniband else f"enp{bus}s0np0"


def _rdma_device(
    files: dict[str, str | bytes],
    links: dict[str, str],
    nic_dir: str,
    index: int,
    bus: int,
    *,
    infiniband: bool,
    rng: random.Random,
) -> str:
    """An mlx5 device on the NIC at ``nic_dir`` with one port and its netdev, shaped as
    the kernel shows them; return the port's real directory."""
    name = rdma_device(index)
    dev = f"{nic_dir}/infiniband/{name}"
    base = f"{SYS}/{dev}"
    guid = ":".join(f"{rng.randrange(16**4):04x}" for _ in range(4))
    files[f"{base}/board_id"] = RDMA_BOARD_ID + "\n"
    files[f"{base}/fw_ver"] = RDMA_FW_VER + "\n"
    files[f"{base}/hca_type"] = RDMA_HCA_TYPE + "\n"
    files[f"{base}/hw_rev"] = "0x0\n"
    files[f"{base}/node_type"] = "1: CA\n"
    files[f"{base}/node_guid"] = guid + "\n"
    files[f"{base}/sys_image_guid"] = guid + "\n"
    links[f"{base}/device"] = "../../../" + nic_dir.rsplit("/", 1)[1]
    class_link = f"{SYS}/class/infiniband/{name}"
    links[class_link] = posixpath.relpath(base, posixpath.dirname(class_link))

    port = f"{dev}/ports/1"
    p = f"{SYS}/{port}"
    files[f"{p}/state"] = STATE_ACTIVE + "\n"
    files[f"{p}/phys_state"] = PHYS_LINK_UP + "\n"
    files[f"{p}/rate"] = RDMA_RATE + "\n"
    files[f"{p}/link_layer"] = (LINK_LAYER_IB if infiniband else LINK_LAYER_ETH) + "\n"
    files[f"{p}/lid"] = (f"0x{rng.randrange(1, 0xBFFF):x}" if infiniband else "0x0") + "\n"
    files[f"{p}/sm_lid"] = ("0x1" if infiniband else "0x0") + "\n"
    files[f"{p}/lid_mask_count"] = "0\n"
    words = rng.randrange(10**7, 10**8)
    packets = words // 1024
    start = {
        "port_xmit_data": words,
        "port_rcv_data": words + rng.randrange(10**6),
        "port_xmit_packets": packets,
        "port_rcv_packets": packets,
        "unicast_xmit_packets": packets,
        "unicast_rcv_packets": packets,
    }
    for counter, value in start.items():
        files[f"{p}/counters/{counter}"] = f"{value}\n"
    for counter in RDMA_FLAT_COUNTERS:
        files[f"{p}/counters/{counter}"] = "0\n"
    for counter in HW_COUNTERS_IB if infiniband else HW_COUNTERS_ROCE:
        files[f"{p}/hw_counters/{counter}"] = "0\n"

    ifname = netdev_name(bus, infiniband)
    if not infiniband:  # RoCE GIDs name their netdev; an IB port's refuse to be read
        for gid, kind in enumerate(("IB/RoCE v1", "RoCE v2")):
            files[f"{p}/gid_attrs/ndevs/{gid}"] = ifname + "\n"
            files[f"{p}/gid_attrs/types/{gid}"] = kind + "\n"
    net = f"{nic_dir}/net/{ifname}"
    files[f"{SYS}/{net}/dev_port"] = "0\n"
    files[f"{SYS}/{net}/operstate"] = "up\n"
    files[f"{SYS}/{net}/mtu"] = ("4092" if infiniband else "9000") + "\n"
    files[f"{SYS}/{net}/type"] = ("32" if infiniband else "1") + "\n"
    net_link = f"{SYS}/class/net/{ifname}"
    links[net_link] = posixpath.relpath(f"{SYS}/{net}", posixpath.dirname(net_link))
    return port


def _hwmon_chip(
    files: dict[str, str | bytes], links: dict[str, str], chip: str, number: int, name: str
) -> str:
    """Create ``devices/platform/<chip>/hwmon/hwmonN`` with its links; return that dir."""
    real = f"devices/platform/{chip}/hwmon/hwmon{number}"
    files[f"{SYS}/{real}/name"] = name + "\n"
    files[f"{SYS}/devices/platform/{chip}/modalias"] = f"platform:{chip.split('.')[0]}\n"
    class_link = f"{SYS}/class/hwmon/hwmon{number}"
    links[class_link] = posixpath.relpath(f"{SYS}/{real}", posixpath.dirname(class_link))
    links[f"{SYS}/{real}/device"] = "../../../" + chip
    return real


def layout(spec: NodeSpec, seed: int) -> Layout:
    """The files and links of one node's tree; the same spec and seed give the same tree."""
    rng = random.Random(seed)
    files: dict[str, str | bytes] = {}
    links: dict[str, str] = {}

    gpus = tuple(
        _pci_device(
            files,
            links,
            f"0000:00:{1 + i:02x}.0",
            f"0000:{0x10 + i:02x}:00.0",
            (GPU_CLASS, GPU_VENDOR, GPU_DEVICE),
            bridge=spec.bridges,
        )
        for i in range(spec.gpus)
    )
    nic_class = NIC_CLASS_IB if spec.infiniband else NIC_CLASS_ETH
    nics = tuple(
        _pci_device(
            files,
            links,
            f"0000:00:{0x10 + j:02x}.0",
            f"0000:{0x30 + j:02x}:00.0",
            (nic_class, NIC_VENDOR, NIC_DEVICE),
            bridge=spec.bridges,
        )
        for j in range(spec.nics)
    )

    if spec.iommu:
        add_iommu(
            files,
            links,
            SYS,
            [(d, f"0000:{0x10 + i:02x}:00.0", (GPU_CLASS, GPU_VENDOR, GPU_DEVICE))
             for i, d in enumerate(gpus)]
            + [(d, f"0000:{0x30 + j:02x}:00.0", (nic_class, NIC_VENDOR, NIC_DEVICE))
               for j, d in enumerate(nics)],
            (BRIDGE_CLASS, BRIDGE_VENDOR, BRIDGE_DEVICE),
        )  # fmt: skip

    rdma_rng = random.Random(f"rdma-{seed}")  # its own: the other parts stay as they were
    rdma_ports = (
        tuple(
            _rdma_device(files, links, nic, j, 0x30 + j, infiniband=spec.infiniband, rng=rdma_rng)
            for j, nic in enumerate(nics)
        )
        if spec.rdma
        else ()
    )

    mcs: list[str] = []
    dimms: list[str] = []
    controllers = max(1, spec.memory_controllers)
    share, extra = divmod(spec.dimms, controllers)
    per_mc = [share + (m < extra) for m in range(controllers)]
    for mc, count in enumerate(per_mc):
        mc_dir = f"devices/system/edac/mc/mc{mc}"
        mcs.append(mc_dir)
        base = f"{SYS}/{mc_dir}"
        for name in ("ce_count", "ue_count", "ce_noinfo_count", "ue_noinfo_count"):
            files[f"{base}/{name}"] = "0\n"
        files[f"{base}/mc_name"] = "Intel Skx SoC\n"
        files[f"{base}/size_mb"] = f"{count * 65536}\n"
        files[f"{base}/seconds_since_reset"] = f"{rng.randint(3600, 90 * 86400)}\n"
        files[f"{base}/max_location"] = f"memory {count - 1} \n"
        for index in range(count):
            dimm_dir = f"{mc_dir}/dimm{index}"
            dimms.append(dimm_dir)
            d = f"{SYS}/{dimm_dir}"
            files[f"{d}/dimm_ce_count"] = "0\n"
            files[f"{d}/dimm_ue_count"] = "0\n"
            files[f"{d}/dimm_label"] = dimm_label(mc, index) + "\n"
            files[f"{d}/dimm_location"] = f"memory {index} \n"
            files[f"{d}/size"] = "65536\n"
            files[f"{d}/dimm_mem_type"] = "Registered-DDR5\n"
            files[f"{d}/dimm_edac_mode"] = "SECDED\n"
            files[f"{d}/dimm_dev_type"] = "x4\n"

    temp_dir = _hwmon_chip(files, links, TEMP_CHIP, 0, "coretemp")
    temps: list[str] = []
    for t in range(1, spec.temps + 1):
        base = f"{SYS}/{temp_dir}/temp{t}"
        files[f"{base}_input"] = f"{45000 + rng.randint(-3, 3) * 1000}\n"
        files[f"{base}_max"] = f"{TEMP_MAX_MILLI}\n"
        files[f"{base}_crit"] = f"{TEMP_CRIT_MILLI}\n"
        files[f"{base}_crit_alarm"] = "0\n"
        files[f"{base}_label"] = ("Package id 0" if t == 1 else f"Core {t - 2}") + "\n"
        temps.append(f"{temp_dir}/temp{t}_input")

    fan_dir = _hwmon_chip(files, links, FAN_CHIP, 1, "nct6798")
    fans: list[str] = []
    for f in range(1, spec.fans + 1):
        base = f"{SYS}/{fan_dir}/fan{f}"
        files[f"{base}_input"] = f"{rng.randrange(8000, 12000, 10)}\n"
        files[f"{base}_min"] = f"{FAN_MIN_RPM}\n"
        files[f"{base}_alarm"] = "0\n"
        files[f"{base}_label"] = f"FAN{f}\n"
        fans.append(f"{fan_dir}/fan{f}_input")

    disks: list[str] = []
    for n in range(spec.disks):
        serial = f"{rng.randrange(16**8):08X}{n}"
        path = f"{SMART}/nvme{n}.json"
        files[path] = json.dumps(smart_document(n, serial, rng), indent=2) + "\n"
        disks.append(path)

    paths = NodeTreePaths(
        gpus=gpus,
        nics=nics,
        mcs=tuple(mcs),
        dimms=tuple(dimms),
        fans=tuple(fans),
        temps=tuple(temps),
        disks=tuple(disks),
        rdma_ports=rdma_ports,
    )
    return Layout(files=files, links=links, tree=paths)


def write_tree(root: Path, spec: NodeSpec, seed: int) -> NodeTree:
    """Write the tree of ``layout(spec, seed)`` under ``root`` (created if needed); an
    earlier tree there (``sys/``, ``smart/``) is replaced, anything else is kept."""
    plan = layout(spec, seed)
    root.mkdir(parents=True, exist_ok=True)
    for old in (SYS, SMART):
        shutil.rmtree(root / old, ignore_errors=True)
    (root / SMART).mkdir(exist_ok=True)
    made: set[str] = set()
    for rel, text in plan.files.items():
        parent = posixpath.dirname(rel)
        if parent not in made:
            os.makedirs(root / parent, exist_ok=True)
            made.add(parent)
        if isinstance(text, bytes):
            (root / rel).write_bytes(text)
        else:
            (root / rel).write_text(text)
    for rel, target in plan.links.items():
        parent = posixpath.dirname(rel)
        if parent not in made:
            os.makedirs(root / parent, exist_ok=True)
            made.add(parent)
        os.symlink(target, root / rel)
    return NodeTree(root=root, paths=plan.tree)
