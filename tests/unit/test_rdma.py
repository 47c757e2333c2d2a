"""The ``rdma`` collector: node_exporter parity on its own fixture tree (every sample of
expected/infiniband.prom), the kernel's text forms, saturated counters, files without a
number, RoCE with vendor counters, the bound interface, and devices that go away."""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from metalguard.agent.collectors.base import REGISTRY, Collected, CollectorSettings, run_guarded
from metalguard.agent.collectors.rdma import RdmaCollector
from metalguard.agent.collectors.rdma_parse import (
    COUNTER_BITS,
    DeviceFiles,
    PortFiles,
    choose_netdev,
    data_bytes,
    parse_counter,
    parse_port,
    parse_rate,
    parse_state,
    saturated,
)
from metalguard.agent.sysfs import OsCalls, SysfsReader
from metalguard.proto.base import NodeIdentity
from metalguard.proto.codec import decode, encode
from metalguard.proto.telemetry import RdmaPort, TelemetryBatch
from tests.support.faultyos import FaultyOs
from tests.support.promtext import NODE_EXPORTER_SYS, Labels, load_expected
from tests.support.rdma_trees import ROCE, Port, write_device, write_port

PREFIX = "node_infiniband_"

COUNTERS: dict[str, tuple[str, str, int]] = {
    # node_exporter metric: (folder, kernel file, node_exporter's factor) — from
    # collector/infiniband_linux.go and procfs sysfs/class_infiniband.go
    "legacy_multicast_packets_received_total": ("counters_ext", "port_multicast_rcv_packets", 1),
    "legacy_multicast_packets_transmitted_total": (
        "counters_ext", "port_multicast_xmit_packets", 1,
    ),
    "legacy_data_received_bytes_total": ("counters_ext", "port_rcv_data_64", 4),
    "legacy_packets_received_total": ("counters_ext", "port_rcv_packets_64", 1),
    "legacy_unicast_packets_received_total": ("counters_ext", "port_unicast_rcv_packets", 1),
    "legacy_unicast_packets_transmitted_total": ("counters_ext", "port_unicast_xmit_packets", 1),
    "legacy_data_transmitted_bytes_total": ("counters_ext", "port_xmit_data_64", 4),
    "legacy_packets_transmitted_total": ("counters_ext", "port_xmit_packets_64", 1),
    "excessive_buffer_overrun_errors_total": ("counters", "excessive_buffer_overrun_errors", 1),
    "link_downed_total": ("counters", "link_downed", 1),
    "link_error_recovery_total": ("counters", "link_error_recovery", 1),
    "local_link_integrity_errors_total": ("counters", "local_link_integrity_errors", 1),
    "multicast_packets_received_total": ("counters", "multicast_rcv_packets", 1),
    "multicast_packets_transmitted_total": ("counters", "multicast_xmit_packets", 1),
    "port_constraint_errors_received_total": ("counters", "port_rcv_constraint_errors", 1),
    "port_constraint_errors_transmitted_total": ("counters", "port_xmit_constraint_errors", 1),
    "port_data_received_bytes_total": ("counters", "port_rcv_data", 4),
    "port_data_transmitted_bytes_total": ("counters", "port_xmit_data", 4),
    "port_discards_received_total": ("counters", "port_rcv_discards", 1),
    "port_discards_transmitted_total": ("counters", "port_xmit_discards", 1),
    "port_errors_received_total": ("counters", "port_rcv_errors", 1),
    "port_packets_received_total": ("counters", "port_rcv_packets", 1),
    "port_packets_transmitted_total": ("counters", "port_xmit_packets", 1),
    "port_transmit_wait_total": ("counters", "port_xmit_wait", 1),
    "unicast_packets_received_total": ("counters", "unicast_rcv_packets", 1),
    "unicast_packets_transmitted_total": ("counters", "unicast_xmit_packets", 1),
    "port_receive_remote_physical_errors_total": (
        "counters", "port_rcv_remote_physical_errors", 1,
    ),
    "port_receive_switch_relay_errors_total": ("counters", "port_rcv_switch_relay_errors", 1),
    "symbol_error_total": ("counters", "symbol_error", 1),
    "vl15_dropped_total": ("counters", "VL15_dropped", 1),
}  # fmt: skip
"""Every port counter node_exporter exports from counters/ and counters_ext/."""

GAUGES: dict[str, Callable[[RdmaPort], float | None]] = {
    "state_id": lambda p: p.state_id,
    "physical_state_id": lambda p: p.phys_state_id,
    # procfs: float32(Gb/s) * 125000000 as uint64 bytes per second
    "rate_bytes_per_second": lambda p: None if p.rate_gbps is None else p.rate_gbps * 125e6,
}

Samples = dict[str, dict[Labels, float]]


def _ports(result: Collected) -> list[RdmaPort]:
    assert all(isinstance(p, RdmaPort) for p in result.items)
    return [p for p in result.items if isinstance(p, RdmaPort)]


def _by_key(result: Collected) -> dict[tuple[str, int], RdmaPort]:
    return {(p.device, p.port): p for p in _ports(result)}


async def _fixture() -> Collected:
    return await RdmaCollector(CollectorSettings(sysfs=NODE_EXPORTER_SYS)).collect()


def node_exporter_view(ports: list[RdmaPort]) -> Samples:
    """The samples node_exporter's infiniband collector would print for these readings."""
    out: Samples = {}

    def put(metric: str, labels: dict[str, str], value: float) -> None:
        out.setdefault(PREFIX + metric, {})[frozenset(labels.items())] = value

    for port in ports:
        info = {"device": port.device, "board_id": port.board_id}
        info |= {"firmware_version": port.fw_ver, "hca_type": port.hca_type}
        put("info", info, 1.0)
        labels = {"device": port.device, "port": str(port.port)}
        for metric, read in GAUGES.items():
            value = read(port)
            if value is not None:
                put(metric, labels, float(value))
        for metric, (folder, file, factor) in COUNTERS.items():
            counter = getattr(port, folder).get(file)
            if counter is not None:
                put(metric, labels, float(counter * factor))
    return out


async def test_fixture_reproduces_every_sample_of_node_exporter() -> None:
    expected = load_expected("infiniband")
    ours = node_exporter_view(_ports(await _fixture()))
    # Every metric of the file is one our table maps (none left unchecked) ...
    mapped = {PREFIX + m for m in (*COUNTERS, *GAUGES, "info")}
    assert set(expected) <= mapped
    # ... and metric by metric, label set by label set, value by value, both ways.
    for metric in sorted(mapped):
        assert ours.get(metric, {}) == expected.get(metric, {}), metric


async def test_fixture_fields_names_and_derived_bytes() -> None:
    result = await _fixture()
    ports = _by_key(result)
    assert list(ports) == [("i40iw0", 1), ("mlx4_0", 1), ("mlx4_0", 2)]
    one = ports["mlx4_0", 1]
    assert (one.state, one.state_id, one.phys_state, one.phys_state_id) == (
        "ACTIVE", 4, "LinkUp", 5,
    )  # fmt: skip
    assert (one.rate_gbps, one.link_layer, one.netdev) == (40.0, "InfiniBand", "")
    assert (one.board_id, one.fw_ver, one.hca_type) == ("SM_1141000001000", "2.31.5050", "MT4099")
    assert one.counters["port_rcv_data"] == 4631917  # raw words, as read
    assert one.rx_bytes == 4631917 * 4 == 18527668
    assert one.tx_bytes == 3733440 * 4
    assert one.saturated == ("port_xmit_wait",)  # 4294967295: a 32-bit counter at its max
    # port 2's counters/ data counters read 0 but counters_ext holds the 64-bit ones
    two = ports["mlx4_0", 2]
    assert two.counters["port_rcv_data"] == 0
    assert two.rx_bytes == 4631917 * 4
    assert two.saturated == ()
    assert (one.hw_counters, one.device_hw_counters) == ({}, {})


async def test_fixture_no_pma_files_are_errors_naming_each_file() -> None:
    result = await _fixture()
    i40iw = _by_key(result)["i40iw0", 1]
    assert i40iw.counters == {}  # never a number
    assert (i40iw.rx_bytes, i40iw.tx_bytes) == (None, None)
    assert (i40iw.state, i40iw.rate_gbps) == ("ACTIVE", 10.0)  # the rest stands
    counters = NODE_EXPORTER_SYS / "class/infiniband/i40iw0/ports/1/counters"
    assert {e.path for e in result.errors} == {str(p) for p in counters.iterdir()}
    assert len(result.errors) == 17
    assert {e.message for e in result.errors} == {"not a counter: 'N/A (no PMA)'"}
    assert {e.collector for e in result.errors} == {"rdma"}


async def test_registered_enabled_by_default_and_cheap_without_rdma(tmp_path: Path) -> None:
    from metalguard.agent.collectors import load_builtin

    load_builtin()
    registration = REGISTRY["rdma"]
    assert (registration.default_interval_s, registration.enabled_by_default) == (5, True)
    collector = registration.factory(CollectorSettings(sysfs=tmp_path))
    assert (collector.name, collector.field) == ("rdma", "rdma")
    result, run = await run_guarded(collector)
    assert result == Collected(field="rdma")  # no class/infiniband: no ports, no error
    assert run.success
    (tmp_path / "class" / "infiniband").mkdir(parents=True)
    assert await collector.collect() == Collected(field="rdma")


# --- the kernel's text forms (pure) ---------------------------------------------------


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("4: ACTIVE\n", (4, "ACTIVE")),
        ("1: DOWN", (1, "DOWN")),
        ("5: ACTIVE_DEFER\n", (5, "ACTIVE_DEFER")),
        ("5: LinkUp\n", (5, "LinkUp")),
        ("7: Phy Test\n", (7, "Phy Test")),
        ("3:Disabled", (3, "Disabled")),
    ],
)
def test_parse_state(text: str, parsed: tuple[int, str]) -> None:
    assert parse_state(text) == parsed


@pytest.mark.parametrize("text", ["ACTIVE", "x: ACTIVE", "4:", "4: ", "-1: DOWN", "garbage"])
def test_parse_state_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="not a port state"):
        parse_state(text)


@pytest.mark.parametrize(
    ("text", "gbps"),
    [
        ("200 Gb/sec (4X HDR)\n", 200.0),
        ("2.5 Gb/sec (1X SDR)\n", 2.5),
        ("10 Gb/sec (4X)\n", 10.0),
        ("400 Gb/sec (4X NDR)", 400.0),
        ("", None),
        ("\n", None),
    ],
)
def test_parse_rate(text: str, gbps: float | None) -> None:
    assert parse_rate(text) == gbps


@pytest.mark.parametrize("text", ["fast", "200 GB/s", "Gb/sec 200", "200"])
def test_parse_rate_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="not a rate"):
        parse_rate(text)


def test_parse_counter() -> None:
    assert parse_counter("42\n") == 42
    assert parse_counter("18446744073709551615\n") == 2**64 - 1
    assert parse_counter("") is None
    for bad in ("N/A (no PMA)\n", "-1", "0x10", "1e3", "18446744073709551616"):
        with pytest.raises(ValueError, match="not a counter"):
            parse_counter(bad)


def test_saturation_at_each_width_and_only_there() -> None:
    assert (COUNTER_BITS["symbol_error"], COUNTER_BITS["port_xmit_wait"]) == (16, 32)
    at_max = {
        "symbol_error": 65535,
        "port_rcv_errors": 65535,
        "link_downed": 255,
        "local_link_integrity_errors": 15,
        "port_xmit_wait": 4294967295,
        "port_xmit_data": 4294967295,
    }
    below = {name: value - 1 for name, value in at_max.items()}
    above = {"port_xmit_data": 2**32, "symbol_error": 65536}  # wider: not the 16/32-bit one
    assert saturated(at_max, {}) == tuple(sorted(at_max))
    assert saturated(below, {}) == ()
    assert saturated(above, {}) == ()
    assert saturated({"vendor_thing": 65535}, {}) == ()  # no width known: never saturated
    assert saturated({}, {"port_rcv_data_64": 2**64 - 1}) == ("port_rcv_data_64",)


def test_data_bytes_prefers_the_64_bit_counter_and_fits_the_wire() -> None:
    assert data_bytes({"port_rcv_data": 10}, {}, "port_rcv_data", "port_rcv_data_64") == 40
    assert data_bytes(
        {"port_rcv_data": 2**32 - 1}, {"port_rcv_data_64": 2**33}, "port_rcv_data",
        "port_rcv_data_64",
    ) == 2**35  # fmt: skip
    assert data_bytes({}, {"port_rcv_data_64": 5}, "port_rcv_data", "port_rcv_data_64") == 20
    assert data_bytes({}, {}, "port_rcv_data", "port_rcv_data_64") is None
    assert data_bytes({"port_rcv_data": 2**63}, {}, "port_rcv_data", "port_rcv_data_64") is None


def test_parse_port_keeps_going_past_bad_files() -> None:
    device = DeviceFiles(name="mlx5_0", fw_ver="28.39.1002\n", hw_counters={"x": "junk"})
    files = PortFiles(
        port=1,
        state="garbage\n",
        phys_state="5: LinkUp\n",
        rate="fast\n",
        counters={"symbol_error": "65535\n", "link_downed": "N/A (no PMA)\n", "empty": ""},
    )
    port, issues = parse_port(device, files)
    assert (port.state, port.state_id, port.phys_state, port.rate_gbps) == (
        "",
        None,
        "LinkUp",
        None,
    )
    assert port.counters == {"symbol_error": 65535}
    assert port.saturated == ("symbol_error",)
    assert port.fw_ver == "28.39.1002"
    assert issues == [
        ("ports/1/state", "not a port state: 'garbage'"),
        ("ports/1/rate", "not a rate: 'fast'"),
        ("ports/1/counters/link_downed", "not a counter: 'N/A (no PMA)'"),
        ("hw_counters/x", "not a counter: 'junk'"),
    ]
    # device counters parsed once by the caller: no issue repeated per port
    assert parse_port(device, PortFiles(port=2), {})[1] == []


def test_choose_netdev() -> None:
    assert choose_netdev(1, "ens1f0np0", {"ib0": 0}) == "ens1f0np0"  # the GID's wins
    assert choose_netdev(2, "", {"ib0": 0, "ib1": 1}) == "ib1"  # by dev_port
    assert choose_netdev(1, "", {"ib0": None}) == "ib0"  # the only one
    assert choose_netdev(2, "", {"ib0": 0}) == ""  # the only one says it is port 1's
    assert choose_netdev(1, "", {"eth0": None, "eth1": None}) == ""  # no guessing
    assert choose_netdev(1, "", {"pf0": 0, "pf0vf0": 0}) == ""
    assert choose_netdev(1, "", {}) == ""


def test_ports_travel_in_the_batch() -> None:
    port, _ = parse_port(DeviceFiles(name="mlx5_0"), PortFiles(port=1, counters={"a": "1"}))
    node = NodeIdentity(region="r1", cluster="c1", node="n1")
    batch = TelemetryBatch(node=node, seq=1, ts=1.0, rdma=(port,))
    assert decode(encode(batch), TelemetryBatch).rdma == (port,)
    doc = msgspec.json.decode(msgspec.json.encode(batch))
    assert {"device", "port", "state", "phys_state", "rate_gbps", "link_layer", "counters",
            "hw_counters"} <= doc["rdma"][0].keys()  # fmt: skip


# --- fake trees ------------------------------------------------------------------------


async def test_roce_port_with_vendor_counters_and_its_netdev(tmp_path: Path) -> None:
    write_device(
        tmp_path,
        "mlx5_0",
        {1: ROCE},
        hw_counters={"rx_icrc_encapsulated": "2\n", "lifespan": "10\n"},
        netdevs={"ens1f0np0": 0},
    )
    result = await RdmaCollector(CollectorSettings(sysfs=tmp_path)).collect()
    assert result.errors == ()
    [port] = _ports(result)
    assert (port.device, port.port, port.link_layer, port.netdev) == (
        "mlx5_0", 1, "Ethernet", "ens1f0np0",
    )  # fmt: skip
    assert port.rate_gbps == 100.0
    assert port.hw_counters == {
        "local_ack_timeout_err": 0,
        "lifespan": 10,
        "np_cnp_sent": 118,
        "np_ecn_marked_roce_packets": 120,
        "out_of_sequence": 3,
        "packet_seq_err": 1,
        "rp_cnp_handled": 40,
    }
    assert port.device_hw_counters == {"lifespan": 10, "rx_icrc_encapsulated": 2}
    assert (port.rx_bytes, port.tx_bytes) == (4000, 8000)
    assert (port.board_id, port.fw_ver, port.hca_type) == ("MT_0000000834", "28.39.1002", "MT4129")


async def test_ib_ports_find_their_ipoib_interface_by_dev_port(tmp_path: Path) -> None:
    write_device(
        tmp_path, "mlx4_0", {1: Port(), 2: Port(state="1: DOWN\n", phys_state="3: Disabled\n")},
        netdevs={"ib0": 0, "ib1": 1},
    )  # fmt: skip
    ports = _by_key(await RdmaCollector(CollectorSettings(sysfs=tmp_path)).collect())
    assert ports["mlx4_0", 1].netdev == "ib0"
    down = ports["mlx4_0", 2]
    assert (down.netdev, down.state, down.state_id, down.phys_state, down.phys_state_id) == (
        "ib1", "DOWN", 1, "Disabled", 3,
    )  # fmt: skip


async def test_broken_state_file_is_an_error_and_the_port_still_stands(tmp_path: Path) -> None:
    write_device(tmp_path, "mlx5_0", {1: Port(state="garbage\n", counters={"symbol_error": "7\n"})})
    result = await RdmaCollector(CollectorSettings(sysfs=tmp_path)).collect()
    [port] = _ports(result)
    assert (port.state, port.state_id, port.phys_state) == ("", None, "LinkUp")
    assert port.counters == {"symbol_error": 7}
    [error] = result.errors
    assert error.path == str(tmp_path / "class/infiniband/mlx5_0/ports/1/state")
    assert error.message == "not a port state: 'garbage'"


async def test_saturated_16_and_32_bit_counters_from_a_tree(tmp_path: Path) -> None:
    counters = {"symbol_error": "65535\n", "port_rcv_errors": "65534\n"}
    counters |= {"port_xmit_wait": "4294967295\n", "port_xmit_data": "4294967295\n"}
    write_device(tmp_path, "mlx5_0", {1: Port(counters=counters)})
    [port] = _ports(await RdmaCollector(CollectorSettings(sysfs=tmp_path)).collect())
    assert port.saturated == ("port_xmit_data", "port_xmit_wait", "symbol_error")
    assert port.counters["port_xmit_wait"] == 4294967295  # kept raw


async def test_device_without_ports(tmp_path: Path) -> None:
    write_device(tmp_path, "mlx5_0", {})
    real = write_device(tmp_path, "mlx5_1", {}, pci="0000:3c:00.0")
    (real / "ports").rmdir()
    result = await RdmaCollector(CollectorSettings(sysfs=tmp_path)).collect()
    assert result == Collected(field="rdma")


async def test_unreadable_files_and_odd_entries(tmp_path: Path) -> None:
    real = write_device(tmp_path, "mlx5_0", {1: Port(counters={"symbol_error": "1\n"})})
    write_port(real / "ports" / "lost+found", Port())
    (tmp_path / "class/infiniband/mlx5_9").symlink_to("../../devices/gone")  # dangling
    fake = FaultyOs(
        open_errors={"ports/1/rate": errno.EACCES, "ports/1/link_layer": errno.EAGAIN},
        list_errors={"ports/1/hw_counters": errno.EACCES},
    )
    (real / "ports/1/hw_counters").mkdir()
    reader = SysfsReader(tmp_path, os_calls=fake.calls())
    result = await RdmaCollector(CollectorSettings(sysfs=tmp_path), reader=reader).collect()
    [port] = _ports(result)
    assert (port.rate_gbps, port.link_layer, port.counters) == (None, "", {"symbol_error": 1})
    where = {e.path.removeprefix(str(tmp_path) + "/"): e.message for e in result.errors}
    assert set(where) == {
        "class/infiniband/mlx5_0/ports/lost+found",
        "class/infiniband/mlx5_0/ports/1/rate",
        "class/infiniband/mlx5_0/ports/1/hw_counters",
    }
    assert where["class/infiniband/mlx5_0/ports/lost+found"] == "not a port number: 'lost+found'"
    assert "EACCES" in where["class/infiniband/mlx5_0/ports/1/rate"]
    assert not fake.open_fds


# --- hot-unplug: no stale port ---------------------------------------------------------


async def test_removed_device_is_gone_from_the_next_run_and_back_after(tmp_path: Path) -> None:
    write_device(tmp_path, "mlx5_0", {1: ROCE})
    gone = write_device(tmp_path, "mlx5_1", {1: ROCE}, pci="0000:3c:00.0")
    collector = RdmaCollector(CollectorSettings(sysfs=tmp_path))
    assert set(_by_key(await collector.collect())) == {("mlx5_0", 1), ("mlx5_1", 1)}

    # Hot-unplug as the kernel does it: the class entry and the device directory go.
    (tmp_path / "class/infiniband/mlx5_1").unlink()
    shutil.rmtree(gone)
    result = await collector.collect()
    assert set(_by_key(result)) == {("mlx5_0", 1)}
    assert result.errors == ()

    write_device(tmp_path, "mlx5_1", {1: ROCE, 2: ROCE}, pci="0000:3c:00.0")
    assert set(_by_key(await collector.collect())) == {("mlx5_0", 1), ("mlx5_1", 1), ("mlx5_1", 2)}


async def test_device_vanishing_mid_scan_is_left_out(tmp_path: Path) -> None:
    write_device(tmp_path, "mlx5_0", {1: ROCE})
    half_read = Port(state="garbage\n")  # an error entry before the device goes
    real = write_device(tmp_path, "mlx5_1", {1: half_read, 2: ROCE}, pci="0000:3c:00.0")
    unplug = str(real / "ports" / "2" / "counters")

    def listdir(path: str) -> list[str]:
        names = os.listdir(path)
        if path == unplug:  # the device is removed while its second port is read
            (tmp_path / "class/infiniband/mlx5_1").unlink()
            shutil.rmtree(real)
        return names

    reader = SysfsReader(tmp_path, os_calls=OsCalls(listdir=listdir))
    result = await RdmaCollector(CollectorSettings(sysfs=tmp_path), reader=reader).collect()
    assert set(_by_key(result)) == {("mlx5_0", 1)}  # not port 1 of mlx5_1, read before
    assert result.errors == ()  # nor the error of its half-read port
