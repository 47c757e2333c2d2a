"""Hypothesis strategies for random telemetry batches: ``batches`` (memory, PCIe, hwmon,
disks, BMC and collector runs) and ``node_batches`` (those with network, GPU and RDMA
readings and a topology too), shared by the scorer's property tests and the codec's."""

from __future__ import annotations

import msgspec
from hypothesis import strategies as st

from metalguard.proto.telemetry import (
    AerCounters,
    BmcReading,
    BmcSensor,
    CollectorRun,
    EdacController,
    EdacDimm,
    Fan,
    GpuDevice,
    HwmonChip,
    NetInterface,
    NvLinkErrors,
    PcieDevice,
    RdmaPort,
    SmartDevice,
    TcClassStats,
    TelemetryBatch,
    Temperature,
)
from metalguard.proto.topology import NodeTopology
from tests.support.scoring_helpers import batch

small = st.integers(0, 3)
maybe_small = st.none() | small
temps_c = st.none() | st.sampled_from([0.0, 40.0, 79.0, 80.0, 94.0, 95.0, 99.0, 100.0, 120.0])

dimms = st.builds(
    EdacDimm, name=st.sampled_from(["dimm0", "dimm1"]), ce_count=maybe_small, ue_count=maybe_small
)
controllers = st.builds(
    EdacController,
    mc=st.integers(0, 3),
    ce_count=maybe_small,
    ue_count=maybe_small,
    ue_noinfo_count=maybe_small,
    dimms=st.lists(dimms, max_size=2).map(tuple),
)
aer = st.builds(
    AerCounters,
    correctable=st.dictionaries(st.sampled_from(["RxErr", "TOTAL_ERR_COR"]), small),
    fatal=st.dictionaries(st.sampled_from(["DLP", "TOTAL_ERR_FATAL"]), small),
    nonfatal=st.dictionaries(st.sampled_from(["CmpltTO", "TOTAL_ERR_NONFATAL"]), small),
)
devices = st.builds(
    PcieDevice,
    address=st.sampled_from(["0000:41:00.0", "0000:42:00.0"]),
    pci_class=st.sampled_from(["0x020000", "0x030200", "0x060400", "0x010802"]),
    current_link_speed_gts=st.sampled_from([2.5, 16.0, 32.0]),
    max_link_speed_gts=st.just(32.0),
    current_link_width=st.sampled_from([4, 8, 16]),
    max_link_width=st.just(16),
    retrains=small,
    aer=st.none() | aer,
)
fans = st.builds(
    Fan,
    sensor=st.sampled_from(["fan1", "fan2", "fan3"]),
    rpm=st.none() | st.sampled_from([0.0, 300.0, 900.0, 1000.0, 2000.0]),
    min_rpm=st.none() | st.sampled_from([0.0, 950.0]),
    alarm=st.none() | st.booleans(),
)
temps = st.builds(
    Temperature,
    sensor=st.sampled_from(["temp1", "temp2"]),
    celsius=temps_c,
    crit_celsius=temps_c,
    max_celsius=temps_c,
)
chips = st.builds(
    HwmonChip,
    chip=st.sampled_from(["nct6779", "coretemp"]),
    fans=st.lists(fans, max_size=4).map(tuple),
    temps=st.lists(temps, max_size=2).map(tuple),
)
disks = st.builds(
    SmartDevice,
    device=st.sampled_from(["/dev/nvme0", "/dev/sda"]),
    passed=st.none() | st.booleans(),
    critical_warning=maybe_small,
    media_errors=maybe_small,
    percentage_used=st.none() | st.sampled_from([0, 80, 100, 120]),
    available_spare=st.none() | st.sampled_from([0, 20, 100]),
    reallocated_sectors=st.none() | st.sampled_from([0, 10, 500]),
    pending_sectors=maybe_small,
    grown_defects=st.none() | st.sampled_from([0, 100]),
)
sensors = st.builds(
    BmcSensor,
    name=st.just("FAN1"),
    kind=st.just("fan"),
    value=st.none() | st.just(300.0),
    status=st.sampled_from(["ok", "warning", "critical", "unknown"]),
)
bmcs = st.builds(
    BmcReading,
    source=st.sampled_from(["redfish", "ipmi"]),
    reachable=st.booleans(),
    health=st.sampled_from(["OK", "Warning", "Critical", ""]),
    sensors=st.lists(sensors, max_size=2).map(tuple),
)
runs = st.builds(
    CollectorRun,
    collector=st.sampled_from(["edac", "smart"]),
    duration_s=st.just(0.1),
    success=st.booleans(),
)


@st.composite
def batches(draw: st.DrawFn, offset_s: float = 0.0) -> TelemetryBatch:
    """A batch ``offset_s`` after T0 with random memory, PCIe, hwmon, disk, BMC and
    collector readings."""
    return batch(
        offset_s,
        edac=tuple(draw(st.lists(controllers, max_size=2))),
        pcie=tuple(draw(st.lists(devices, max_size=2))),
        hwmon=tuple(draw(st.lists(chips, max_size=2))),
        smart=tuple(draw(st.lists(disks, max_size=2))),
        bmc=tuple(draw(st.lists(bmcs, max_size=1))),
        collectors=tuple(draw(st.lists(runs, max_size=2))),
    )


counts = st.none() | st.integers(0, 500)
tc_classes = st.builds(
    TcClassStats,
    classid=st.sampled_from(["1:10", "1:20"]),
    lossless=st.booleans(),
    drops=st.integers(0, 500),
)
interfaces = st.builds(
    NetInterface,
    name=st.sampled_from(["eth0", "ib0"]),
    rx_dropped=counts,
    tx_errors=counts,
    rx_pause=counts,
    tc_classes=st.lists(tc_classes, max_size=2).map(tuple),
)


gpus = st.builds(
    GpuDevice,
    index=st.sampled_from([0, 1]),
    ecc_sbe_volatile=counts,
    ecc_dbe_volatile=st.none() | st.integers(0, 2),
    pcie_replay_count=counts,
    row_remap_failure=st.none() | st.booleans(),
    pcie_downgraded=st.booleans(),
    nvlinks=st.lists(st.builds(NvLinkErrors, link=st.just(0), crc_flit=counts), max_size=1).map(
        tuple
    ),
)


pma_names = st.sampled_from(["link_downed", "symbol_error", "port_rcv_errors"])
hw_names = st.sampled_from(["out_of_sequence", "local_ack_timeout_err"])
rdma_ports = st.builds(
    RdmaPort,
    device=st.sampled_from(["mlx5_0", "mlx5_1"]),
    port=st.just(1),
    state=st.sampled_from(["ACTIVE", "ACTIVE", "DOWN", "INIT", ""]),
    phys_state=st.sampled_from(["LinkUp", "LinkUp", "Polling", ""]),
    rate_gbps=st.none() | st.sampled_from([100.0, 200.0]),
    counters=st.dictionaries(pma_names, st.integers(0, 3) | st.just(65535)),
    hw_counters=st.dictionaries(hw_names, st.integers(0, 500)),
    device_hw_counters=st.dictionaries(hw_names, small),
    saturated=st.lists(pma_names, max_size=1).map(tuple),
)
topologies = st.none() | st.builds(
    NodeTopology,
    rdma_ports=st.lists(st.sampled_from(["mlx5_0/1", "mlx5_1/1"]), max_size=2).map(tuple),
    rdma_rate_gbps=st.sampled_from([0.0, 200.0]),
)
rdma_runs = st.lists(
    st.builds(
        CollectorRun, collector=st.just("rdma"), duration_s=st.just(0.1), success=st.booleans()
    ),
    max_size=1,
).map(tuple)


@st.composite
def node_batches(draw: st.DrawFn) -> TelemetryBatch:
    """The scorer properties' random batches, with network, GPU and RDMA readings, the
    rdma collector's run and a topology too."""
    nets = tuple(draw(st.lists(interfaces, max_size=2)))
    gpu = tuple(draw(st.lists(gpus, max_size=2)))
    base = draw(batches())
    return msgspec.structs.replace(
        base,
        net=nets,
        gpu=gpu,
        rdma=tuple(draw(st.lists(rdma_ports, max_size=2))),
        topology=draw(topologies),
        collectors=(*base.collectors, *draw(rdma_runs)),
    )
