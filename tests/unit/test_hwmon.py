"""hwmon: node_exporter parity (values and chip names), naming rules, broken sensor files."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

import pytest

from metalguard.agent.collectors.base import Collected, CollectorSettings, run_guarded
from metalguard.agent.collectors.hwmon import (
    ChipPaths,
    HwmonCollector,
    base_chip_name,
    chip_labels,
    clean_name,
    parse_chip,
    parse_number,
)
from metalguard.agent.sysfs import SysfsReader
from metalguard.proto.telemetry import Fan, HwmonChip, Temperature
from tests.support.faultyos import FaultyOs
from tests.support.promtext import NODE_EXPORTER_SYS, load_expected, series

E2E_CHIP_INCLUDE = re.compile(r"(applesmc|asus_nb_wmi|coretemp|hwmon4|ieee80211|nct6779)")
"""node_exporter's e2e ``--collector.hwmon.chip-include``; it matches anywhere in a label."""


def _chips(result: Collected) -> dict[str, HwmonChip]:
    items = list(result.items)
    assert all(isinstance(c, HwmonChip) for c in items)
    return {c.chip: c for c in items if isinstance(c, HwmonChip)}


async def _fixture_chips() -> tuple[dict[str, HwmonChip], Collected]:
    result = await HwmonCollector(CollectorSettings(sysfs=NODE_EXPORTER_SYS)).collect()
    return _chips(result), result


def _included(chip: str) -> bool:
    return E2E_CHIP_INCLUDE.search(chip) is not None


async def test_fixture_values_match_node_exporter_value_by_value() -> None:
    chips, result = await _fixture_chips()
    assert result.errors == ()
    expected = load_expected("hwmon")

    fans = [(c.chip, f) for c in chips.values() if _included(c.chip) for f in c.fans]
    temps = [(c.chip, t) for c in chips.values() if _included(c.chip) for t in c.temps]

    def ours_fan(attr: str) -> dict[tuple[str, ...], float]:
        out: dict[tuple[str, ...], float] = {}
        for chip, fan in fans:
            value = getattr(fan, attr)
            if value is not None:
                out[(chip, fan.sensor)] = float(value)
        return out

    def ours_temp(attr: str) -> dict[tuple[str, ...], float]:
        return {
            (chip, t.sensor): getattr(t, attr) for chip, t in temps if getattr(t, attr) is not None
        }

    def theirs(metric: str) -> dict[tuple[str, ...], float]:
        return series(expected, metric, "chip", "sensor")

    # Dict equality: every expected series is reported with the same value, and every
    # reported value is one node_exporter has.
    assert ours_fan("rpm") == theirs("node_hwmon_fan_rpm")
    assert ours_fan("min_rpm") == theirs("node_hwmon_fan_min_rpm")
    assert ours_fan("alarm") == theirs("node_hwmon_fan_alarm")
    assert ours_temp("celsius") == pytest.approx(theirs("node_hwmon_temp_celsius"))
    assert ours_temp("crit_celsius") == pytest.approx(theirs("node_hwmon_temp_crit_celsius"))
    assert ours_temp("max_celsius") == pytest.approx(theirs("node_hwmon_temp_max_celsius"))
    assert set(ours_temp("celsius")) == set(theirs("node_hwmon_temp_celsius"))

    labels = {
        (dict(lbl)["chip"], dict(lbl)["sensor"]): dict(lbl)["label"]
        for lbl in expected["node_hwmon_sensor_label"]
    }
    ours_labels = {(chip, f.sensor): f.label for chip, f in fans if f.label}
    ours_labels.update({(chip, t.sensor): t.label for chip, t in temps if t.label})
    their_fan_temp_labels = {k: v for k, v in labels.items() if k[1].startswith(("fan", "temp"))}
    assert ours_labels == their_fan_temp_labels


async def test_fixture_chip_names_match_node_exporter() -> None:
    chips, _ = await _fixture_chips()
    expected = load_expected("hwmon")
    every_chip = {dict(lbl)["chip"] for samples in expected.values() for lbl in samples}
    assert {c for c in chips if _included(c)} == every_chip
    assert set(chips) - every_chip == {"bogus"}  # filtered out by node_exporter's e2e run

    chip_names = series(expected, "node_hwmon_chip_names", "chip", "chip_name")
    ours = {
        (c.chip, clean_name(c.name)): 1.0 for c in chips.values() if c.name and _included(c.chip)
    }
    assert ours == chip_names
    assert chips["platform_applesmc_768"].name == ""  # no name file in the hwmon dir
    assert chips["hwmon4"].name == ""


async def test_fixture_applesmc_reads_device_dir() -> None:
    chips, _ = await _fixture_chips()
    assert chips["platform_applesmc_768"].fans == (
        Fan(sensor="fan1", label="Left side", rpm=0.0, min_rpm=2160.0),
        Fan(sensor="fan2", label="Right side", rpm=1998.0, min_rpm=2000.0),
    )
    assert chips["nct6779"].fans == (
        Fan(sensor="fan2", label="", rpm=1098.0, min_rpm=0.0, alarm=False),
    )


# --- naming -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "clean"),
    [
        ("coretemp\n", "coretemp"),
        ("applesmc.768", "applesmc_768"),
        ("asus-nb-wmi", "asus_nb_wmi"),
        ("Physical id 0", "physical_id_0"),
        ("__x:Y__", "x:y"),
        ("...", ""),
    ],
)
def test_clean_name(raw: str, clean: str) -> None:
    assert clean_name(raw) == clean


def test_base_chip_name_preferences() -> None:
    assert base_chip_name(
        ChipPaths("hwmon0", "hwmon0", "devices/platform/coretemp.0", "coretemp\n")
    ) == ("platform_coretemp_0")
    assert base_chip_name(ChipPaths("hwmon3", "hwmon3", None, "nct6779\n")) == "nct6779"
    assert base_chip_name(ChipPaths("hwmon4", "hwmon4", None, None)) == "hwmon4"
    assert base_chip_name(ChipPaths("hwmon4", "hwmon4", None, "\n")) == "hwmon4"
    assert base_chip_name(ChipPaths("hwmon9", "hwmon9", "phy0", None)) == "phy0"
    assert base_chip_name(ChipPaths("-", "--", None, None)) is None


def test_chip_labels_disambiguate_shared_devices() -> None:
    wmi = "devices/platform/asus-nb-wmi"
    phy = "devices/platform/soc/x.wifi/ieee80211/phy0"
    chips = [
        ChipPaths("hwmon6", "hwmon6", wmi, "asus\n"),
        ChipPaths("hwmon7", "hwmon7", wmi, "asus_wmi_sensors\n"),
        ChipPaths("hwmon8", "hwmon8", phy, "mt7996\n"),
        ChipPaths("hwmon9", "hwmon9", phy, "mt7996\n"),  # same name too: hwmonN suffix
        ChipPaths("hwmon11", "hwmon11", phy, None),  # no name: hwmonN suffix
        ChipPaths("hwmon0", "hwmon0", "devices/platform/coretemp.0", "coretemp\n"),
    ]
    assert chip_labels(chips) == [
        "platform_asus_nb_wmi_asus",
        "platform_asus_nb_wmi_asus_wmi_sensors",
        "ieee80211_phy0_hwmon8",
        "ieee80211_phy0_hwmon9",
        "ieee80211_phy0_hwmon11",
        "platform_coretemp_0",
    ]


# --- parsing ----------------------------------------------------------------------------


def test_parse_chip_units_and_skips() -> None:
    files = {
        "temp1_input": "-12500\n",
        "temp1_crit": "105000\n",
        "temp1_label": "Tctl\n",
        "temp2_input": "\n",  # empty: skipped silently
        "temp2_max": "N/A\n",  # garbage: skipped and reported
        "fan10_input": "2400\n",
        "fan2_input": "800\n",
        "fan2_alarm": "1\n",
    }
    chip, issues = parse_chip("k10temp", "k10temp", files)
    assert chip == HwmonChip(
        chip="k10temp",
        name="k10temp",
        fans=(
            Fan(sensor="fan2", rpm=800.0, alarm=True),
            Fan(sensor="fan10", rpm=2400.0),
        ),
        temps=(
            Temperature(sensor="temp1", label="Tctl", celsius=-12.5, crit_celsius=105.0),
            Temperature(sensor="temp2"),
        ),
    )
    assert issues == [("temp2_max", "not a number: 'N/A'")]


@pytest.mark.parametrize(
    ("text", "value"), [("0", 0.0), ("42000\n", 42000.0), ("-5", -5.0), ("1.5", 1.5), ("", None)]
)
def test_parse_number(text: str, value: float | None) -> None:
    assert parse_number(text) == value


@pytest.mark.parametrize("text", ["nan", "inf", "1e3", "0x10", "12 34", "1_000"])
def test_parse_number_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="not a number"):
        parse_number(text)


# --- the collector over temporary trees ------------------------------------------------


def _chip_dir(root: Path, n: int, device: str | None, **files: str) -> Path:
    """class/hwmon/hwmon<n> -> devices/<device>/hwmon/hwmon<n> (a plain dir without device)."""
    link = root / "class" / "hwmon" / f"hwmon{n}"
    link.parent.mkdir(parents=True, exist_ok=True)
    if device is None:
        real = link
        real.mkdir()
    else:
        real = root / "devices" / device / "hwmon" / f"hwmon{n}"
        real.mkdir(parents=True)
        (real / "device").symlink_to("../..")
        link.symlink_to(f"../../devices/{device}/hwmon/hwmon{n}")
    for name, text in files.items():
        (real / name).write_text(text)
    return real


async def test_broken_sensor_files_become_errors_and_the_rest_stands(tmp_path: Path) -> None:
    real = _chip_dir(
        tmp_path,
        0,
        "platform/nct6775.656",
        name="nct6775\n",
        fan1_input="1200\n",
        fan1_min="garbage\n",
        fan2_input="900\n",  # EACCES injected
        temp1_input="45000\n",
        temp1_max="",
        temp1_crit="100000\n",  # EAGAIN injected
    )
    (real / "temp2_input").mkdir()
    (real / "temp3_input").write_bytes(b"1" * (10 * 1024 * 1024))
    (real / "temp4_input").symlink_to("nowhere")
    fifo = real / "fan3_input"
    os.mkfifo(fifo)  # real EAGAIN while a writer holds it open
    _chip_dir(tmp_path, 1, None, name="acpitz\n", temp1_input="27800\n")
    (tmp_path / "class" / "hwmon" / "hwmon2").symlink_to("../../devices/gone/hwmon/hwmon2")

    fake = FaultyOs(
        open_errors={"hwmon0/fan2_input": errno.EACCES},
        read_errors={"hwmon0/temp1_crit": errno.EAGAIN},
    )
    reader = SysfsReader(tmp_path, os_calls=fake.calls())
    writer = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
    try:
        result, run = await run_guarded(
            HwmonCollector(CollectorSettings(sysfs=tmp_path), reader=reader)
        )
    finally:
        os.close(writer)
    assert run.success
    chips = _chips(result)
    assert set(chips) == {"platform_nct6775_656", "acpitz"}  # dangling hwmon2 skipped
    assert chips["acpitz"].temps == (Temperature(sensor="temp1", celsius=27.8),)
    nct = chips["platform_nct6775_656"]
    assert nct.name == "nct6775"
    # A sensor none of whose files could be read is left out: fan2 (EACCES), fan3
    # (EAGAIN), temp2 (a directory), temp3 (10 MB), temp4 (dangling).
    assert nct.fans == (Fan(sensor="fan1", rpm=1200.0),)  # min garbage
    assert nct.temps == (Temperature(sensor="temp1", celsius=45.0),)  # max empty, crit EAGAIN
    by_name = {Path(e.path).name: e.message for e in result.errors}
    assert set(by_name) == {"fan1_min", "fan2_input", "temp2_input", "temp3_input"}
    assert by_name["fan1_min"] == "not a number: 'garbage'"
    assert "EACCES" in by_name["fan2_input"]
    assert "EISDIR" in by_name["temp2_input"]
    assert by_name["temp3_input"] == "attribute larger than 65536 bytes"
    assert all(e.collector == "hwmon" for e in result.errors)
    assert not fake.open_fds


async def test_device_dir_values_override_hwmon_dir(tmp_path: Path) -> None:
    real = _chip_dir(tmp_path, 0, "platform/applesmc.768", fan1_input="100\n", fan1_min="50\n")
    device = real.parent.parent
    (device / "fan1_input").write_text("200\n")
    (device / "fan1_label").write_text("Main\n")
    result = await HwmonCollector(CollectorSettings(sysfs=tmp_path)).collect()
    assert _chips(result)["platform_applesmc_768"].fans == (
        Fan(sensor="fan1", label="Main", rpm=200.0, min_rpm=50.0),
    )


async def test_dangling_device_link_falls_back_to_name_file(tmp_path: Path) -> None:
    real = _chip_dir(tmp_path, 0, None, name="drivetemp\n", temp1_input="31000\n")
    (real / "device").symlink_to("../../../devices/gone")
    result = await HwmonCollector(CollectorSettings(sysfs=tmp_path)).collect()
    assert _chips(result)["drivetemp"].temps == (Temperature(sensor="temp1", celsius=31.0),)
    assert result.errors == ()


async def test_no_hwmon_is_no_data(tmp_path: Path) -> None:
    assert await HwmonCollector(CollectorSettings(sysfs=tmp_path)).collect() == Collected(
        field="hwmon"
    )
