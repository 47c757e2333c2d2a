"""PCIe: node_exporter parity, AER parsing with kernel samples, link tracking, bad files."""

from __future__ import annotations

import errno
import itertools
from pathlib import Path

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from metalguard.agent.collectors.base import Collected, CollectorSettings, run_guarded
from metalguard.agent.collectors.pcie import (
    LinkHistory,
    PcieCollector,
    is_downgraded,
    parse_aer,
    parse_device,
    parse_link_speed,
    parse_link_width,
    track_links,
)
from metalguard.agent.sysfs import SysfsReader
from metalguard.proto.telemetry import AerCounters, PcieDevice
from tests.support import FIXTURES
from tests.support.faultyos import FaultyOs
from tests.support.promtext import NODE_EXPORTER_SYS, load_expected, series

KERNEL = FIXTURES / "kernel"
NVME, BRIDGE, NIC = "0000:01:00.0", "0000:00:02.1", "0000:45:00.0"


def _devices(result: Collected) -> dict[str, PcieDevice]:
    items = list(result.items)
    assert all(isinstance(d, PcieDevice) for d in items)
    return {d.address: d for d in items if isinstance(d, PcieDevice)}


def _prom_key(address: str) -> tuple[str, str, str, str]:
    segment, bus, rest = address.split(":")
    device, function = rest.split(".")
    return segment, bus, device, function


async def _fixture_devices() -> tuple[dict[str, PcieDevice], Collected]:
    result = await PcieCollector(CollectorSettings(sysfs=NODE_EXPORTER_SYS)).collect()
    return _devices(result), result


async def test_fixture_links_match_node_exporter_value_by_value() -> None:
    devices, result = await _fixture_devices()
    assert result.errors == ()
    expected = load_expected("pcidevice")
    keys = ("segment", "bus", "device", "function")

    def ours(attr: str, scale: float = 1.0) -> dict[tuple[str, ...], float]:
        out: dict[tuple[str, ...], float] = {}
        for d in devices.values():
            value = getattr(d, attr)
            if value is not None:
                out[_prom_key(d.address)] = value * scale
        return out

    # Dict equality: both directions, value by value.
    assert ours("current_link_speed_gts", 1e9) == series(
        expected, "node_pcidevice_current_link_transfers_per_second", *keys
    )
    assert ours("max_link_speed_gts", 1e9) == series(
        expected, "node_pcidevice_max_link_transfers_per_second", *keys
    )
    assert ours("current_link_width") == series(
        expected, "node_pcidevice_current_link_width", *keys
    )
    assert ours("max_link_width") == series(expected, "node_pcidevice_max_link_width", *keys)

    info = {
        tuple(dict(labels)[k] for k in keys): dict(labels)
        for labels in expected["node_pcidevice_info"]
    }
    assert set(info) == {_prom_key(a) for a in devices}
    for address, d in devices.items():
        labels = info[_prom_key(address)]
        assert (d.pci_class, d.vendor, d.device) == (
            labels["class_id"],
            labels["vendor_id"],
            labels["device_id"],
        )


async def test_fixture_downgrades_flagged() -> None:
    devices, _ = await _fixture_devices()
    nvme, bridge, nic = devices[NVME], devices[BRIDGE], devices[NIC]
    assert (nvme.current_link_speed_gts, nvme.max_link_speed_gts) == (8.0, 16.0)
    assert nvme.downgraded
    assert (nvme.downgrades, nvme.recoveries, nvme.retrains) == (1, 0, 1)
    assert bridge.downgraded  # x4 of x8 at full speed
    assert bridge.downgrades == 1
    assert not nic.downgraded
    assert (nic.downgrades, nic.recoveries, nic.retrains) == (0, 0, 0)


async def test_fixture_aer() -> None:
    devices, _ = await _fixture_devices()
    assert devices[BRIDGE].aer is None
    aer = devices[NVME].aer
    assert aer is not None
    assert list(aer.correctable) == [
        "RxErr", "BadTLP", "BadDLLP", "Rollover", "Timeout",
        "NonFatalErr", "CorrIntErr", "HeaderOF", "TOTAL_ERR_COR",
    ]  # fmt: skip
    assert set(aer.correctable.values()) == {0}
    assert len(aer.fatal) == len(aer.nonfatal) == 19
    assert aer.fatal["TOTAL_ERR_FATAL"] == 0
    assert aer.nonfatal["PoisonTLPBlocked"] == 0
    assert "TOTAL_ERR_NONFATAL" in aer.nonfatal


async def test_fixture_state_is_stable_across_cycles() -> None:
    collector = PcieCollector(CollectorSettings(sysfs=NODE_EXPORTER_SYS))
    await collector.collect()
    devices = _devices(await collector.collect())
    assert devices[NVME].downgrades == 1
    assert devices[NVME].retrains == 1


def test_parse_aer_kernel_long_name_samples() -> None:
    correctable, bad = parse_aer(
        (KERNEL / "sysfs_aer_dev_correctable_v4.19_abi-doc.txt").read_text()
    )
    assert bad == []
    assert correctable == {
        "Receiver Error": 2,
        "Bad TLP": 0,
        "Bad DLLP": 0,
        "RELAY_NUM Rollover": 0,
        "Replay Timer Timeout": 0,
        "Advisory Non-Fatal": 0,
        "Corrected Internal Error": 0,
        "Header Log Overflow": 0,
        "TOTAL_ERR_COR": 2,
    }
    fatal, bad = parse_aer((KERNEL / "sysfs_aer_dev_fatal_v4.19_abi-doc.txt").read_text())
    assert bad == []
    assert len(fatal) == 18
    assert fatal["Surprise Down Error"] == 0
    assert fatal["TLP Prefix Blocked Error"] == 0
    assert fatal["TOTAL_ERR_FATAL"] == 0
    assert next(iter(fatal)) == "Undefined"


def test_parse_aer_keeps_good_lines_around_bad_ones() -> None:
    counters, bad = parse_aer("RxErr 3\nnonsense\nBad TLP x\n\n  BadDLLP   7  \n12\n")
    assert counters == {"RxErr": 3, "BadDLLP": 7}
    assert bad == ["nonsense", "Bad TLP x", "12"]


@pytest.mark.parametrize(
    ("text", "gts"),
    [
        ("16.0 GT/s PCIe\n", 16.0),
        ("8.0 GT/s PCIe", 8.0),
        ("8 GT/s\n", 8.0),
        ("2.5 GT/s", 2.5),
        ("5.0 GT/s", 5.0),
        ("Unknown\n", None),
        ("Unknown speed", None),
        ("", None),
    ],
)
def test_parse_link_speed(text: str, gts: float | None) -> None:
    assert parse_link_speed(text) == gts


@pytest.mark.parametrize("text", ["fast", "GT/s 8", "8.0.1 GT/s", "-8 GT/s"])
def test_parse_link_speed_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="not a link speed"):
        parse_link_speed(text)


def test_parse_link_width() -> None:
    assert parse_link_width("16\n") == 16
    assert parse_link_width("") is None
    with pytest.raises(ValueError, match="not a link width"):
        parse_link_width("x16")


@pytest.mark.parametrize(
    ("args", "down"),
    [
        ((8.0, 16.0, 4, 4), True),
        ((8.0, 8.0, 4, 8), True),
        ((16.0, 16.0, 16, 16), False),
        ((None, 16.0, 4, 16), True),
        ((8.0, 16.0, None, None), True),
        ((None, 16.0, None, 16), False),
        ((None, None, None, None), False),
    ],
)
def test_is_downgraded(
    args: tuple[float | None, float | None, int | None, int | None], down: bool
) -> None:
    assert is_downgraded(*args) is down


def test_parse_device_without_aer_and_with_a_bad_file() -> None:
    files = {
        "class": "0x030200\n",
        "vendor": "0x10de\n",
        "device": "0x2330\n",
        "current_link_speed": "32.0 GT/s PCIe\n",
        "max_link_speed": "weird\n",
        "current_link_width": "8\n",
        "max_link_width": "16\n",
    }
    device, issues = parse_device("0000:c1:00.0", files)
    assert device == PcieDevice(
        address="0000:c1:00.0",
        pci_class="0x030200",
        vendor="0x10de",
        device="0x2330",
        current_link_speed_gts=32.0,
        max_link_speed_gts=None,
        current_link_width=8,
        max_link_width=16,
        downgraded=True,
    )
    assert issues == [("max_link_speed", "not a link speed: 'weird'")]


def test_parse_device_with_partial_aer() -> None:
    device, issues = parse_device("0000:01:00.0", {"aer_dev_fatal": "DLP 1\nTOTAL_ERR_FATAL 1\n"})
    assert device.aer == AerCounters(fatal={"DLP": 1, "TOTAL_ERR_FATAL": 1})
    assert issues == []


# --- link tracking ------------------------------------------------------------------

HEALTHY = (16.0, 16.0, 16, 16)
SLOW = (8.0, 16.0, 16, 16)
UNKNOWN = (None, 16.0, None, 16)


def _dev(
    address: str, link: tuple[float | None, float | None, int | None, int | None]
) -> PcieDevice:
    return PcieDevice(
        address=address,
        current_link_speed_gts=link[0],
        max_link_speed_gts=link[1],
        current_link_width=link[2],
        max_link_width=link[3],
        downgraded=is_downgraded(*link),
    )


def _run(sequence: list[tuple[float | None, float | None, int | None, int | None]]) -> PcieDevice:
    state: dict[str, LinkHistory] = {}
    out: tuple[PcieDevice, ...] = ()
    for link in sequence:
        state, out = track_links(state, [_dev("a", link)])
    [device] = out
    return device


@pytest.mark.parametrize(
    ("sequence", "counts"),
    [
        ([HEALTHY], (0, 0)),
        ([SLOW], (1, 0)),
        ([HEALTHY, SLOW], (1, 0)),
        ([HEALTHY, SLOW, SLOW, SLOW], (1, 0)),
        ([HEALTHY, SLOW, HEALTHY], (1, 1)),
        ([SLOW, HEALTHY, SLOW, HEALTHY, HEALTHY], (2, 2)),
        ([HEALTHY, SLOW, UNKNOWN, SLOW], (1, 0)),
        ([HEALTHY, UNKNOWN, HEALTHY], (0, 0)),
        ([SLOW, UNKNOWN, HEALTHY], (1, 1)),
    ],
)
def test_track_links_sequences(
    sequence: list[tuple[float | None, float | None, int | None, int | None]],
    counts: tuple[int, int],
) -> None:
    device = _run(sequence)
    assert (device.downgrades, device.recoveries) == counts
    assert device.retrains == sum(counts)


def test_track_links_unknown_first_sighting_has_no_history() -> None:
    state, out = track_links({}, [_dev("a", UNKNOWN)])
    assert state == {}
    assert out == (_dev("a", UNKNOWN),)


def test_track_links_is_pure_and_per_device() -> None:
    previous = {"a": LinkHistory(downgraded=False), "gone": LinkHistory(True, 3, 2)}
    frozen = dict(previous)
    state, out = track_links(previous, [_dev("a", SLOW), _dev("b", HEALTHY)])
    assert previous == frozen
    assert state == {
        "a": LinkHistory(True, 1, 0),
        "b": LinkHistory(False, 0, 0),
        "gone": LinkHistory(True, 3, 2),  # kept: a device that returns is not new
    }
    assert [(d.address, d.downgrades) for d in out] == [("a", 1), ("b", 0)]


@given(st.lists(st.sampled_from([HEALTHY, SLOW, UNKNOWN]), min_size=1, max_size=40))
def test_track_links_property(
    sequence: list[tuple[float | None, float | None, int | None, int | None]],
) -> None:
    device = _run(sequence)
    assert device.recoveries <= device.downgrades <= device.recoveries + 1
    assert device.retrains == device.downgrades + device.recoveries
    known = [link for link in sequence if link is not UNKNOWN]
    # Model: count transitions into and out of SLOW, starting from healthy.
    states = [False] + [link is SLOW for link in known]
    downs = sum(1 for a, b in itertools.pairwise(states) if not a and b)
    ups = sum(1 for a, b in itertools.pairwise(states) if a and not b)
    assert (device.downgrades, device.recoveries) == (downs, ups)
    assert (device.downgrades - device.recoveries == 1) == states[-1]


# --- the collector over temporary trees ------------------------------------------------


def _write_device(root: Path, address: str, **files: str) -> Path:
    real = root / "devices" / "pci0000:00" / address
    real.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (real / name).write_text(text)
    link = root / "bus" / "pci" / "devices" / address
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.is_symlink():
        link.symlink_to(f"../../../devices/pci0000:00/{address}")
    return real


async def test_collector_counts_recovery_across_cycles(tmp_path: Path) -> None:
    real = _write_device(
        tmp_path,
        "0000:02:00.0",
        current_link_speed="8.0 GT/s PCIe\n",
        max_link_speed="16.0 GT/s PCIe\n",
        current_link_width="16\n",
        max_link_width="16\n",
    )
    collector = PcieCollector(CollectorSettings(sysfs=tmp_path))
    first = _devices(await collector.collect())["0000:02:00.0"]
    assert (first.downgraded, first.downgrades, first.recoveries) == (True, 1, 0)

    (real / "current_link_speed").write_text("16.0 GT/s PCIe\n")
    second = _devices(await collector.collect())["0000:02:00.0"]
    assert (second.downgraded, second.downgrades, second.recoveries, second.retrains) == (
        False,
        1,
        1,
        2,
    )

    (real / "current_link_width").write_text("8\n")
    third = _devices(await collector.collect())["0000:02:00.0"]
    assert (third.downgraded, third.downgrades, third.retrains) == (True, 2, 3)


async def test_broken_device_files_become_errors_and_the_rest_stands(tmp_path: Path) -> None:
    bad = _write_device(
        tmp_path,
        "0000:03:00.0",
        vendor="0x15b3\n",
        device="0x1021\n",  # EACCES injected
        current_link_speed="garbage\n",
        max_link_speed="32.0 GT/s PCIe\n",
        current_link_width="",
        max_link_width="16\n",
        aer_dev_correctable="RxErr 5\nTOTAL_ERR_COR 5\n",  # EAGAIN injected
        aer_dev_nonfatal="DLP 1\nTOTAL_ERR_NONFATAL 1\n",
    )
    (bad / "class").mkdir()
    (bad / "aer_dev_fatal").write_bytes(b"DLP 0\n" * 2_000_000)
    _write_device(
        tmp_path,
        "0000:04:00.0",
        **{"class": "0x020000\n"},
        current_link_speed="16.0 GT/s PCIe\n",
        max_link_speed="16.0 GT/s PCIe\n",
    )
    (tmp_path / "bus" / "pci" / "devices" / "0000:05:00.0").symlink_to(
        "../../../devices/pci0000:00/0000:05:00.0"
    )  # dangling: the device went away
    fake = FaultyOs(
        open_errors={"0000:03:00.0/device": errno.EACCES},
        read_errors={"0000:03:00.0/aer_dev_correctable": errno.EAGAIN},
    )
    reader = SysfsReader(tmp_path, os_calls=fake.calls())
    result, run = await run_guarded(PcieCollector(CollectorSettings(sysfs=tmp_path), reader=reader))
    assert run.success
    devices = _devices(result)
    assert set(devices) == {"0000:03:00.0", "0000:04:00.0"}
    good = devices["0000:04:00.0"]
    assert (good.pci_class, good.current_link_speed_gts, good.downgraded) == (
        "0x020000",
        16.0,
        False,
    )

    broken = devices["0000:03:00.0"]
    assert (broken.pci_class, broken.vendor, broken.device) == ("", "0x15b3", "")
    assert (broken.current_link_speed_gts, broken.max_link_speed_gts) == (None, 32.0)
    assert (broken.current_link_width, broken.max_link_width) == (None, 16)
    assert not broken.downgraded
    assert broken.aer == AerCounters(nonfatal={"DLP": 1, "TOTAL_ERR_NONFATAL": 1})

    by_name = {Path(e.path).name: e.message for e in result.errors}
    assert set(by_name) == {"class", "device", "current_link_speed", "aer_dev_fatal"}
    assert "EISDIR" in by_name["class"]
    assert "EACCES" in by_name["device"]
    assert by_name["current_link_speed"] == "not a link speed: 'garbage'"
    assert by_name["aer_dev_fatal"] == "attribute larger than 65536 bytes"
    assert all(e.collector == "pcie" for e in result.errors)
    assert not fake.open_fds


async def test_bad_aer_line_is_reported_with_its_path(tmp_path: Path) -> None:
    real = _write_device(tmp_path, "0000:06:00.0", aer_dev_correctable="RxErr 1\nRxErr\n")
    result = await PcieCollector(CollectorSettings(sysfs=tmp_path)).collect()
    [device] = _devices(result).values()
    assert device.aer == AerCounters(correctable={"RxErr": 1})
    [error] = result.errors
    assert error.path == str(real / "aer_dev_correctable")
    assert error.message == "bad line: 'RxErr'"


async def test_no_pci_bus_is_no_data(tmp_path: Path) -> None:
    assert await PcieCollector(CollectorSettings(sysfs=tmp_path)).collect() == Collected(
        field="pcie"
    )


def test_devices_encode_with_the_wire_name_for_class() -> None:
    device, _ = parse_device("0000:01:00.0", {"class": "0x010802\n"})
    assert b'"class":"0x010802"' in msgspec.json.encode(device)
