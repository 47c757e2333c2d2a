"""EDAC: node_exporter parity on its fixture, the modern dimm layout, and broken files."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from metalguard.agent.collectors.base import Collected, CollectorSettings, run_guarded
from metalguard.agent.collectors.edac import EdacCollector, parse_controller, parse_count
from metalguard.agent.sysfs import SysfsReader
from metalguard.proto.telemetry import EdacChannel, EdacController, EdacCsrow, EdacDimm
from tests.support.faultyos import FaultyOs
from tests.support.promtext import NODE_EXPORTER_SYS, load_expected, series

MC = "devices/system/edac/mc"


def _controllers(result: Collected) -> list[EdacController]:
    items = list(result.items)
    assert all(isinstance(c, EdacController) for c in items)
    return [c for c in items if isinstance(c, EdacController)]


def _node_exporter_label(label: str) -> str:
    """node_exporter's rewrite of a csrow dimm label (edacDimmLabel)."""
    return label.replace("#", "").replace("csrow", "_csrow").replace("channel", "_channel")


async def test_fixture_matches_node_exporter_value_by_value() -> None:
    result = await EdacCollector(CollectorSettings(sysfs=NODE_EXPORTER_SYS)).collect()
    assert result.errors == ()
    expected = load_expected("edac")

    ours_mc: dict[tuple[str, ...], float] = {}
    ours_mc_ue: dict[tuple[str, ...], float] = {}
    ours_csrow_ce: dict[tuple[str, ...], float] = {}
    ours_csrow_ue: dict[tuple[str, ...], float] = {}
    ours_ch_ce: dict[tuple[str, ...], float] = {}
    ours_ch_ue: dict[tuple[str, ...], float] = {}
    for c in _controllers(result):
        mc = str(c.mc)
        top: tuple[tuple[dict[tuple[str, ...], float], tuple[str, ...], int | None], ...] = (
            (ours_mc, (mc,), c.ce_count),
            (ours_mc_ue, (mc,), c.ue_count),
            (ours_csrow_ce, (mc, "unknown"), c.ce_noinfo_count),
            (ours_csrow_ue, (mc, "unknown"), c.ue_noinfo_count),
        )
        for target, mc_key, value in top:
            if value is not None:
                target[mc_key] = value
        for row in c.csrows:
            if row.ce_count is not None:
                ours_csrow_ce[(mc, str(row.csrow))] = row.ce_count
            if row.ue_count is not None:
                ours_csrow_ue[(mc, str(row.csrow))] = row.ue_count
            for ch in row.channels:
                key = (mc, str(row.csrow), str(ch.channel), _node_exporter_label(ch.label))
                if ch.ce_count is not None:
                    ours_ch_ce[key] = ch.ce_count
                if ch.ue_count is not None:
                    ours_ch_ue[key] = ch.ue_count

    ch_keys = ("controller", "csrow", "channel", "dimm_label")
    # Dict equality checks both directions: every expected series is reported with the
    # same value, and nothing is reported that node_exporter does not have.
    assert ours_mc == series(expected, "node_edac_correctable_errors_total", "controller")
    assert ours_mc_ue == series(expected, "node_edac_uncorrectable_errors_total", "controller")
    assert ours_csrow_ce == series(
        expected, "node_edac_csrow_correctable_errors_total", "controller", "csrow"
    )
    assert ours_csrow_ue == series(
        expected, "node_edac_csrow_uncorrectable_errors_total", "controller", "csrow"
    )
    assert ours_ch_ce == series(expected, "node_edac_channel_correctable_errors_total", *ch_keys)
    assert ours_ch_ue == series(expected, "node_edac_channel_uncorrectable_errors_total", *ch_keys)


async def test_fixture_structure() -> None:
    result = await EdacCollector(CollectorSettings(sysfs=NODE_EXPORTER_SYS)).collect()
    [mc0] = _controllers(result)
    assert (mc0.mc, mc0.ce_count, mc0.ue_count) == (0, 1, 5)
    assert (mc0.ce_noinfo_count, mc0.ue_noinfo_count) == (2, 6)
    assert [r.csrow for r in mc0.csrows] == [0, 1, 2]
    assert mc0.csrows[2].channels[0] == EdacChannel(
        channel=0, label="mc0csrow2channel0", ce_count=0, ue_count=None
    )
    assert mc0.dimms == ()


def test_parse_modern_dimm_and_rank_layout() -> None:
    files = {
        "ce_count": "7\n",
        "ue_count": "0\n",
        "dimm10/dimm_ce_count": "5\n",
        "dimm10/dimm_ue_count": "0\n",
        "dimm10/dimm_label": "CPU_SrcID#0_Ha#0_Chan#1_DIMM#0\n",
        "dimm2/dimm_ce_count": "2\n",
        "dimm2/dimm_ue_count": "0\n",
        "rank0/dimm_ce_count": "0\n",
    }
    controller, issues = parse_controller(3, files)
    assert issues == []
    assert controller == EdacController(
        mc=3,
        ce_count=7,
        ue_count=0,
        dimms=(
            EdacDimm(name="dimm2", ce_count=2, ue_count=0),
            EdacDimm(name="dimm10", label="CPU_SrcID#0_Ha#0_Chan#1_DIMM#0", ce_count=5, ue_count=0),
            EdacDimm(name="rank0", ce_count=0),
        ),
    )


def test_parse_legacy_csrow_layout() -> None:
    files = {
        "csrow1/ce_count": "3",
        "csrow1/ue_count": "1",
        "csrow1/ch1_ce_count": "3",
        "csrow1/ch1_dimm_label": "DIMM_B1 ",
        "csrow1/ch0_ue_count": "1",
    }
    controller, issues = parse_controller(0, files)
    assert issues == []
    assert controller.csrows == (
        EdacCsrow(
            csrow=1,
            ce_count=3,
            ue_count=1,
            channels=(
                EdacChannel(channel=0, ue_count=1),
                EdacChannel(channel=1, label="DIMM_B1", ce_count=3),
            ),
        ),
    )


def test_parse_bad_counter_costs_only_that_value() -> None:
    files = {
        "ce_count": "lots",
        "ue_count": "4",
        "dimm0/dimm_ce_count": "-1",
        "dimm0/dimm_ue_count": "2",
    }
    controller, issues = parse_controller(0, files)
    assert controller.ce_count is None
    assert controller.ue_count == 4
    assert controller.dimms == (EdacDimm(name="dimm0", ce_count=None, ue_count=2),)
    assert sorted(key for key, _ in issues) == ["ce_count", "dimm0/dimm_ce_count"]
    assert all("not a counter" in msg for _, msg in issues)


@pytest.mark.parametrize(("text", "value"), [("0\n", 0), ("123", 123), (" 9 \n", 9), ("", None)])
def test_parse_count(text: str, value: int | None) -> None:
    assert parse_count(text) == value


@pytest.mark.parametrize("text", ["-3", "1.5", "0x10", "abc", "1_000", "١٢"])
def test_parse_count_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="not a counter"):
        parse_count(text)


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def broken_tree(tmp_path: Path) -> Path:
    """mc0 with one fault per file; mc1 and mc10 healthy."""
    root = tmp_path / "sys"
    mc0 = f"{MC}/mc0"
    _write(root, f"{mc0}/ce_count", "garbage\n")
    _write(root, f"{mc0}/ue_count", "")
    (root / mc0 / "ce_noinfo_count").mkdir()
    (root / mc0 / "ue_noinfo_count").write_bytes(b"1" * (10 * 1024 * 1024))
    _write(root, f"{mc0}/reset_counters", "")  # write-only in real sysfs: never read
    _write(root, f"{mc0}/dimm0/dimm_ce_count", "11\n")
    _write(root, f"{mc0}/dimm0/dimm_ue_count", "1\n")
    (root / mc0 / "dimm0" / "dimm_label").symlink_to("../nowhere")
    _write(root, f"{mc0}/dimm1/dimm_ce_count", "3\n")  # EACCES injected
    _write(root, f"{mc0}/dimm1/dimm_ue_count", "0\n")  # EAGAIN injected
    _write(root, f"{mc0}/dimm1/dimm_label", "B0\n")
    for mc, ce in (("mc1", "4"), ("mc10", "8")):
        _write(root, f"{MC}/{mc}/ce_count", ce + "\n")
        _write(root, f"{MC}/{mc}/ue_count", "0\n")
    _write(root, f"{MC}/power/control", "auto")
    return root


async def test_broken_files_become_errors_and_the_rest_stands(broken_tree: Path) -> None:
    fake = FaultyOs(
        open_errors={"mc0/dimm1/dimm_ce_count": errno.EACCES, "mc0/reset_counters": errno.EACCES},
        read_errors={"mc0/dimm1/dimm_ue_count": errno.EAGAIN},
    )
    reader = SysfsReader(broken_tree, os_calls=fake.calls())
    collector = EdacCollector(CollectorSettings(sysfs=broken_tree), reader=reader)
    result, run = await run_guarded(collector)
    assert run.success

    mc0, mc1, mc10 = _controllers(result)
    assert [mc0.mc, mc1.mc, mc10.mc] == [0, 1, 10]
    assert (mc1.ce_count, mc10.ce_count) == (4, 8)
    assert mc0.ce_count is None  # garbage
    assert mc0.ue_count is None  # empty
    assert mc0.ce_noinfo_count is None  # directory
    assert mc0.ue_noinfo_count is None  # 10 MB
    assert mc0.dimms == (
        EdacDimm(name="dimm0", label="", ce_count=11, ue_count=1),  # dangling label
        EdacDimm(name="dimm1", label="B0", ce_count=None, ue_count=None),
    )

    by_path = {Path(e.path).relative_to(broken_tree / MC).as_posix(): e for e in result.errors}
    assert set(by_path) == {
        "mc0/ce_count",
        "mc0/ce_noinfo_count",
        "mc0/ue_noinfo_count",
        "mc0/dimm1/dimm_ce_count",
    }, "EAGAIN, empty and dangling are no data, not errors"
    assert "not a counter" in by_path["mc0/ce_count"].message
    assert "EISDIR" in by_path["mc0/ce_noinfo_count"].message
    assert by_path["mc0/ue_noinfo_count"].message == "attribute larger than 65536 bytes"
    assert "EACCES" in by_path["mc0/dimm1/dimm_ce_count"].message
    assert all(e.collector == "edac" for e in result.errors)
    assert not fake.open_fds


async def test_real_eagain_fifo_counter(tmp_path: Path) -> None:
    root = tmp_path / "sys"
    _write(root, f"{MC}/mc0/ce_count", "1\n")
    fifo = root / MC / "mc0" / "ue_count"
    os.mkfifo(fifo)
    writer = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
    try:
        result = await EdacCollector(CollectorSettings(sysfs=root)).collect()
    finally:
        os.close(writer)
    [mc0] = _controllers(result)
    assert (mc0.ce_count, mc0.ue_count) == (1, None)


async def test_no_edac_is_no_data(tmp_path: Path) -> None:
    result = await EdacCollector(CollectorSettings(sysfs=tmp_path)).collect()
    assert result == Collected(field="edac")


async def test_mc_path_that_is_a_file_is_no_data(tmp_path: Path) -> None:
    (tmp_path / "devices" / "system" / "edac").mkdir(parents=True)
    (tmp_path / MC).write_text("not a directory")  # listdir gives ENOTDIR
    result = await EdacCollector(CollectorSettings(sysfs=tmp_path)).collect()
    assert result == Collected(field="edac")


async def test_unlistable_dirs_are_errors(tmp_path: Path) -> None:
    _write(tmp_path, f"{MC}/mc0/ce_count", "1\n")
    _write(tmp_path, f"{MC}/mc0/csrow0/ce_count", "1\n")
    fake = FaultyOs(list_errors={"/mc0/csrow0": errno.EACCES})
    reader = SysfsReader(tmp_path, os_calls=fake.calls())
    result = await EdacCollector(CollectorSettings(sysfs=tmp_path), reader=reader).collect()
    [mc0] = _controllers(result)
    assert mc0.ce_count == 1
    assert mc0.csrows == (EdacCsrow(csrow=0, ce_count=1),)
    [error] = result.errors
    assert error.path == str(tmp_path / MC / "mc0" / "csrow0")
    assert "EACCES" in error.message

    fake = FaultyOs(list_errors={"/edac/mc": errno.EACCES})
    reader = SysfsReader(tmp_path, os_calls=fake.calls())
    result = await EdacCollector(CollectorSettings(sysfs=tmp_path), reader=reader).collect()
    assert result.items == ()
    assert [e.path for e in result.errors] == [str(tmp_path / MC)]
