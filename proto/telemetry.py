"""TelemetryBatch: one collection cycle of one node, and the readings it carries.

The field names are a contract users script against (``metalguard agent collect
--format json``): extend, never rename.
"""

from __future__ import annotations

from typing import Final

import msgspec

from metalguard.proto.base import Message, NodeIdentity, NonNegInt, Record
from metalguard.proto.iommu import IommuPosture
from metalguard.proto.topology import NodeTopology

NVME_CRITICAL_WARNING_BITS: Final[dict[int, str]] = {
    0: "available spare below threshold",
    1: "temperature above or below threshold",
    2: "reliability degraded",
    3: "media read-only",
    4: "volatile memory backup failed",
    5: "persistent memory region unreliable",
}
"""NVMe SMART/Health log byte 0 (NVMe base spec, Get Log Page 02h)."""


class EdacDimm(Record, frozen=True):
    """One DIMM (or rank) of a memory controller, modern ``dimm*/`` layout."""

    name: str
    label: str = ""
    ce_count: NonNegInt | None = None
    ue_count: NonNegInt | None = None


class EdacChannel(Record, frozen=True):
    """One channel of a legacy ``csrow*/`` entry."""

    channel: NonNegInt
    label: str = ""
    ce_count: NonNegInt | None = None
    ue_count: NonNegInt | None = None


class EdacCsrow(Record, frozen=True):
    """One chip-select row, legacy ``csrow*/`` layout."""

    csrow: NonNegInt
    ce_count: NonNegInt | None = None
    ue_count: NonNegInt | None = None
    channels: tuple[EdacChannel, ...] = ()


class EdacController(Record, frozen=True):
    """One EDAC memory controller ``mc<N>``."""

    mc: NonNegInt
    ce_count: NonNegInt | None = None
    ue_count: NonNegInt | None = None
    ce_noinfo_count: NonNegInt | None = None
    ue_noinfo_count: NonNegInt | None = None
    dimms: tuple[EdacDimm, ...] = ()
    csrows: tuple[EdacCsrow, ...] = ()


class AerCounters(Record, frozen=True):
    """PCIe AER counters by their kernel names (``TOTAL_ERR_*`` included)."""

    correctable: dict[str, NonNegInt] = {}
    fatal: dict[str, NonNegInt] = {}
    nonfatal: dict[str, NonNegInt] = {}


class PcieDevice(Record, frozen=True):
    """One PCI function: identity, link state and AER counters."""

    address: str
    pci_class: str = msgspec.field(default="", name="class")
    vendor: str = ""
    device: str = ""
    current_link_speed_gts: float | None = None
    max_link_speed_gts: float | None = None
    current_link_width: NonNegInt | None = None
    max_link_width: NonNegInt | None = None
    downgraded: bool = False
    retrains: NonNegInt = 0
    """Link state changes (downgrades plus recoveries) seen since the agent started."""
    downgrades: NonNegInt = 0
    recoveries: NonNegInt = 0
    aer: AerCounters | None = None


class Fan(Record, frozen=True):
    """One hwmon fan sensor (``fanN_*``)."""

    sensor: str
    label: str = ""
    rpm: float | None = None
    min_rpm: float | None = None
    alarm: bool | None = None


class Temperature(Record, frozen=True):
    """One hwmon temperature sensor (``tempN_*``), in degrees Celsius."""

    sensor: str
    label: str = ""
    celsius: float | None = None
    crit_celsius: float | None = None
    max_celsius: float | None = None


class HwmonChip(Record, frozen=True):
    """One hwmon chip; ``chip`` is named the way node_exporter names it."""

    chip: str
    name: str = ""
    fans: tuple[Fan, ...] = ()
    temps: tuple[Temperature, ...] = ()


class SmartDevice(Record, frozen=True):
    """One disk's SMART health; fields that do not apply to its protocol are null."""

    device: str
    protocol: str = ""
    model: str = ""
    serial: str = ""
    passed: bool | None = None
    exit_status: NonNegInt | None = None
    temperature_c: float | None = None
    power_on_hours: NonNegInt | None = None
    critical_warning: NonNegInt | None = None
    media_errors: NonNegInt | None = None
    percentage_used: NonNegInt | None = None
    available_spare: NonNegInt | None = None
    num_err_log_entries: NonNegInt | None = None
    unsafe_shutdowns: NonNegInt | None = None
    reallocated_sectors: NonNegInt | None = None
    pending_sectors: NonNegInt | None = None
    offline_uncorrectable: NonNegInt | None = None
    reported_uncorrectable: NonNegInt | None = None
    grown_defects: NonNegInt | None = None


class BmcSensor(Record, frozen=True):
    """One sensor read out of band from the BMC."""

    name: str
    kind: str
    """fan | temperature | voltage | current | power | psu | other"""
    value: float | None = None
    unit: str = ""
    status: str = ""
    """ok | warning | critical | absent | unknown (normalised from the source)."""
    lower_critical: float | None = None
    upper_critical: float | None = None


class BmcReading(Record, frozen=True):
    """What one BMC source (snmp, redfish, ipmi) answered in this cycle."""

    source: str
    reachable: bool
    node: str = ""
    """The node the BMC belongs to, ``REGION.CLUSTER.NODE`` (its ``[[bmc]]`` target)."""
    power_state: str = ""
    health: str = ""
    sensors: tuple[BmcSensor, ...] = ()
    message: str = ""


class NvLinkErrors(Record, frozen=True):
    """One NVLink's data-link error counters, as NVML counts them."""

    link: NonNegInt
    replay: NonNegInt | None = None
    recovery: NonNegInt | None = None
    crc_flit: NonNegInt | None = None
    crc_data: NonNegInt | None = None


class GpuDevice(Record, frozen=True):
    """One accelerator's health as the driver reports it."""

    index: NonNegInt
    uuid: str = ""
    name: str = ""
    pci_address: str = ""
    temperature_c: float | None = None
    power_w: float | None = None
    ecc_corrected: NonNegInt | None = None
    ecc_uncorrected: NonNegInt | None = None
    retired_pages: NonNegInt | None = None
    xid_errors: tuple[int, ...] = ()
    ecc_sbe_volatile: NonNegInt | None = None
    """Single-bit (corrected) ECC errors since the driver loaded."""
    ecc_dbe_volatile: NonNegInt | None = None
    """Double-bit (uncorrected) ECC errors since the driver loaded."""
    ecc_sbe_aggregate: NonNegInt | None = None
    """Single-bit ECC errors over the board's life (inforom)."""
    ecc_dbe_aggregate: NonNegInt | None = None
    retired_pages_sbe: NonNegInt | None = None
    retired_pages_dbe: NonNegInt | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_correctable: NonNegInt | None = None
    remapped_rows_uncorrectable: NonNegInt | None = None
    row_remap_pending: bool | None = None
    """A row remap waits for the next GPU reset."""
    row_remap_failure: bool | None = None
    """A row could not be remapped: the GPU needs service."""
    pcie_replay_count: NonNegInt | None = None
    pcie_link_gen: NonNegInt | None = None
    pcie_link_gen_max: NonNegInt | None = None
    pcie_link_width: NonNegInt | None = None
    pcie_link_width_max: NonNegInt | None = None
    pcie_downgraded: bool = False
    """Narrower than its max width, or below its max generation while not idle."""
    nvlinks: tuple[NvLinkErrors, ...] = ()
    throttle_reasons: tuple[str, ...] = ()
    """Active clock throttle reasons (``sw_power_cap``, ``hw_thermal_slowdown``, ...)."""


class TcClassStats(Record, frozen=True):
    """One tc class of an interface: counters since the class was created."""

    classid: str
    """``major:minor`` in hex, as tc prints it (``1:10``)."""
    kind: str = ""
    """The class's qdisc kind (``htb``)."""
    name: str = ""
    """The profile's traffic class it serves, when the agent's QoS reconciler made it."""
    lossless: bool = False
    """It serves a PFC (lossless) priority of the applied profile: drops there are bad."""
    bytes: NonNegInt = 0
    packets: NonNegInt = 0
    drops: NonNegInt = 0
    overlimits: NonNegInt = 0
    ecn_marks: NonNegInt | None = None
    """Packets ECN-marked by the class's leaf qdisc (RED, fq_codel); null when none marks."""


class NetInterface(Record, frozen=True):
    """One network interface's health counters (``/sys/class/net/<if>/statistics``, tc
    class statistics, PFC pause counters from ``ethtool -S``); null when unreadable."""

    name: str
    rx_bytes: NonNegInt | None = None
    tx_bytes: NonNegInt | None = None
    rx_packets: NonNegInt | None = None
    tx_packets: NonNegInt | None = None
    rx_dropped: NonNegInt | None = None
    tx_dropped: NonNegInt | None = None
    rx_errors: NonNegInt | None = None
    tx_errors: NonNegInt | None = None
    rx_pause: NonNegInt | None = None
    """Pause frames received (all priorities); null when the NIC exposes no counter."""
    tx_pause: NonNegInt | None = None
    """Pause frames sent (all priorities); null when the NIC exposes no counter."""
    pause: dict[str, NonNegInt] = {}
    """The NIC's pause counters by their ethtool names (``rx_prio3_pause``, ...)."""
    tc_classes: tuple[TcClassStats, ...] = ()


class RdmaPort(Record, frozen=True):
    """One port of an RDMA device (``/sys/class/infiniband/<device>/ports/<port>``).

    Counters keep their kernel file names and raw values as read (InfiniBand data
    counters count 4-octet words: ``rx_bytes``/``tx_bytes`` are derived from them).  A
    counter file that holds no number ("N/A (no PMA)") is absent here and an entry in the
    batch's ``errors``.
    """

    device: str
    port: NonNegInt
    state: str = ""
    """The logical state by name (``ACTIVE``, ``DOWN``, ``INIT``, ``ARMED``, ...)."""
    state_id: NonNegInt | None = None
    """The number before the name in the kernel's ``4: ACTIVE``."""
    phys_state: str = ""
    """The physical state by name (``LinkUp``, ``Polling``, ``Disabled``, ...)."""
    phys_state_id: NonNegInt | None = None
    rate_gbps: float | None = None
    """From ``200 Gb/sec (4X HDR)``."""
    link_layer: str = ""
    """``InfiniBand``, or ``Ethernet`` for RoCE."""
    netdev: str = ""
    """The network interface the port is bound to, when the tree shows it."""
    board_id: str = ""
    fw_ver: str = ""
    hca_type: str = ""
    counters: dict[str, NonNegInt] = {}
    """``ports/<port>/counters/*`` (PMA port counters)."""
    counters_ext: dict[str, NonNegInt] = {}
    """``ports/<port>/counters_ext/*`` (older kernels' 64-bit counters)."""
    hw_counters: dict[str, NonNegInt] = {}
    """``ports/<port>/hw_counters/*`` (vendor counters: RoCE retransmission, DCQCN, ...)."""
    device_hw_counters: dict[str, NonNegInt] = {}
    """``<device>/hw_counters/*`` (device-level vendor counters), repeated on each port."""
    saturated: tuple[str, ...] = ()
    """Counters stopped at their width's maximum (a PMA counter does not wrap): they are
    not rates until the counter is reset."""
    rx_bytes: NonNegInt | None = None
    """``port_rcv_data`` x 4 (the 64-bit ``counters_ext/port_rcv_data_64`` x 4 where
    there is one: kernels before 4.5)."""
    tx_bytes: NonNegInt | None = None
    """``port_xmit_data`` x 4 (``counters_ext/port_xmit_data_64`` x 4 where there is one)."""


class CollectorRun(Record, frozen=True):
    """How one collector run went: timed and guarded."""

    collector: str
    duration_s: float
    success: bool


class CollectorError(Record, frozen=True):
    """A failure of one collector (or one of its files); the other readings stand."""

    collector: str
    path: str = ""
    message: str = ""


class QosInterfaceStatus(Record, frozen=True):
    """The agent's QoS reconciler's last verdict on one interface (docs/qos.md)."""

    interface: str
    version: NonNegInt
    """The profile version it applied (or tried to)."""
    status: str
    """applied | partial | unsupported | failed | drift | degraded (applied, but the RDMA
    ports' DCQCN counters show congestion control not working)"""
    reasons: tuple[str, ...] = ()
    """Why it is not ``applied``: unsupported or failed parts, differences found, the
    DCQCN counter findings (each naming its counters)."""


class DatasetCache(Record, frozen=True):
    """One node-local dataset cache (``metalguard cache mount``), as its process last wrote
    it to ``<cache_dir>/stats.json`` (docs/cache.md).  Counters count since that process
    started; the agent reads the file, it never talks to the cache process."""

    dataset: str
    """The dataset's name (a job's ``dataset = "NAME"``)."""
    source: str = ""
    """Where misses are read from: a path or an fsspec URL (credentials never included)."""
    mountpoint: str = ""
    """Where the FUSE mount presents the dataset ("" when only the fsspec path is used)."""
    cache_dir: str = ""
    pid: NonNegInt = 0
    ts: float = 0.0
    """Wall-clock time (Unix seconds) the cache process wrote these figures."""
    policy: str = ""
    """The policy in force: ``lru``, ``pin``, ... (``auto`` resolves to one of them)."""
    policy_reason: str = ""
    """Why that policy: the detected pattern and the evidence (``auto``), or "configured"."""
    pattern: str = ""
    """The detected access pattern: ``sequential``, ``shuffled``, ``skewed``, or "" (not
    enough reads yet)."""
    max_bytes: NonNegInt = 0
    used_bytes: NonNegInt = 0
    """Bytes of complete cached files on the cache disk (never above ``max_bytes``)."""
    cached_files: NonNegInt = 0
    dataset_bytes: NonNegInt = 0
    """Bytes of the dataset's files seen so far (listed or read): 0 when unknown."""
    hits: NonNegInt = 0
    misses: NonNegInt = 0
    bytes_from_cache: NonNegInt = 0
    bytes_from_source: NonNegInt = 0
    evictions: NonNegInt = 0
    prefetched: NonNegInt = 0
    """Files fetched ahead of a sequential reader."""
    passthrough_reads: NonNegInt = 0
    """Reads served straight from the source because the cache could not take them (full
    or failing cache disk, a file larger than the cache): each one also a warning."""
    warnings: NonNegInt = 0
    last_warning: str = ""


class KmsgCounts(Record, frozen=True):
    """The kernel log monitor's counts since the agent started (docs/kmsg.md)."""

    records: NonNegInt = 0
    """Kernel records read."""
    findings: dict[str, NonNegInt] = {}
    """Records classified, by kind (``hung_task``, ``gpu_xid``, ...)."""
    critical: dict[str, NonNegInt] = {}
    """Of those, the ones of severity critical, by kind (a fatal AER or SXid, an
    uncorrected memory error: the controller keeps such a node FAILING for its window)."""
    lost: NonNegInt = 0
    """Records the ring buffer overwrote before they were read."""
    suppressed: NonNegInt = 0
    """Records the kernel itself dropped ("N callbacks suppressed")."""
    user_records: NonNegInt = 0
    """Records written from user space (facility != 0), ignored unless trusted."""
    ignored: NonNegInt = 0
    """Records a rule marks harmless (a known flood)."""
    malformed: NonNegInt = 0


class TelemetryBatch(Message, frozen=True, tag="telemetry_batch"):
    """One collection cycle of one node (subject ``<p>.tel.<region>.<cluster>.<node>``)."""

    node: NodeIdentity
    seq: NonNegInt
    ts: float
    """Wall-clock time (Unix seconds) at which the cycle finished."""
    interval_s: float = 0.0
    """The agent's nominal collection interval; freshness is judged against it."""
    started_ts: float | None = None
    edac: tuple[EdacController, ...] = ()
    pcie: tuple[PcieDevice, ...] = ()
    hwmon: tuple[HwmonChip, ...] = ()
    smart: tuple[SmartDevice, ...] = ()
    bmc: tuple[BmcReading, ...] = ()
    gpu: tuple[GpuDevice, ...] = ()
    net: tuple[NetInterface, ...] = ()
    collectors: tuple[CollectorRun, ...] = ()
    errors: tuple[CollectorError, ...] = ()
    spool_dropped: NonNegInt = 0
    """Batches or events dropped from the full outage spool since the last batch."""
    qos: tuple[QosInterfaceStatus, ...] = ()
    """The flow-control profile's state per interface, when the agent reconciles one."""
    out_of_band: bool = False
    """Read from the node's BMC by a bmc-proxy, not sent by the node itself: ``bmc``
    holds the reading, the in-band fields are empty, ``seq`` is the proxy's own series
    (docs/bmc.md).  Not a sign of life of the node's OS."""
    topology: NodeTopology | None = None
    """The node's place and capacity from its ``[node]`` config (docs/scheduler.md);
    ``None`` when it configures none."""
    rdma: tuple[RdmaPort, ...] = ()
    """Every port of every RDMA (InfiniBand or RoCE) device (docs/protocol.md)."""
    cache: tuple[DatasetCache, ...] = ()
    """Every dataset cache configured on the node (``[[cache.datasets]]``, docs/cache.md)."""
    kmsg: KmsgCounts | None = None
    """The kernel log monitor's counts (None: it does not run on the node)."""
    iommu: IommuPosture | None = None
    """The node's DMA isolation posture (the ``iommu`` collector; None: not collected;
    docs/security.md "DMA isolation")."""
