"""The sysfs reader across scans: the tree's shape and the attribute descriptors it keeps,
what makes it learn the tree afresh, and that readings and errors stay a fresh scan's."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from metalguard.agent import sysfs
from metalguard.agent.collectors.base import Collected, CollectorSettings
from metalguard.agent.collectors.edac import EdacCollector
from metalguard.agent.collectors.hwmon import HwmonCollector
from metalguard.agent.collectors.pcie import DEVICES_DIR, PcieCollector, scan_pcie
from metalguard.agent.sysfs import SysfsReader, mount_fs_type, on_sysfs, run_scan
from metalguard.proto.telemetry import CollectorError, PcieDevice
from tests.support.faultyos import FaultyOs
from tests.support.promtext import NODE_EXPORTER_SYS

WATCH = (DEVICES_DIR,)
A, B, C = "0000:01:00.0", "0000:02:00.0", "0000:03:00.0"
LINK = {
    "vendor": "0x10de\n",
    "current_link_speed": "16.0 GT/s PCIe\n",
    "max_link_speed": "16.0 GT/s PCIe\n",
    "current_link_width": "16\n",
    "max_link_width": "16\n",
    "aer_dev_fatal": "DLP 0\nTOTAL_ERR_FATAL 0\n",
}

Scan = tuple[list[PcieDevice], list[CollectorError]]


def _device(root: Path, address: str, **files: str) -> Path:
    real = root / "devices" / "pci0000:00" / address
    real.mkdir(parents=True, exist_ok=True)
    for name, text in (LINK | files).items():
        (real / name).write_text(text)
    link = root / "bus" / "pci" / "devices" / address
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.is_symlink():
        link.symlink_to(f"../../../devices/pci0000:00/{address}")
    return real


async def _fresh(root: Path, fake: FaultyOs | None = None) -> Scan:
    """What a reader that has never seen the tree reads (today's behaviour)."""
    reader = SysfsReader(root, os_calls=fake.calls() if fake else None, keep_open=False)
    return await run_scan(scan_pcie, reader)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    _device(tmp_path, A)
    _device(tmp_path, B)
    return tmp_path


async def test_an_unchanged_device_set_is_not_walked_again(tree: Path) -> None:
    fake = FaultyOs()
    reader = SysfsReader(tree, os_calls=fake.calls(), keep_open=False)
    first = await run_scan(scan_pcie, reader, watch=WATCH)
    fake.listed.clear()
    second = await run_scan(scan_pcie, reader, watch=WATCH)
    assert first == second == await _fresh(tree)
    assert [Path(p).name for p in fake.listed] == ["devices"]  # only the watched listing
    assert not fake.open_fds


async def test_kept_descriptors_are_reread_with_pread_and_see_new_values(tree: Path) -> None:
    fake = FaultyOs()
    reader = SysfsReader(tree, os_calls=fake.calls(), keep_open=True)
    await run_scan(scan_pcie, reader, watch=WATCH)
    assert reader.kept_fds == len(fake.open_fds) == 2 * len(LINK)
    (tree / "devices" / "pci0000:00" / A / "current_link_width").write_text("8\n")
    fake.opened.clear()
    devices, errors = await run_scan(scan_pcie, reader, watch=WATCH)
    assert (devices, errors) == await _fresh(tree)
    assert devices[0].current_link_width == 8
    assert all(not p.endswith(tuple(LINK)) for p in fake.opened)  # no attribute reopened
    assert len(fake.preads) >= 2 * len(LINK)


async def test_a_new_device_makes_the_reader_learn_the_tree_and_reopen(tree: Path) -> None:
    fake = FaultyOs()
    reader = SysfsReader(tree, os_calls=fake.calls(), keep_open=True)
    await run_scan(scan_pcie, reader, watch=WATCH)
    _device(tree, C)
    fake.opened.clear()
    devices, errors = await run_scan(scan_pcie, reader, watch=WATCH)
    assert (devices, errors) == await _fresh(tree)
    assert [d.address for d in devices] == [A, B, C]
    assert any(f"/{A}/" in p for p in fake.opened)  # the old devices' descriptors reopened
    assert reader.kept_fds == len(fake.open_fds) == 3 * len(LINK)


async def test_an_attribute_gone_between_scans_reads_as_a_fresh_scan(tree: Path) -> None:
    reader = SysfsReader(tree, keep_open=False)
    await run_scan(scan_pcie, reader, watch=WATCH)
    (tree / "devices" / "pci0000:00" / B / "aer_dev_fatal").unlink()
    (tree / "devices" / "pci0000:00" / B / "max_link_width").unlink()
    devices, errors = await run_scan(scan_pcie, reader, watch=WATCH)
    assert (devices, errors) == await _fresh(tree)
    assert (devices[1].aer, devices[1].max_link_width) == (None, None)
    assert errors == []


async def test_a_removed_kept_attribute_is_missing_as_today(tree: Path) -> None:
    """kernfs answers ENODEV on a descriptor whose attribute was removed: the reader opens
    the path again, finds it missing, and the scan runs again on a forgotten shape."""
    fake = FaultyOs()
    reader = SysfsReader(tree, os_calls=fake.calls(), keep_open=True)
    await run_scan(scan_pcie, reader, watch=WATCH)
    gone = tree / "devices" / "pci0000:00" / A / "max_link_width"
    gone.unlink()
    fake.pread_errors[f"{A}/max_link_width"] = errno.ENODEV
    devices, errors = await run_scan(scan_pcie, reader, watch=WATCH)
    assert (devices, errors) == await _fresh(tree)
    assert devices[0].max_link_width is None
    assert not any(p.endswith(f"{A}/max_link_width") for p in fake.open_fds.values())
    assert reader.kept_fds == len(fake.open_fds) == 2 * len(LINK) - 1


async def test_a_kept_attribute_that_breaks_gives_todays_error(tree: Path) -> None:
    fake = FaultyOs()
    reader = SysfsReader(tree, os_calls=fake.calls(), keep_open=True)
    await run_scan(scan_pcie, reader, watch=WATCH)
    fake.read_errors[f"{A}/vendor"] = errno.EACCES  # every read of it fails from now on
    fake.read_errors[f"{B}/aer_dev_fatal"] = errno.EAGAIN
    devices, errors = await run_scan(scan_pcie, reader, watch=WATCH)
    assert (devices, errors) == await _fresh(tree, fake)
    assert [(Path(e.path).parent.name, Path(e.path).name) for e in errors] == [(A, "vendor")]
    assert "EACCES" in (errors[0].message or "")
    assert devices[1].aer is None
    assert not any(p.endswith(f"{A}/vendor") for p in fake.open_fds.values())


async def test_the_shape_is_learnt_afresh_every_refresh_scans(tree: Path) -> None:
    fake = FaultyOs()
    reader = SysfsReader(tree, os_calls=fake.calls(), keep_open=False, refresh_scans=2)
    counts = []
    for _ in range(4):
        fake.listed.clear()
        await run_scan(scan_pcie, reader, watch=WATCH)
        counts.append(len(fake.listed))
    assert counts == [1, 1, 1, 1]  # the watched listing is the only one pcie makes...
    fake.opened.clear()
    await run_scan(scan_pcie, reader, watch=WATCH)  # ...so count the absent files' opens
    await run_scan(scan_pcie, reader, watch=WATCH)
    absent_opens = [p for p in fake.opened if p.endswith("/class")]
    assert len(absent_opens) == 2  # once per device: one scan relearnt, one reused


async def test_without_watch_nothing_is_kept(tree: Path) -> None:
    fake = FaultyOs()
    reader = SysfsReader(tree, os_calls=fake.calls(), keep_open=True)
    await run_scan(scan_pcie, reader)
    assert reader.kept_fds == 0
    assert not fake.open_fds


async def test_outside_sysfs_descriptors_are_not_kept_and_renames_are_seen(tree: Path) -> None:
    """A fixture tree is no sysfs: a file replaced by rename (as the fleet simulator
    writes faults) must be read anew, which a kept descriptor would not."""
    reader = SysfsReader(tree)
    await run_scan(scan_pcie, reader, watch=WATCH)
    assert reader.kept_fds == 0
    target = tree / "devices" / "pci0000:00" / A / "current_link_width"
    tmp = target.with_name("current_link_width.tmp")
    tmp.write_text("4\n")
    os.replace(tmp, target)
    devices, _ = await run_scan(scan_pcie, reader, watch=WATCH)
    assert devices[0].current_link_width == 4


async def test_kept_descriptors_are_bounded(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sysfs, "MAX_KEPT_FDS", 3)
    fake = FaultyOs()
    reader = SysfsReader(tree, os_calls=fake.calls(), keep_open=True)
    for _ in range(2):
        assert await run_scan(scan_pcie, reader, watch=WATCH) == await _fresh(tree)
    assert reader.kept_fds == len(fake.open_fds) == 3
    reader.close()
    assert not fake.open_fds


def test_mount_fs_type_takes_the_longest_mount_point() -> None:
    mountinfo = "\n".join(
        [
            "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw",
            "23 22 0:21 / /sys rw,nosuid shared:7 - sysfs sysfs rw",
            "24 23 0:22 / /sys/fs/cgroup rw shared:8 - cgroup2 cgroup2 rw",
            r"25 22 0:23 / /mnt/with\040space rw shared:9 - tmpfs tmpfs rw",
            "garbage line",
        ]
    )
    assert mount_fs_type("/sys/bus/pci/devices", mountinfo) == "sysfs"
    assert mount_fs_type("/sys", mountinfo) == "sysfs"
    assert mount_fs_type("/sys/fs/cgroup/x", mountinfo) == "cgroup2"
    assert mount_fs_type("/sysfoo", mountinfo) == "ext4"
    assert mount_fs_type("/mnt/with space/sys", mountinfo) == "tmpfs"
    assert mount_fs_type("/x", "") is None


def test_on_sysfs_is_false_for_a_fixture_tree_or_unreadable_mountinfo(tmp_path: Path) -> None:
    assert not on_sysfs(str(tmp_path))
    assert not on_sysfs("/sys", mountinfo=tmp_path / "absent")


# --- the collectors, cycle after cycle -------------------------------------------------


@pytest.mark.parametrize("keep_open", [False, True])
@pytest.mark.parametrize("kind", [PcieCollector, EdacCollector, HwmonCollector])
async def test_collectors_read_what_a_fresh_collector_reads_every_cycle(
    kind: type[PcieCollector | EdacCollector | HwmonCollector], keep_open: bool
) -> None:
    settings = CollectorSettings(sysfs=NODE_EXPORTER_SYS)
    reader = SysfsReader(NODE_EXPORTER_SYS, keep_open=keep_open)
    collector = kind(settings, reader=reader)
    results: list[Collected] = [await collector.collect() for _ in range(3)]
    fresh = await kind(settings).collect()
    assert results[0].items
    assert all(r == fresh for r in results)
    assert (reader.kept_fds > 0) is keep_open
    reader.close()


async def test_a_hwmon_chip_gone_between_cycles_is_gone(tmp_path: Path) -> None:
    for n, temp in ((0, "40000\n"), (1, "50000\n")):
        real = tmp_path / "devices" / "virtual" / "thermal" / f"zone{n}" / "hwmon" / f"hwmon{n}"
        real.mkdir(parents=True)
        (real / "name").write_text(f"chip{n}\n")
        (real / "temp1_input").write_text(temp)
        link = tmp_path / "class" / "hwmon" / f"hwmon{n}"
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(f"../../devices/virtual/thermal/zone{n}/hwmon/hwmon{n}")
    settings = CollectorSettings(sysfs=tmp_path)
    collector = HwmonCollector(settings, reader=SysfsReader(tmp_path, keep_open=True))
    assert len((await collector.collect()).items) == 2
    (tmp_path / "class" / "hwmon" / "hwmon1").unlink()
    after = await collector.collect()
    assert after == await HwmonCollector(settings).collect()
    assert len(after.items) == 1
