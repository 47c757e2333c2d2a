"""SysfsReader: bounded, root-bound reads whose failures are results, never exceptions."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from metalguard.agent.sysfs import ReadStatus, SysfsReader, natural_key
from tests.support.faultyos import FaultyOs
from tests.support.promtext import NODE_EXPORTER_SYS


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "sys"
    (root / "class" / "thing").mkdir(parents=True)
    (root / "class" / "thing" / "value").write_text("42\n")
    (root / "class" / "thing" / "subdir").mkdir()
    return root


@pytest.fixture
def fifo_with_writer(tree: Path) -> Iterator[Path]:
    """A FIFO with a writer attached and no data: a read answers EAGAIN."""
    path = tree / "class" / "thing" / "fifo"
    os.mkfifo(path)
    writer = os.open(path, os.O_RDWR | os.O_NONBLOCK)
    try:
        yield path
    finally:
        os.close(writer)


def test_reads_text_unstripped(tree: Path) -> None:
    result = SysfsReader(tree).read("class/thing/value")
    assert result.status is ReadStatus.OK
    assert result.ok
    assert result.text == "42\n"
    assert result.error is None


def test_missing_file_is_missing_not_error(tree: Path) -> None:
    result = SysfsReader(tree).read("class/thing/absent")
    assert result.status is ReadStatus.MISSING
    assert result.text is None


def test_missing_parent_is_missing(tree: Path) -> None:
    assert SysfsReader(tree).read("class/nothing/here").status is ReadStatus.MISSING


def test_directory_is_an_error(tree: Path) -> None:
    result = SysfsReader(tree).read("class/thing/subdir")
    assert result.status is ReadStatus.ERROR
    assert result.error is not None
    assert "EISDIR" in result.error


def test_dangling_symlink_is_missing(tree: Path) -> None:
    (tree / "class" / "thing" / "gone").symlink_to("../../devices/gone")
    assert SysfsReader(tree).read("class/thing/gone").status is ReadStatus.MISSING


def test_oversize_file_is_refused_after_bounded_read(tree: Path) -> None:
    (tree / "big").write_bytes(b"7" * (10 * 1024 * 1024))
    fake = FaultyOs()
    result = SysfsReader(tree, os_calls=fake.calls()).read("big")
    assert result.status is ReadStatus.ERROR
    assert result.error == "attribute larger than 65536 bytes"
    assert sum(fake.returned) <= 64 * 1024 + 1
    assert sum(fake.requested) <= 64 * 1024 + 1
    assert not fake.open_fds


def test_file_of_exactly_max_bytes_is_read(tree: Path) -> None:
    (tree / "edge").write_bytes(b"x" * 100)
    assert SysfsReader(tree, max_bytes=100).read("edge").text == "x" * 100
    assert SysfsReader(tree, max_bytes=99).read("edge").error == "attribute larger than 99 bytes"


def test_max_bytes_must_be_positive(tree: Path) -> None:
    with pytest.raises(ValueError, match="positive"):
        SysfsReader(tree, max_bytes=0)


def test_invalid_utf8_is_replaced(tree: Path) -> None:
    (tree / "bin").write_bytes(b"ab\xffcd")
    assert SysfsReader(tree).read("bin").text == "ab\ufffdcd"


@pytest.mark.parametrize("rel", ["../outside", "class/../../outside", "/etc/hostname", ".."])
def test_paths_escaping_the_root_are_refused(tree: Path, rel: str) -> None:
    (tree.parent / "outside").write_text("secret")
    reader = SysfsReader(tree)
    result = reader.read(rel)
    assert result.status is ReadStatus.ERROR
    assert result.error == "path escapes the sysfs root"
    assert reader.listdir(rel).status is ReadStatus.ERROR
    assert reader.resolve(rel) is None
    assert not reader.is_dir(rel)


def test_symlink_out_of_the_root_is_refused(tree: Path) -> None:
    (tree.parent / "outside").write_text("secret")
    (tree / "class" / "thing" / "leak").symlink_to(tree.parent / "outside")
    reader = SysfsReader(tree)
    assert reader.read("class/thing/leak").error == "path escapes the sysfs root"
    assert reader.resolve("class/thing/leak") is None
    assert reader.readlink("class/thing/leak") == str(tree.parent / "outside")


def test_dotdot_inside_the_root_follows_symlinks_physically(tree: Path) -> None:
    device = tree / "devices" / "platform" / "chip.0"
    device.mkdir(parents=True)
    (device / "name").write_text("chip\n")
    (tree / "class" / "thing" / "device").symlink_to("../../devices/platform/chip.0")
    reader = SysfsReader(tree)
    # ../ of the link target (devices/platform), not of class/thing.
    assert reader.listdir("class/thing/device/..").names == ("chip.0",)


@pytest.mark.parametrize(
    ("err", "status"),
    [
        (errno.EAGAIN, ReadStatus.NO_DATA),
        (errno.EIO, ReadStatus.NO_DATA),
        (errno.ENODATA, ReadStatus.NO_DATA),
        (errno.EACCES, ReadStatus.ERROR),
        (errno.EPERM, ReadStatus.ERROR),
        (errno.ENOENT, ReadStatus.MISSING),
    ],
)
def test_read_errnos_are_classified(tree: Path, err: int, status: ReadStatus) -> None:
    fake = FaultyOs(read_errors={"/value": err})
    result = SysfsReader(tree, os_calls=fake.calls()).read("class/thing/value")
    assert result.status is status
    assert result.text is None
    assert result.error is not None
    assert errno.errorcode[err] in result.error
    assert not fake.open_fds, "the fd must be closed after a failed read"


@pytest.mark.parametrize(
    ("err", "status"),
    [
        (errno.EACCES, ReadStatus.ERROR),
        (errno.EPERM, ReadStatus.ERROR),
        (errno.ENOENT, ReadStatus.MISSING),
        (errno.ENXIO, ReadStatus.NO_DATA),
    ],
)
def test_open_errnos_are_classified(tree: Path, err: int, status: ReadStatus) -> None:
    fake = FaultyOs(open_errors={"/value": err})
    result = SysfsReader(tree, os_calls=fake.calls()).read("class/thing/value")
    assert result.status is status
    assert result.text is None


def test_real_eagain_from_a_fifo_is_no_data(tree: Path, fifo_with_writer: Path) -> None:
    result = SysfsReader(tree).read("class/thing/fifo")
    assert result.status is ReadStatus.NO_DATA
    assert result.error is not None
    assert "EAGAIN" in result.error


def test_fifo_without_writer_does_not_block(tree: Path) -> None:
    os.mkfifo(tree / "lonely")
    assert SysfsReader(tree).read("lonely").text == ""


def test_read_files_keys_by_name(tree: Path) -> None:
    results = SysfsReader(tree).read_files("class/thing", ["value", "absent"])
    assert results["value"].text == "42\n"
    assert results["absent"].status is ReadStatus.MISSING


def test_listdir_sorts_naturally(tree: Path) -> None:
    for name in ("hwmon10", "hwmon2", "hwmon1"):
        (tree / name).mkdir()
    names = SysfsReader(tree).listdir("").names
    assert names == ("class", "hwmon1", "hwmon2", "hwmon10")


def test_listdir_missing_and_not_a_dir(tree: Path) -> None:
    reader = SysfsReader(tree)
    assert reader.listdir("nope").status is ReadStatus.MISSING
    listing = reader.listdir("class/thing/value")
    assert listing.status is ReadStatus.MISSING
    assert listing.names == ()


def test_glob_filters_names(tree: Path) -> None:
    for name in ("mc0", "mc1", "power", "mcx"):
        (tree / name).mkdir()
    assert SysfsReader(tree).glob("", "mc[0-9]*") == ("mc0", "mc1")


def test_resolve_follows_fixture_links() -> None:
    reader = SysfsReader(NODE_EXPORTER_SYS)
    assert (
        reader.resolve("bus/pci/devices/0000:01:00.0")
        == "devices/pci0000:00/0000:00:02.1/0000:01:00.0"
    )
    assert reader.resolve("class/hwmon/hwmon10/device") == (
        "devices/platform/soc/18000000.wifi/ieee80211/phy0"
    )
    assert reader.resolve("class/hwmon/hwmon4") == "class/hwmon/hwmon4"
    assert reader.resolve("class/hwmon/hwmon3/device") is None
    assert reader.resolve("") == ""


def test_readlink_of_non_link_is_none(tree: Path) -> None:
    assert SysfsReader(tree).readlink("class/thing/value") is None
    assert SysfsReader(tree).readlink("class/thing/absent") is None


def test_natural_key_orders_numbers_numerically() -> None:
    names = ["csrow10", "csrow2", "dimm1", "csrow1"]
    assert sorted(names, key=natural_key) == ["csrow1", "csrow2", "csrow10", "dimm1"]
