"""The configuration space parser (agent/collectors/iommu_parse.py) on real dumps
(tests/fixtures/iommu/lspci/, each source in its PROVENANCE.md: pciutils' test files,
linux-pci mails, a sysfs ``config`` binary): the ACS and ATS it reads are lspci's own
decoding of the same bytes published beside each dump (lspci run on the dumps here:
tests/integration/test_iommu_lspci.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from metalguard.agent.collectors.iommu_parse import (
    CAP_PCIE,
    EXT_ACS,
    acs,
    acs_bits,
    ats_enabled,
    capabilities,
    extended_capabilities,
)
from tests.support.iommu_dumps import DUMPS, LSPCI, config_of, decoded, ours, published


def test_there_are_dumps_with_acs_and_ats() -> None:
    configs = [config_of(d) for d in DUMPS]
    assert sum(acs(c) is not None for c in configs) >= 5
    assert sum(ats_enabled(c) is not None for c in configs) >= 3


DECODED = [d for d in DUMPS if published(d) is not None]
"""The dumps published with lspci's decoding beside them (the others: lspci -F checks them,
tests/integration/test_iommu_lspci.py)."""


def test_every_dump_is_whole() -> None:
    for dump in DUMPS:
        assert len(config_of(dump)) in (64, 256, 4096), dump.name
    assert len(DECODED) >= 15


@pytest.mark.parametrize("dump", DECODED, ids=[d.name.split(".lspci")[0] for d in DECODED])
def test_acs_and_ats_as_the_published_lspci_decoded_them(dump: Path) -> None:
    config = config_of(dump)
    text = published(dump)
    assert text is not None
    want = decoded(text.read_text())
    if len(config) < 4096:  # lspci showed what the machine had; the dump cannot
        assert ours(config) == (None, None, None)
        return
    assert ours(config) == want, dump.name


def test_a_sysfs_config_binary() -> None:
    """pcics' copy of a Sky Lake-SP root port's /sys/bus/pci/devices/.../config."""
    config = (LSPCI / "pcics-8086_2030-skylake-sp-rootport.config.bin").read_bytes()
    assert len(config) == 4096
    assert extended_capabilities(config)[EXT_ACS] == 0x110
    regs = acs(config)
    assert regs is not None
    assert (acs_bits(regs.cap), regs.ctl) == (("SV", "TB", "RR", "CR", "UF"), 0)
    assert not regs.redirects


def test_a_function_without_pcie_has_no_extended_capabilities() -> None:
    """pciutils' broken-ecaps: an ATI host bridge with no PCI Express capability whose
    bytes past 0x100 are garbage (a naive walk finds a chain that loops): none."""
    (dump,) = LSPCI.glob("pciutils-broken-ecaps--*.lspci-xxxx.txt")
    config = config_of(dump)
    assert CAP_PCIE not in capabilities(config)
    assert extended_capabilities(config) == {}
    assert acs(config) is None
