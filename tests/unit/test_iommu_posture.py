"""The DMA isolation posture (docs/security.md "DMA isolation"): the ``iommu`` collector
on sysfs trees a real kernel wrote (tests/fixtures/iommu/, QEMU guests: PROVENANCE.md),
and on copies of them changed the way a machine's state changes (passthrough on the
command line, a group shared, ACS redirect turned off with setpci, a reader without
root)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from metalguard.agent.collectors.iommu import read_iommu
from metalguard.agent.collectors.iommu_parse import (
    EXT_ACS,
    IommuReading,
    PciFunction,
    acs,
    acs_bits,
    assess,
    capabilities,
    extended_capabilities,
    iommu_args,
    passthrough_by_args,
    port_type,
)
from metalguard.proto.iommu import IommuPosture
from tests.support.iommu_dumps import group_listing

FIXTURES = Path(__file__).parents[1] / "fixtures" / "iommu"
SWITCH_DOWN = ("0000:02:00.0", "0000:02:01.0")
NICS = ("0000:03:00.0", "0000:04:00.0")


def _copy(tmp_path: Path, name: str) -> Path:
    dest = tmp_path / name
    shutil.copytree(FIXTURES / name, dest, symlinks=True)
    return dest


def _posture(root: Path) -> IommuPosture:
    reading = read_iommu(root / "sys", root / "proc")
    return assess(reading)


def _config(root: Path, bdf: str) -> Path:
    return (root / "sys/bus/pci/devices" / bdf).resolve() / "config"


def test_the_collectors_groups_are_the_kernels() -> None:
    for name in ("qemu-switch", "qemu-direct"):
        root = FIXTURES / name
        reading = read_iommu(root / "sys", root / "proc")
        problems = list(reading.problems)
        assert problems == []
        listed = {
            line.split()[0]: tuple(line.split()[1:])
            for line in (root / "groups.txt").read_text().splitlines()
        }
        assert dict(reading.group_members) == listed


def test_nics_behind_a_switch_without_acs_are_shared_and_named() -> None:
    posture = _posture(FIXTURES / "qemu-switch")
    assert posture.posture == "shared"
    said = " ".join(posture.reasons)
    for nic, port in zip(NICS, SWITCH_DOWN, strict=True):
        assert f"NIC {nic}: switch port {port} above it has no ACS" in said
    assert "0000:05:00.0" not in said  # the GPU behind its root port is fine
    assert posture.groups == 8


def test_each_device_behind_its_own_root_port_is_isolated() -> None:
    posture = _posture(FIXTURES / "qemu-direct")
    assert (posture.posture, posture.reasons, posture.mode) == ("isolated", (), "dma-fq")
    assert [d.kind for d in posture.devices] == ["nic", "nic", "gpu"]
    assert all(d.peers == () and d.ats is None for d in posture.devices)


@pytest.mark.parametrize("arg", ["iommu=pt", "intel_iommu=off", "iommu.passthrough=1"])
def test_passthrough_or_off_on_the_command_line_is_off(tmp_path: Path, arg: str) -> None:
    root = _copy(tmp_path, "qemu-direct")
    (root / "proc/cmdline").write_text(f"console=ttyS0 {arg}\n")
    posture = _posture(root)
    assert posture.posture == "off"
    assert posture.reasons[0] == f"passthrough: {arg} on the kernel command line"


def test_an_identity_domain_is_off(tmp_path: Path) -> None:
    root = _copy(tmp_path, "qemu-direct")
    for group in (root / "sys/kernel/iommu_groups").iterdir():
        (group / "type").write_text("identity\n")
    posture = _posture(root)
    assert (posture.posture, posture.mode) == ("off", "identity")
    assert "in identity (passthrough) mode" in posture.reasons[0]


def test_no_iommu_is_off(tmp_path: Path) -> None:
    root = _copy(tmp_path, "qemu-direct")
    shutil.rmtree(root / "sys/kernel/iommu_groups")
    shutil.rmtree(root / "sys/class/iommu")
    for link in (root / "sys/devices").rglob("iommu_group"):
        link.unlink()
    posture = _posture(root)
    assert (posture.posture, posture.mode) == ("off", "off")
    assert posture.reasons[0].startswith("no IOMMU")


def test_a_nic_in_the_gpus_group_is_shared_naming_both(tmp_path: Path) -> None:
    root = _copy(tmp_path, "qemu-direct")
    reading = read_iommu(root / "sys", root / "proc")
    gpu = next(f for f in reading.functions.values() if f.pci_class.startswith("0x03"))
    nic = next(f for f in reading.functions.values() if f.pci_class.startswith("0x02"))
    groups = root / "sys/kernel/iommu_groups"
    # the NIC moves into the GPU's group, as an IOMMU without isolation between them would
    target = os.readlink(groups / str(nic.group) / "devices" / nic.address)
    (groups / str(nic.group) / "devices" / nic.address).unlink()
    os.symlink(target, groups / str(gpu.group) / "devices" / nic.address)
    link = (root / "sys/bus/pci/devices" / nic.address).resolve() / "iommu_group"
    link.unlink()
    os.symlink(os.readlink(link.parent.parent / gpu.address / "iommu_group")
               if (link.parent.parent / gpu.address).exists()
               else f"../../../kernel/iommu_groups/{gpu.group}", link)  # fmt: skip
    posture = _posture(root)
    assert posture.posture == "shared"
    said = " ".join(posture.reasons)
    assert f"GPU {gpu.address} shares IOMMU group {gpu.group} with {nic.address}" in said
    assert f"NIC {nic.address} shares IOMMU group {gpu.group} with {gpu.address}" in said


def _give_acs(config: bytearray, ctl: int) -> None:
    """Chain an ACS capability (capability 0x005f, as QEMU's root ports) after the last
    extended capability of a switch port's config space, at 0x148."""
    last = max(extended_capabilities(bytes(config)).values())
    header = int.from_bytes(config[last : last + 4], "little")
    config[last : last + 4] = (header & 0xFFFFF | 0x148 << 20).to_bytes(4, "little")
    config[0x148:0x14C] = (EXT_ACS | 1 << 16).to_bytes(4, "little")
    config[0x14C:0x150] = (0x005F | ctl << 16).to_bytes(4, "little")


@pytest.mark.parametrize(
    ("ctl", "posture", "said"),
    [
        (0x001D, "isolated", ""),  # SV RR CR UF: what Linux enables
        (0x0019, "shared", "(RR-)"),  # ReqRedir turned off (setpci, for peer-to-peer)
        (0x0000, "shared", "(SV-, RR-, CR-, UF-)"),
    ],
)
def test_acs_redirect_on_the_switch_ports_decides(
    tmp_path: Path, ctl: int, posture: str, said: str
) -> None:
    root = _copy(tmp_path, "qemu-switch")
    for port in SWITCH_DOWN:
        path = _config(root, port)
        config = bytearray(path.read_bytes())
        _give_acs(config, ctl)
        path.write_bytes(bytes(config))
    result = _posture(root)
    assert result.posture == posture, result.reasons
    if said:
        assert all(f"ACS redirect off on switch port {p} above it {said}" in " ".join(
            result.reasons) for p in SWITCH_DOWN)  # fmt: skip


def test_without_root_the_acs_is_unknown(tmp_path: Path) -> None:
    """A user other than root reads 64 bytes of config space: no extended capabilities."""
    root = _copy(tmp_path, "qemu-switch")
    for config in (root / "sys/devices").rglob("config"):
        config.write_bytes(config.read_bytes()[:64])
    result = _posture(root)
    assert result.posture == "unknown"
    assert all(d.ats is None for d in result.devices)
    assert any("ACS of bridge 0000:02:00.0 unreadable" in r for r in result.reasons)


def test_config_space_parsing_on_a_real_root_port() -> None:
    config = _config(FIXTURES / "qemu-direct", "0000:00:01.0").read_bytes()
    assert port_type(config) == "root"
    assert 0x10 in capabilities(config)
    assert extended_capabilities(config)[EXT_ACS] == 0x148
    regs = acs(config)
    assert regs is not None
    assert acs_bits(regs.cap) == ("SV", "TB", "RR", "CR", "UF", "DT")
    assert acs_bits(regs.ctl) == ("SV", "RR", "CR", "UF")
    assert regs.redirects


def test_broken_config_space_never_raises() -> None:
    for data in (b"", b"\xff" * 64, b"\x00" * 4096, bytes(range(256)) * 16):
        capabilities(data)
        extended_capabilities(data)
        acs(data)
        port_type(data)
    looped = bytearray(4096)
    looped[0x06], looped[0x34], looped[0x40] = 0x10, 0x40, 0x10  # a PCI Express function
    looped[0x100:0x104] = (EXT_ACS | 1 << 16 | 0x100 << 20).to_bytes(4, "little")  # next: itself
    assert extended_capabilities(bytes(looped)) == {EXT_ACS: 0x100}


def test_iommu_kernel_arguments() -> None:
    line = (
        "BOOT_IMAGE=/vmlinuz ro quiet intel_iommu=on,sm_on iommu=pt amd_iommu_dump=1 iommu.strict=1"
    )
    assert iommu_args(line) == (
        "intel_iommu=on,sm_on",
        "iommu=pt",
        "amd_iommu_dump=1",
        "iommu.strict=1",
    )
    assert passthrough_by_args(iommu_args(line)) == "iommu=pt on the kernel command line"
    assert passthrough_by_args(("intel_iommu=on", "iommu=nopt")) is None
    assert passthrough_by_args(("amd_iommu=off",)) == "amd_iommu=off on the kernel command line"


GROUPS = FIXTURES / "groups"


@pytest.mark.parametrize(
    ("listing", "cmdline", "posture", "said"),
    [
        # X99 (linux-pci): 5.8's groups isolate every GPU and NIC; 5.9's regression put
        # the I211 NIC in one group with two other endpoints
        ("lore-linux-pci-boris-x99-kernel5.8.groups.txt", "", "isolated", ""),
        ("lore-linux-pci-boris-x99-kernel5.9.groups.txt", "", "shared",
         "NIC 0000:09:00.0 shares IOMMU group 29 with 0000:0c:00.0, 0000:0d:00.0"),
        # six V100s, two pairs sharing a group (a switch without ACS above each pair)
        ("quansight-6xV100.groups-nvidia-only.txt", "", "shared",
         "GPU 0000:27:00.0 shares IOMMU group 19 with 0000:28:00.0"),
        # X299 Taichi booted with iommu=pt (its dmesg's command line)
        ("lore-iommu-x299-taichi.groups.txt",
         (GROUPS / "lore-iommu-x299-taichi.dmesg-5.4-cmdline.txt").read_text().split(
             "Command line: ", 1)[1], "off", "passthrough: iommu=pt on the kernel command line"),
    ],
)  # fmt: skip
def test_the_posture_of_real_machines_group_listings(
    listing: str, cmdline: str, posture: str, said: str
) -> None:
    """Published ``IOMMU Group N ...`` listings of real machines (PROVENANCE.md in
    tests/fixtures/iommu/lspci/): the groups judged as the collector judges a node's."""
    groups = group_listing((GROUPS / listing).read_text())
    functions = {
        address: PciFunction(address=address, pci_class=cls, group=group)
        for group, members in groups.items()
        for address, cls in members
    }
    reading = IommuReading(
        iommus=("dmar0",),
        cmdline=cmdline,
        group_types=dict.fromkeys(groups, "DMA"),
        group_members={g: tuple(sorted(a for a, _ in m)) for g, m in groups.items()},
        functions=functions,
    )
    result = assess(reading)
    assert result.posture == posture, result.reasons
    if said:
        assert said in result.reasons
    else:
        assert result.reasons == ()


def test_agent_collect_text_shows_the_posture_and_its_reasons() -> None:
    from metalguard.agent.render import render_text
    from metalguard.proto.base import NodeIdentity
    from metalguard.proto.telemetry import TelemetryBatch

    posture = _posture(FIXTURES / "qemu-switch")
    batch = TelemetryBatch(node=NodeIdentity(region="r", cluster="c", node="n"), seq=1, ts=0.0,
                           iommu=posture)  # fmt: skip
    text = render_text(batch)
    assert "iommu shared mode=dma-fq units=dmar0 groups=8 devices=3" in text
    assert "switch port 0000:02:00.0 above it has no ACS" in text
